"""Threshold sparsifiers: select {i : |acc_i| ≥ t} for a threshold t that is either fixed
(hard_threshold) or estimated each step from cheap statistics of |acc| (gaussianksgd,
redsync, mstopk; SIDCo's fits live in compressors/sidco.py and share the base here).

All of them cost a few linear passes: candidate thresholds are scored by counting
reductions, nothing is sorted, and indices are materialised once at the end. Statistics
are accumulated in float64. Each estimator is written once over the passes of
compressors/kernels/magnitudes.py: fused kernels on acc itself where they take it (one
read per statistic or count, no |acc| buffer, no mask, the values sent written by the
selection pass), else torch over |acc| computed once. For the same threshold both select
the same indices; thresholds come from the same float64 statistics, summed in a
different order (agreement to ~1e-16 relative). Unlike Top-k, the number selected, k̂,
varies around the target k; how far is what the SIDCo paper's Figure 1(c) measures and
what Outcome.selected / Outcome.target record.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import torch

from compressors.base import Context, Selected, Sparsifier
from compressors.kernels.magnitudes import fused, passes, safe
from compressors.registry import register


def nothing_selected(acc: torch.Tensor, **extra: Any) -> Selected:
    """No index of acc (an all-zero tensor: nothing worth sending), with the diagnostics."""
    return Selected(torch.empty(0, dtype=torch.int64, device=acc.device), acc.new_empty(0),
                    extra)


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


class ThresholdSparsifier(Sparsifier):
    """A sparsifier that keeps {i : |acc_i| ≥ t}. Subclasses implement `select`, whose
    Selected carries their diagnostics (at least the threshold t in the units of |acc|)."""

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        # Every subclass here starts its fused passes with a statistics or selection pass
        # over all of acc that checks (magnitudes.check_sum_finite, pick(check_finite=)).
        return fused(acc)


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

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        # λ, not k, decides how many pass: the last step's count picks the fused pass's
        # writing layout (kept only once this step's read has passed the NaN/Inf check)
        chosen = passes(acc, ctx.check_finite).select(self.lam,
                                                      expected=ctx.state.get("count", 0))
        ctx.state["count"] = chosen.indices.numel()
        return chosen._replace(extra={"threshold": self.lam})


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

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        magnitudes = passes(acc, ctx.check_finite)
        mean, var = magnitudes.moments()
        if mean == 0.0:  # all zero: nothing worth sending
            return nothing_selected(acc, threshold=0.0, corrections=0)
        if not safe(mean):
            magnitudes = magnitudes.rescaled()
            mean, var = magnitudes.moments()
        z = -NormalDist().inv_cdf(self.ratio / 2) if self.ratio < 1 else 0.0
        t = mean + z * math.sqrt(var)
        used = 0
        while True:
            count, mask = magnitudes.count(t)
            if used == self.corrections or 2 * k <= 3 * count <= 4 * k:
                break
            t *= 0.5 if 3 * count < 2 * k else 1.5
            used += 1
        return magnitudes.select(t, mask, expected=k)._replace(
            extra={"threshold": t * magnitudes.scale, "corrections": used})


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

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        magnitudes = passes(acc, ctx.check_finite)
        mean_f, max_f = magnitudes.mean_and_max()
        if max_f == 0.0:
            return nothing_selected(acc, threshold=0.0, converged=False, probes=0)
        if not safe(mean_f):
            magnitudes = magnitudes.rescaled()
            mean_f, max_f = magnitudes.mean_and_max()
        lo, hi = 0.0, 1.0
        probes = 0
        converged = False
        while True:
            r = 0.5 * (lo + hi)
            t = mean_f + r * (max_f - mean_f)
            count, mask = magnitudes.count(t)
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
        return magnitudes.select(t, mask, expected=k)._replace(
            extra={"threshold": t * magnitudes.scale, "converged": converged, "probes": probes})


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
        return fused(acc, pools=True)  # (the fused compaction takes float32 only)

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        # The probe set is compacted to {|x| ≥ the new lower bound} (a later probe may
        # round to the same float32 as the bound)
        magnitudes = passes(acc, ctx.check_finite, pools=True)
        mean_f, max_f = magnitudes.mean_and_max()
        if max_f == 0.0:
            return nothing_selected(acc, threshold=0.0, count=0)
        if not safe(mean_f):
            magnitudes = magnitudes.rescaled()
            mean_f, max_f = magnitudes.mean_and_max()
        values = magnitudes.source
        numel = values.numel()
        count, mask = magnitudes.count(mean_f)
        if count > k:
            lo, hi = mean_f, max_f
            best_t, best_count = None, -1
            pool = (magnitudes.shrink(values, mean_f, mask, count / numel)
                    if 2 * count <= numel else values)
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
            count, probe = magnitudes.count(mid, pool)
            if count > k:
                lo = mid
                if 2 * count <= pool.numel():
                    pool = magnitudes.shrink(pool, mid, probe, count / pool.numel())
            else:
                # The bracket only shrinks, so each accepted candidate is below the last
                # one accepted and keeps at least as many: the latest is the best.
                hi = mid
                best_t, best_count = mid, count
        if best_t is None:  # the first k of the ties at the maximum
            ties = magnitudes.select(max_f, expected=k)
            return Selected(ties.indices[:k], ties.values[:k],
                            {"threshold": max_f * magnitudes.scale,
                             "count": min(k, ties.indices.numel())})
        return magnitudes.select(best_t, expected=k)._replace(
            extra={"threshold": best_t * magnitudes.scale, "count": best_count})
