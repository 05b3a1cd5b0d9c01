"""Threshold sparsifiers: select {i : |acc_i| ≥ t} for a threshold t that is either fixed
(hard_threshold) or estimated each step from cheap statistics of |acc| (gaussianksgd,
redsync, mstopk; SIDCo's fits live in compressors/sidco.py and share the base here).

All of them cost a few linear passes: |acc| is computed once (float32 for 16-bit
inputs), candidate thresholds are scored by counting reductions, nothing is sorted, and
indices are materialised once at the end with nonzero. Statistics are accumulated in
float64.

Two paths compute the same selection. The reference path is pure torch (it runs for
16-bit, non-contiguous or accelerator tensors, when GRADCOMP_NATIVE=0, or when no C++
compiler is present). The native path (compressors._native, contiguous CPU float32/float64)
fuses each pass into one read of acc with no full-size temporary: no |acc| buffer, no
mask, indices compacted in the same pass. Comparisons are made in acc's precision with
the threshold rounded to it exactly as torch does, so for the same threshold both paths
select the same indices; thresholds come from the same float64 statistics, summed in a
different order (agreement to ~1e-16 relative). Unlike Top-k, the number selected,
k̂, varies around the target k; how far is what the SIDCo paper's Figure 1(c) measures
and what Outcome.selected / Outcome.target record.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import torch

from compressors import _native
from compressors.base import Context, Protocol, Selected, Sparsifier
from compressors.registry import register

# ctx.state key under which `select` leaves this step's diagnostics for `protocol` to move
# into Outcome.extra (popped in the same step: never persists across steps).
_EXTRA = "_step_extra"


def magnitudes(acc: torch.Tensor) -> torch.Tensor:
    """|acc| as a fresh tensor this module owns (never aliases acc), in float32 for 16-bit
    inputs so statistics do not overflow or lose precision (float64 stays float64)."""
    if acc.dtype in (torch.float32, torch.float64):
        return acc.abs()
    return acc.to(torch.float32).abs_()


def nonzero_indices(mask: torch.Tensor) -> torch.Tensor:
    """Positions of True in a 1-D mask (int64): the one place indices are materialised."""
    return mask.nonzero().view(-1)


def empty_indices(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def use_native(acc: torch.Tensor) -> bool:
    """Whether the fused native kernels take `acc` (see the module docstring)."""
    return _native.supports(acc)


def native_pick(acc: torch.Tensor, threshold: float, check_finite: bool = False,
                expected: int = 0) -> Selected:
    """Ascending int64 positions of |acc| ≥ threshold in one fused pass (native path), with
    acc's values at them written by the same pass (what the protocol sends; not gathered
    from acc again). `check_finite`: the same read raises _native.NonFinite on a NaN or an
    Inf. `expected`: about how many pass (k), which picks the faster writing layout."""
    indices, values = _native.select(acc, threshold, values=True, signed=True,
                                     check_finite=check_finite, reserve=expected)
    return Selected(indices, values)


def check_sum_finite(acc: torch.Tensor, total: float, ctx: Context) -> None:
    """The folded NaN/Inf check (ctx.check_finite) from a native pass's float64 Σ|acc|:
    for float32 data it is finite exactly when every element is (it cannot overflow); a
    float64 sum may overflow with finite elements, so then one check pass decides."""
    if ctx.check_finite and not math.isfinite(total) and not _native.all_finite(acc):
        raise _native.NonFinite("the tensor holds NaN or Inf")


def mean_abs(mag: torch.Tensor) -> float:
    """mean(|x|) of a magnitude tensor, accumulated in float64 (reference path)."""
    return float(mag.sum(dtype=torch.float64)) / mag.numel()


def count_at_least(values: torch.Tensor, threshold: float) -> tuple[int, torch.Tensor]:
    """#{values ≥ threshold} by one compare and a count_nonzero (a bool .sum() takes the
    slow int64 path on CPU), and the mask, for reuse as the final selection."""
    mask = values >= threshold
    return int(torch.count_nonzero(mask)), mask


# Magnitudes whose mean lies outside this range are rescaled (in place, in a buffer the
# caller owns) before second moments are taken, so squares neither underflow nor overflow.
SAFE_MEAN = (1e-12, 1e12)


def rescale_for_moments(mag: torch.Tensor, mean: float) -> tuple[float, float]:
    """Divide `mag` in place by a scale that brings its mean into SAFE_MEAN when it is
    outside (tiny or huge gradients, or a sum that overflowed); return (scale, new mean).
    Scale-equivariant rules computed on the result give thresholds in units of
    mag/scale."""
    if SAFE_MEAN[0] <= mean <= SAFE_MEAN[1]:
        return 1.0, mean
    scale = mean if math.isfinite(mean) else float(mag.max())  # the sum overflowed
    mag.div_(scale)
    return scale, mean_abs(mag)


def mean_and_variance(values: torch.Tensor, mean: float | None = None) -> tuple[float, float]:
    """Population mean and variance of a 1-D float tensor from float64 sums of y and y²;
    when the variance is small against the squared mean (cancellation) it is recomputed
    by a second pass around the mean. The reference of `moments_from_sums`."""
    v = values.to(torch.float64)
    n = v.numel()
    if mean is None:
        mean = float(v.sum()) / n
    second = float((v * v).sum()) / n
    return moments_from_sums(mean, second, lambda m: float(((v - m) ** 2).sum()) / n)


# moments_from_sums: a variance at or below this fraction of mean² from the raw sums has
# lost too many digits to cancellation, and is taken again by a centred pass.
CANCELLATION = 1e-2


def moments_from_sums(mean: float, second: float, centred) -> tuple[float, float]:
    """(mean, variance) from the mean and the mean square; `centred(mean)` gives the
    mean squared deviation by a second pass, used only under cancellation."""
    var = second - mean * mean
    if not var > CANCELLATION * mean * mean:
        var = centred(mean)
    return mean, max(var, 0.0)


def native_mean_and_variance(x: torch.Tensor, shift: float = 0.0, ctx: Context | None = None,
                             ) -> tuple[int, float, float]:
    """(count, mean, variance) of |x| − shift over all of x, by the fused native kernel
    (one pass; a second only under cancellation). x holds magnitudes or signed values.
    With `ctx`, that pass is also the folded NaN/Inf check (check_sum_finite)."""
    st = _native.stats(x, shift=shift, squares=True)
    if ctx is not None:
        check_sum_finite(x, st.sum + st.count * shift, ctx)
    n = st.count
    mean, var = moments_from_sums(
        st.sum / n, st.sumsq / n,
        lambda m: _native.stats(x, shift=shift + m, squares=True).sumsq / n)
    return n, mean, var


def check_positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer ≥ {minimum}")
    return value


def check_finite_range(value: Any, name: str, low: float, high: float, *, low_open: bool,
                       high_open: bool, hint: str = "") -> float:
    """A real number in an interval (open or closed at each end), or a ValueError that
    names the parameter and the interval."""
    bad_type = isinstance(value, bool) or not isinstance(value, (int, float))
    ok = not bad_type and math.isfinite(value)
    if ok:
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        ok = above and below
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}={value!r} is out of range: it must lie in {interval}"
                         + (f"; {hint}" if hint else ""))
    return float(value)


def pool_index_dtype(pool: torch.Tensor) -> torch.dtype:
    """The positions dtype to ask _native.pool for: int32 on the CPU below 2^31 elements
    (the dense compaction then stores one vector of positions per group of 8 instead of
    two; index_select takes int32, and payload indices are int32 there anyway), else int64
    (on CUDA the selection writes int64: a conversion would only add a kernel)."""
    narrow = pool.device.type == "cpu" and pool.numel() < 1 << 31
    return torch.int32 if narrow else torch.int64


class ThresholdSparsifier(Sparsifier):
    """A sparsifier that keeps {i : |acc_i| ≥ t}. Subclasses implement `select` and call
    `self.report(ctx, ...)` with their diagnostics (at least the threshold t in the units
    of |acc|); they appear in Outcome.extra."""

    def report(self, ctx: Context, **extra: Any) -> None:
        ctx.state[_EXTRA] = extra

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        # Every subclass here starts its native path with a statistics or selection pass
        # over all of acc that checks (check_sum_finite, native_pick(check_finite=...)).
        return use_native(acc)

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        outcome = yield from super().protocol(acc, ctx)
        outcome.extra.update(ctx.state.pop(_EXTRA, {}))
        return outcome


@register("hard_threshold")
class HardThreshold(ThresholdSparsifier):
    """Sahu et al. (NeurIPS 2021), hard-threshold sparsifier: send every coordinate with
    |acc_i| ≥ lam, a fixed λ with no per-step estimation. With error feedback the residual
    therefore never exceeds λ in any coordinate (the "total error" view of the paper).
    `ratio` is only the target k the metrics compare k̂ against; it does not influence
    the selection. The default λ is DEFT's value for the WikiText-2 LSTM."""

    def __init__(self, lam: float = 2.938e-3, ratio: float = 0.01):
        super().__init__(ratio)
        self.lam = check_finite_range(
            lam, "lam", 0.0, math.inf, low_open=True, high_open=True,
            hint="λ is the fixed magnitude above which coordinates are sent")

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> torch.Tensor | Selected:
        if use_native(acc):
            # λ, not k, decides how many pass: the last step's count picks the writing
            # layout (kept only once this step's read has passed the NaN/Inf check)
            chosen = native_pick(acc, self.lam, check_finite=ctx.check_finite,
                                 expected=ctx.state.get("count", 0))
            ctx.state["count"] = chosen.indices.numel()
        else:
            chosen = nonzero_indices(magnitudes(acc) >= self.lam)
        self.report(ctx, threshold=self.lam)
        return chosen


