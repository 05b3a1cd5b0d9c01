"""The passes over |acc| a threshold estimator makes (compressors/threshold.py, SIDCo's
torch reference): statistics, counts at candidate thresholds, the final selection, and
the rescaling of magnitudes whose mean would under- or overflow second moments. One
interface, two implementations, picked per tensor by `passes`:

- FusedPasses: the kernels of ops.py on acc itself: one read per statistic or count, no
  |acc| buffer and no mask, a selection that writes the values sent; its first
  statistics pass is also the NaN/Inf check the Session folds into the compressor
  (Context.check_finite);
- TorchPasses: |acc| computed once (float32 for 16-bit inputs, so statistics neither
  overflow nor lose precision), sums in float64, a count that keeps its mask for the
  selection at the same threshold.

Both compare in acc's precision with the threshold rounded as torch rounds it, so for
the same threshold they select the same positions; their sums differ only in order
(~1e-16 relative). Unlike Top-k, the number selected, k̂, varies around the target k.
"""

from __future__ import annotations

import math

import torch

from compressors.kernels import cpu, ops
from compressors.kernels.numerics import SAFE_MEAN, moments_from_sums
from compressors.kernels.types import NonFinite, Selected

# -- the torch pieces ---------------------------------------------------------------------------


def magnitudes(acc: torch.Tensor) -> torch.Tensor:
    """|acc| as a fresh tensor (never aliases acc), in float32 for 16-bit inputs so
    statistics do not overflow or lose precision (float64 stays float64)."""
    if acc.dtype in (torch.float32, torch.float64):
        return acc.abs()
    return acc.to(torch.float32).abs_()


def nonzero_indices(mask: torch.Tensor) -> torch.Tensor:
    """Positions of True in a 1-D mask (int64): the one place indices are materialised."""
    return mask.nonzero().view(-1)


def mean_abs(mag: torch.Tensor) -> float:
    """mean(|x|) of a magnitude tensor, accumulated in float64."""
    return float(mag.sum(dtype=torch.float64)) / mag.numel()


def count_at_least(values: torch.Tensor, threshold: float) -> tuple[int, torch.Tensor]:
    """#{values ≥ threshold} by one compare and a count_nonzero (a bool .sum() takes the
    slow int64 path on CPU), and the mask, for reuse as the final selection."""
    mask = values >= threshold
    return int(torch.count_nonzero(mask)), mask


def safe(mean: float) -> bool:
    """Whether magnitudes with this mean can be squared as they are (numerics.SAFE_MEAN)."""
    return SAFE_MEAN[0] <= mean <= SAFE_MEAN[1]


def rescale_for_moments(mag: torch.Tensor, mean: float) -> tuple[float, float]:
    """Divide `mag` in place by a scale that brings its mean into SAFE_MEAN when it is
    outside (tiny or huge gradients, or a sum that overflowed); return (scale, new mean).
    Scale-equivariant rules computed on the result give thresholds in units of
    mag/scale."""
    if safe(mean):
        return 1.0, mean
    scale = mean if math.isfinite(mean) else float(mag.max())  # the sum overflowed
    mag.div_(scale)
    return scale, mean_abs(mag)


def mean_and_variance(values: torch.Tensor, mean: float | None = None) -> tuple[float, float]:
    """Population mean and variance of a 1-D float tensor from float64 sums of y and y²;
    when the variance is small against the squared mean (cancellation) it is recomputed
    by a second pass around the mean (numerics.moments_from_sums)."""
    v = values.to(torch.float64)
    n = v.numel()
    if mean is None:
        mean = float(v.sum()) / n
    second = float((v * v).sum()) / n
    return moments_from_sums(mean, second, lambda m: float(((v - m) ** 2).sum()) / n)


# -- the fused pieces -----------------------------------------------------------------------


def check_sum_finite(acc: torch.Tensor, total: float, check: bool) -> None:
    """The folded NaN/Inf check (`check`: Context.check_finite) from a fused pass's float64
    Σ|acc|: for float32 data it is finite exactly when every element is (it cannot
    overflow); a float64 sum may overflow with finite elements, so then one check pass
    decides. NonFinite when acc holds a NaN or an Inf."""
    if check and not math.isfinite(total) and not ops.all_finite(acc):
        raise NonFinite("the tensor holds NaN or Inf")


def pick(acc: torch.Tensor, threshold: float, check_finite: bool = False,
         expected: int = 0) -> Selected:
    """Ascending int64 positions of |acc| ≥ threshold in one fused pass, with acc's values
    at them written by the same pass (what the protocol sends; not gathered from acc
    again). `check_finite`: the same read raises NonFinite on a NaN or an Inf.
    `expected`: about how many pass (k), which picks the faster writing layout."""
    indices, values = ops.select(acc, threshold, values=True, signed=True,
                                 check_finite=check_finite, reserve=expected)
    return Selected(indices, values)


