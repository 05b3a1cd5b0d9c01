"""DGC: Deep Gradient Compression's sampled threshold (Lin et al., ICLR 2018), as the SIDCo
authors' code runs it (the DGC variant the SIDCo paper benchmarks).

The k-th largest |acc| is estimated from a small uniform sample instead of sorting the
tensor: take the top ceil(s·δ) of s sampled magnitudes, use their minimum as the
threshold, and select every |acc_i| >= threshold in one pass. If the estimate was too
low and more than `max_overselect`·k elements pass ("~4k/3" in the SIDCo authors' code),
an exact top-k runs among the selected elements only (the "re-top-k"), which is cheap
because they are few.

Under-selection is accepted, as that variant accepts it: when fewer than k elements
pass, exactly those are sent (k̂ < k) and error feedback keeps the rest for later steps.
No second threshold round is run and nothing is padded. DGC's own authors' code differs
here: it lowers the threshold ×0.8 while fewer than 0.8·k pass and never sends more than
k, which `dgc_reference` (compressors/dgc_reference.py) does.

`sample_threshold` is shared with DRAGONN (compressors/dragonn.py), whose paper uses the
same estimator.
"""

from __future__ import annotations

import functools
import math

import torch

from compressors.base import Context, Selected, Sparsifier, check_ratio
from compressors.kernels import ops
from compressors.registry import register


def check_sampling(sample_ratio: float, min_sample_top: int) -> tuple[float, int]:
    """Validate the sampling parameters shared by DGC and DRAGONN."""
    sample_ratio = check_ratio(sample_ratio, "sample_ratio")
    if isinstance(min_sample_top, bool) or not isinstance(min_sample_top, int) or min_sample_top < 1:
        raise ValueError(
            f"min_sample_top={min_sample_top!r} must be a positive integer: it is how many "
            "sampled elements must lie above the estimated threshold (e.g. 10)"
        )
    return sample_ratio, min_sample_top


def sample_size(numel: int, ratio: float, sample_ratio: float, min_sample_top: int) -> int:
    """Sample size s = max(⌈d·sample_ratio⌉, ⌈min_sample_top/δ⌉), at most d.

    The floor keeps the estimate usable on small tensors and small δ: with 1% of a 10⁵
    tensor at δ = 0.001 the sample's top part would hold a single element (threshold = the
    sample maximum, whose count above it is exponentially distributed). With the floor the
    top part holds at least `min_sample_top` elements."""
    by_ratio = math.ceil(numel * sample_ratio * (1 - 1e-12))
    by_floor = math.ceil(min_sample_top / ratio * (1 - 1e-12))
    return max(1, min(numel, max(by_ratio, by_floor)))