@register("gaussianksgd")
class GaussianKSGD(ThresholdSparsifier):
    """GaussianK-SGD (Shi et al. 2019) as the SIDCo paper benchmarks it: fit a normal to
    a = |acc| (mean μ, standard deviation σ), start from t = μ + |Φ⁻¹(δ/2)|·σ, then correct
    up to `corrections` times: t ×0.5 when fewer than 2k/3 are selected, t ×1.5 when more
    than 4k/3, stopping as soon as k̂ is inside [2k/3, 4k/3]. The selection is the last
    threshold counted.

    The statistics are taken on the magnitudes (the SIDCo authors' uncompensated variant
    computed them on the signed, unnormalised gradient: a bug not reproduced here; the
    fit is scale-equivariant, so normalising by ||acc||₂ would not change the selection).
    corrections=2 matches the authors' loop, which counts up to three times and discards
    the rescale that follows the third count."""

    def __init__(self, ratio: float = 0.01, corrections: int = 2):
        super().__init__(ratio)
        self.corrections = check_positive_int(corrections, "corrections", minimum=0)

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> torch.Tensor | Selected:
        if use_native(acc):
            n, mean_f, var_f = native_mean_and_variance(acc, ctx=ctx)
            if SAFE_MEAN[0] <= mean_f <= SAFE_MEAN[1]:
                return self._search(k, ctx, mean_f, var_f, 1.0,
                                    lambda t: (_native.count(acc, t), None),
                                    lambda t, _: native_pick(acc, t, expected=k))
            if mean_f == 0.0:
                self.report(ctx, threshold=0.0, corrections=0)
                return empty_indices(acc.device)
        mag = magnitudes(acc)
        mean_f = mean_abs(mag)
        if mean_f == 0.0:  # all zero: nothing worth sending
            self.report(ctx, threshold=0.0, corrections=0)
            return empty_indices(acc.device)
        scale, mean_f = rescale_for_moments(mag, mean_f)
        mean_f, var_f = mean_and_variance(mag, mean_f)
        return self._search(k, ctx, mean_f, var_f, scale, lambda t: count_at_least(mag, t),
                            lambda t, mask: nonzero_indices(mask))

    def _search(self, k, ctx, mean_f, var_f, scale, count_fn, select_fn
                ) -> torch.Tensor | Selected:
        """The threshold rule and its corrections, on either path's counting pass."""
        z = -NormalDist().inv_cdf(self.ratio / 2) if self.ratio < 1 else 0.0
        t = mean_f + z * math.sqrt(var_f)
        used = 0
        while True:
            count, mask = count_fn(t)
            if used == self.corrections or 2 * k <= 3 * count <= 4 * k:
                break
            t *= 0.5 if 3 * count < 2 * k else 1.5
            used += 1
        self.report(ctx, threshold=t * scale, corrections=used)
        return select_fn(t, mask)