def pool_index_dtype(pool: torch.Tensor) -> torch.dtype:
    """The positions dtype to ask ops.pool for: int32 on the CPU below 2^31 elements (the
    dense compaction then stores one vector of positions per group of 8 instead of two;
    index_select takes int32, and payload indices are int32 there anyway), else int64 (on
    CUDA the selection writes int64: a conversion would only add a kernel)."""
    narrow = pool.device.type == "cpu" and pool.numel() < 1 << 31
    return torch.int32 if narrow else torch.int64


# -- the two implementations --------------------------------------------------------------------


def fused(acc: torch.Tensor, pools: bool = False) -> bool:
    """Whether `passes` gives FusedPasses for acc (`pools`: the estimator also compacts
    probe sets, which the kernels do for float32 only)."""
    return ops.supports(acc) and (not pools or acc.dtype == torch.float32)


def passes(acc: torch.Tensor, check_finite: bool = False, pools: bool = False):
    """FusedPasses where the kernels take acc (see `fused`), else TorchPasses."""
    return FusedPasses(acc, check_finite) if fused(acc, pools) else TorchPasses(acc)


class FusedPasses:
    """The kernels on acc itself (see the module docstring). `source` is what counts and
    compactions start from (acc); thresholds are in units of |acc| (`scale` 1)."""

    scale = 1.0

    def __init__(self, acc: torch.Tensor, check_finite: bool):
        self.source = acc
        self.check_finite = check_finite
        # The kernels are picked once per tensor: a search's counts and compactions of acc
        # then skip ops' per-call dispatch (a few microseconds each, tens of probes a step).
        self.kernels = cpu if ops.supports_cpu(acc) else ops

    def moments(self) -> tuple[float, float]:
        """(mean, variance) of |acc|: one pass of Σ|x| and Σx² (a second, centred one only
        under cancellation), which also checks for NaN and Inf."""
        acc = self.source
        st = ops.stats(acc, squares=True)
        self._checked(st.sum)
        n = st.count
        return moments_from_sums(st.sum / n, st.sumsq / n,
                                 lambda m: ops.stats(acc, shift=m, squares=True).sumsq / n)

    def mean_and_max(self) -> tuple[float, float]:
        """(mean, max) of |acc| in one pass, which also checks for NaN and Inf."""
        st = ops.stats(self.source, extremes=True)
        self._checked(st.sum)
        return st.sum / st.count, st.max

    def _checked(self, total: float) -> None:
        """The folded check from the first statistics pass's Σ|x|; later passes skip it."""
        check_sum_finite(self.source, total, self.check_finite)
        self.check_finite = False

    def count(self, t: float, pool: torch.Tensor | None = None) -> tuple[int, None]:
        """#{|pool| ≥ t} (pool: acc, or a compaction of it), and no mask."""
        return self.kernels.count(self.source if pool is None else pool, t), None

    def shrink(self, pool: torch.Tensor, t: float, _mask, keep: float) -> torch.Tensor:
        """The values of pool with |x| ≥ t (`keep`: about the fraction that passes), in this
        thread's workspace kept between calls."""
        return self.kernels.pool(pool, t, dense=keep > ops.DENSE_FRACTION, strict=False,
                                 index_dtype=pool_index_dtype(pool), workspace="mstopk")[2]

    def select(self, t: float, _mask=None, expected: int = 0) -> Selected:
        """{|acc| ≥ t} with the values sent, in one pass; the folded check when no
        statistics pass came first (hard_threshold)."""
        return pick(self.source, t, check_finite=self.check_finite, expected=expected)

    def rescaled(self) -> TorchPasses:
        """The torch passes over |acc| rescaled (numerics.SAFE_MEAN): the fused sums cannot
        be taken as they are."""
        return TorchPasses(self.source).rescaled()


class TorchPasses:
    """Torch over |acc| computed once (see the module docstring); after `rescaled`,
    thresholds are in units of |acc|/scale."""

    def __init__(self, acc: torch.Tensor):
        self.acc = acc
        self.source = magnitudes(acc)
        self.scale = 1.0

    def moments(self) -> tuple[float, float]:
        mean = mean_abs(self.source)
        return mean_and_variance(self.source, mean)

    def mean_and_max(self) -> tuple[float, float]:
        return mean_abs(self.source), float(self.source.max())

    def count(self, t: float, pool: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        return count_at_least(self.source if pool is None else pool, t)

    def shrink(self, pool: torch.Tensor, t: float, mask: torch.Tensor, keep: float
               ) -> torch.Tensor:
        return pool[mask]

    def select(self, t: float, mask: torch.Tensor | None = None, expected: int = 0
               ) -> Selected:
        """Positions of |acc| ≥ t (the mask of the last count at t, when given), with
        acc's values at them."""
        return Selected.gather(self.acc, nonzero_indices(self.source >= t if mask is None
                                                         else mask))

    def rescaled(self) -> TorchPasses:
        """Divide the magnitudes in place by the scale that brings their mean into
        SAFE_MEAN (when it is outside)."""
        self.scale, _ = rescale_for_moments(self.source, mean_abs(self.source))
        return self