def sample_threshold(
    acc: torch.Tensor,
    ratio: float,
    k: int,
    sample_ratio: float,
    min_sample_top: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """DGC's threshold: min of the top ⌈s·δ⌉ of s magnitudes drawn uniformly (with
    replacement) from |acc| with `generator`. 0-dim tensor in acc's dtype, on acc's device
    (on accelerators without the Triton kernels drawing the stream's seed is one host
    synchronisation).

    Below 2³¹ elements the s positions come from a counter-based stream keyed by one
    64-bit seed drawn from `generator`: p_i = (h(i)·d) >> 32 with
    compressors.kernels.counter_stream.counter_hash h, so the kernels (C++ on the CPU,
    Triton on CUDA) draw and read the sample in one pass without a positions tensor, and
    the torch twin computes the same p_i: every device reads the same positions for the
    same seed (ops.sample_abs). (The multiply-shift map gives each position probability ⌊2³²/d⌋/2³² or
    ⌈2³²/d⌉/2³², within d/2³² of uniform: 0.6% relative at d = 26M.) Larger tensors draw
    their positions with torch.randint.

    When the sample would cover the whole tensor, the exact k-th largest |acc| is used.
    Statistics are computed in float32 (float64 for float64 input); the result is one of
    acc's own magnitudes, so converting it back to acc's dtype is exact. On CUDA with the
    Triton kernels nothing here waits for the device: the seed stays there, read by the
    sampling kernel. A zero threshold (an all-zero sample) is raised to the dtype's
    smallest positive value, so selection means |acc| > 0: zeros are never sent (they
    carry nothing) and an all-zero or mostly zero tensor selects only its non-zeros
    instead of everything.
    """
    numel = acc.numel()
    stat_dtype = torch.float64 if acc.dtype == torch.float64 else torch.float32
    s = sample_size(numel, ratio, sample_ratio, min_sample_top)
    if s >= numel:
        sample = acc.abs().to(stat_dtype)
        top = k
    else:
        sample = ops.sample_abs(acc.reshape(-1), s, generator).to(stat_dtype)
        top = max(1, min(s, math.ceil(s * ratio * (1 - 1e-12))))
    if sample.device.type == "cpu":
        # The top-th largest (= the minimum of the top `top`) by a selection in place:
        # numpy's introselect, about twice as fast as torch.topk here.
        values = sample.numpy()  # a fresh tensor: partitioned in place
        at = values.size - top
        values.partition(at)
        threshold = torch.tensor(values[at], dtype=sample.dtype)
    else:
        threshold = torch.topk(sample, top, sorted=False).values.min()
    # one kernel on an accelerator (torch.maximum with a nextafter tensor was five)
    return threshold.to(acc.dtype).clamp_min(smallest_positive(acc.dtype))


@functools.cache
def smallest_positive(dtype: torch.dtype) -> float:
    """The dtype's smallest positive value (its smallest subnormal), exact as a float."""
    zero = torch.zeros((), dtype=dtype)
    return float(torch.nextafter(zero, torch.ones((), dtype=dtype)))


@register("dgc")
class DGC(Sparsifier):
    """The SIDCo authors' DGC: sampled-threshold Top-k, re-top-k on over-selection.

    See the module docstring.

    ratio: δ = k/d. sample_ratio: fraction of |acc| sampled (1%). max_overselect: re-top-k
    runs when more than max_overselect·k elements pass the threshold (4/3).
    min_sample_top: the sample is enlarged (up to the whole tensor) until at least this
    many sampled elements are expected above the threshold.
    Default feedback: DGC momentum correction.
    """

    default_feedback = "momentum"

    def __init__(
        self,
        ratio: float = 0.01,
        sample_ratio: float = 0.01,
        max_overselect: float = 4 / 3,
        min_sample_top: int = 10,
    ):
        super().__init__(ratio)
        self.sample_ratio, self.min_sample_top = check_sampling(sample_ratio, min_sample_top)
        if (
            isinstance(max_overselect, bool)
            or not isinstance(max_overselect, (int, float))
            or not math.isfinite(max_overselect)
            or max_overselect < 1
        ):
            raise ValueError(
                f"max_overselect={max_overselect!r} must be a finite number >= 1: re-top-k "
                "runs when more than max_overselect·k elements pass the threshold (DGC: 4/3)"
            )
        self.max_overselect = float(max_overselect)

    def overselect_limit(self, k: int) -> int:
        """Most elements kept without re-top-k: ⌊max_overselect·k⌋ (a limit past 2^62
        means never: more elements than any tensor holds)."""
        limit = self.max_overselect * k * (1 + 1e-12)
        return max(k, math.floor(min(limit, 2.0**62)))

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        """The candidates at or above the sampled threshold, re-top-k'd above the limit;
        extra: the threshold, the candidates' count and whether the re-top-k ran."""
        threshold = sample_threshold(
            acc, self.ratio, k, self.sample_ratio, self.min_sample_top, ctx.generator
        )
        # One pass: positions and values of the candidates (the values sent), with the
        # folded NaN/Inf check when the Session asks (ctx.check_finite); fused, with no
        # full-size buffer, where a kernel takes acc (on CUDA the threshold stays on the
        # device: the total is the one wait).
        candidates, values = ops.select(acc, threshold, values=True, signed=True,
                                        check_finite=ctx.check_finite, reserve=k)
        count = candidates.numel()
        retopk = count > self.overselect_limit(k)
        if retopk:  # the re-top-k among the candidates
            best = torch.topk(values.abs(), k, sorted=False).indices
            candidates, values = candidates[best], values[best]
        return Selected(candidates, values,
                        {"threshold": float(threshold), "candidates": count, "retopk": retopk})

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        # The sample reads 1% of acc; the fused selection pass reads all of it and checks.
        return ops.supports(acc)