@register("redsync")
class RedSync(ThresholdSparsifier):
    """RedSync (Fang et al. 2019) threshold search as the SIDCo paper benchmarks it:
    t = mean + r·(max − mean) on |acc|, bisection on r ∈ [0, 1] (fewer than k selected →
    lower r, more than accept_factor·k → raise r) until k ≤ k̂ ≤ accept_factor·k or the
    interval of r is narrower than `min_interval`. Each probe is one counting reduction;
    the selection is the last threshold counted (extra["converged"] says whether it
    landed in the band). With the defaults at most three probes run."""

    def __init__(self, ratio: float = 0.01, accept_factor: float = 2.0, min_interval: float = 0.2):
        super().__init__(ratio)
        self.accept_factor = check_finite_range(
            accept_factor, "accept_factor", 1.0, math.inf, low_open=False, high_open=True,
            hint="the search accepts k ≤ k̂ ≤ accept_factor·k")
        self.min_interval = check_finite_range(
            min_interval, "min_interval", 0.0, 1.0, low_open=True, high_open=True,
            hint="the bisection on r ∈ [0, 1] stops below this width")

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> torch.Tensor | Selected:
        if use_native(acc):
            st = _native.stats(acc, extremes=True)
            check_sum_finite(acc, st.sum, ctx)
            mean_f = st.sum / st.count
            if st.max == 0.0:
                self.report(ctx, threshold=0.0, converged=False, probes=0)
                return empty_indices(acc.device)
            if SAFE_MEAN[0] <= mean_f <= SAFE_MEAN[1]:
                return self._search(k, ctx, mean_f, st.max, 1.0,
                                    lambda t: (_native.count(acc, t), None),
                                    lambda t, _: native_pick(acc, t, expected=k))
        mag = magnitudes(acc)
        max_f = float(mag.max())
        if max_f == 0.0:
            self.report(ctx, threshold=0.0, converged=False, probes=0)
            return empty_indices(acc.device)
        scale, mean_f = rescale_for_moments(mag, mean_abs(mag))
        max_f = float(mag.max()) if scale != 1.0 else max_f
        return self._search(k, ctx, mean_f, max_f, scale, lambda t: count_at_least(mag, t),
                            lambda t, mask: nonzero_indices(mask))

    def _search(self, k, ctx, mean_f, max_f, scale, count_fn, select_fn
                ) -> torch.Tensor | Selected:
        """The bisection on r, on either path's counting pass."""
        lo, hi = 0.0, 1.0
        probes = 0
        converged = False
        while True:
            r = 0.5 * (lo + hi)
            t = mean_f + r * (max_f - mean_f)
            count, mask = count_fn(t)
            probes += 1
            if k <= count <= self.accept_factor * k:
                converged = True
                break
            if count < k:
                hi = r
            else:
                lo = r
            if hi - lo < self.min_interval:
                break
        self.report(ctx, threshold=t * scale, converged=converged, probes=probes)
        return select_fn(t, mask)


@register("mstopk")
class MSTopK(ThresholdSparsifier):
    """MSTopK (Shi et al., MLSys 2021): approximate Top-k by a fixed number of bisection
    steps on a threshold, counting the elements ≥ each candidate, keeping the candidate
    whose count is the largest not above k; then one selection pass. Never sends more
    than k.

    The search brackets [mean(|acc|), max(|acc|)] as in the paper. One counting probe at
    the mean comes first: if even the mean keeps at most k (large ratios, above
    P(|g| ≥ mean) ≈ 0.3–0.4 for gradient-like data) the search moves to [0, mean], which
    the paper's bracket cannot reach. Probes whose count exceeds k raise the lower bound;
    elements below it can no longer change a count, so the probe set is compacted to the
    elements above it when that halves it (later probes then cost a fraction of a pass). If more than k
    elements tie at the maximum no threshold keeps at most k: the first k of the tied
    elements are sent (a valid Top-k)."""

    def __init__(self, ratio: float = 0.01, steps: int = 25):
        super().__init__(ratio)
        self.steps = check_positive_int(steps, "steps")

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        return use_native(acc) and acc.dtype == torch.float32  # the native path's condition

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> torch.Tensor | Selected:
        if use_native(acc) and acc.dtype == torch.float32:
            # The same search on fused passes: counts by gc_count, the probe set compacted
            # by gc_pool to {|x| ≥ the new lower bound} (as the torch path: a later probe
            # may round to the same float32 as the bound), the selection by gc_select.
            st = _native.stats(acc, extremes=True)
            check_sum_finite(acc, st.sum, ctx)
            mean_f = st.sum / st.count
            if st.max == 0.0:
                self.report(ctx, threshold=0.0, count=0)
                return empty_indices(acc.device)
            if SAFE_MEAN[0] <= mean_f <= SAFE_MEAN[1]:
                return self._search(
                    k, ctx, acc, mean_f, st.max, 1.0,
                    count_fn=lambda pool, t: (_native.count(pool, t), None),
                    shrink_fn=lambda pool, t, _mask, keep: _native.pool(
                        pool, t, dense=keep > _native.DENSE_FRACTION, strict=False,
                        index_dtype=pool_index_dtype(pool), room="mstopk")[2],
                    select_fn=lambda t: native_pick(acc, t, expected=k))
        mag = magnitudes(acc)
        max_f = float(mag.max())
        if max_f == 0.0:
            self.report(ctx, threshold=0.0, count=0)
            return empty_indices(acc.device)
        scale, mean_f = rescale_for_moments(mag, mean_abs(mag))
        max_f = float(mag.max()) if scale != 1.0 else max_f
        return self._search(k, ctx, mag, mean_f, max_f, scale, count_fn=count_at_least,
                            shrink_fn=lambda pool, _t, mask, _keep: pool[mask],
                            select_fn=lambda t: nonzero_indices(mag >= t))

    def _search(self, k, ctx, values, mean_f, max_f, scale, count_fn, shrink_fn,
                select_fn) -> torch.Tensor | Selected:
        """The bisection on either path: count_fn(pool, t) → (#{|pool| ≥ t}, mask or
        None); shrink_fn(pool, t, mask, kept fraction) → the probe set above t;
        select_fn(t) → positions of |acc| ≥ t."""
        numel = values.numel()
        count, mask = count_fn(values, mean_f)
        if count > k:
            lo, hi = mean_f, max_f
            best_t, best_count = None, -1
            pool = shrink_fn(values, mean_f, mask, count / numel) if 2 * count <= numel else values
        else:
            lo, hi = 0.0, mean_f
            best_t, best_count = mean_f, count
            pool = values
        for _ in range(self.steps):
            if best_count == k:
                break
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:  # bracket exhausted at float resolution
                break
            count, probe = count_fn(pool, mid)
            if count > k:
                lo = mid
                if 2 * count <= pool.numel():
                    pool = shrink_fn(pool, mid, probe, count / pool.numel())
            else:
                # The bracket only shrinks, so each accepted candidate is below the last
                # one accepted and keeps at least as many: the latest is the best.
                hi = mid
                best_t, best_count = mid, count
        if best_t is None:
            ties, count = _first(select_fn(max_f), k)
            self.report(ctx, threshold=max_f * scale, count=count)
            return ties
        self.report(ctx, threshold=best_t * scale, count=best_count)
        return select_fn(best_t)


def _first(chosen: torch.Tensor | Selected, k: int) -> tuple[torch.Tensor | Selected, int]:
    """The first k of a selection (indices, or Selected), and how many that is."""
    if isinstance(chosen, Selected):
        return Selected(chosen.indices[:k], chosen.values[:k]), min(k, chosen.indices.numel())
    return chosen[:k], min(k, chosen.numel())
