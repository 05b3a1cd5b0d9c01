"""SIDCo (Abdelmoniem et al., MLSys 2021): threshold sparsification from a fitted
sparsity-inducing distribution, multi-stage peak-over-threshold fitting, and adaptive
stage count (sidco.txt, Algorithm 1, Section 2.4, Appendix B.3).

Per step, on a = |acc| / ||acc||₂ with d elements, n₀ of them nonzero, and k = δ·d wanted
(a real number, not the rounded target), M stages:
  stage 1   fit the chosen distribution to the n₀ nonzero magnitudes only and take its
            (1 − δ₁') quantile η₁. Among the nonzeros the fraction wanted is ρ = k/n₀:
            ρ ≥ 1 keeps every nonzero (η₁ = the smallest |x| > 0, no later stage);
            M = 1 or ρ ≥ δ₁ is one stage at δ₁' = ρ; else δ₁' = δ₁ = first_stage_ratio;
  stage m   the pool is what exceeds η_{m−1}, p elements. If p ≤ k (none, or no more than
            wanted) the stages stop and η_{m−1} stays; else fit the exceedances (shifted
            by η_{m−1}) at δ_m = (k/p)^(1/(M − m + 1)), the k still wanted over the pool's
            real size spread over the stages left: η_m = η_{m−1} + F⁻¹(1 − δ_m);
  select    {i : a_i ≥ η_last} on the full tensor, in one pass.
Why: gradients with many exact zeros (embedding rows no batch touched, sparse features:
90–99% zeros) break the paper's fixed schedule δ_m = (δ/δ₁)^(1/(M−1)). The zeros drag the
first fit's scale down, so stage 1 keeps far fewer than δ₁ of the nonzeros, and the fixed
later ratios still multiply to δ/δ₁ whatever stage 1 kept: k̂/k falls to 0.04–0.6 at any M,
where stage adaptation cannot help. Left out of the fit, the zeros move no threshold, and
ratios set from each pool's real size let every later stage make up for what the stages
before it kept too many or too few. On a tensor without zeros whose fits are right
(p ≈ δ₁·d) the ratios are the paper's: ρ = δ and δ_m ≈ (δ/δ₁)^(1/(M−1)). Only the survivors of a stage feed the
next: after the first they are a fraction δ₁ of the nonzeros, then fewer.

Every Q = adapt_interval steps the mean k̂/k of those steps moves M (per tensor, per
worker, kept in ctx.state): above 1 + ε_H → M − 1, below 1 − ε_L → M + 1, clamped to
[1, max_stages] (Algorithm 1, Adapt_Stages).

Fits (all scale-equivariant, so thresholds on a and on |acc| differ only by the norm;
each quantile is written with L = ln(1/δ_m)):
  exponential   η = t + mean(y)·L                                 y = exceedances − t
  gen. Pareto   α = ½(1 − μ²/σ²), β = ½μ(μ²/σ² + 1) (moment matching on y; σ² is the
                variance, as Appendix B.3 derives — Algorithm 1 misprints σ),
                η = t + (β/α)(e^(αL) − 1), the exponential limit as α → 0
  gamma         s = ln mean(a) − mean(ln a), α = (3 − s + √((s − 3)² + 24s)) / (12s),
                β = mean(a)/α, η = β·P⁻¹(α, 1 − δ) with the exact inverse regularised
                incomplete gamma (scipy, on two scalars; Eq. 14, not the α ≤ 1 bound 15)
Variants: sidco_e (exponential, then exponential), sidco_gp (GP, then GP), sidco_p
(gamma first stage, then GP).
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch

from compressors import _native
from compressors.base import Context, Selected
from compressors.registry import register
from compressors.threshold import (
    SAFE_MEAN,
    ThresholdSparsifier,
    check_finite_range,
    check_positive_int,
    check_sum_finite,
    empty_indices,
    magnitudes,
    mean_abs,
    mean_and_variance,
    moments_from_sums,
    native_pick,
    nonzero_indices,
    pool_index_dtype,
    rescale_for_moments,
    use_native,
)

# Speculation (the native path): the first read also takes what the second stage needs
# for a first threshold within ±5% of the one guessed from the last two steps', and the
# pool above 95% of the guessed second threshold (the drift and the share of steps where
# that holds, in training: scripts/sidco_speculation.py).
SPECULATION_MARGIN = 0.05

# A later stage compacts its pool to the exceedances of the last threshold when they are
# expected to be at most this fraction of it; above, it reads them in place (a pass that
# skips the others). Compacting writes what passes: at 26M with δ = 0.001, the pool of the
# speculative read (1.9M) took 0.75 ms to compact to its 22% above the third threshold
# against 0.25 for a statistics pass over it, and 0.33 to compact to the 5.5% above the
# fourth: one pass in place and one compaction instead of two compactions saved ~0.4 ms.
COMPACT_BELOW = 0.1

# The device-side stages (CUDA) write each pool into a buffer of DEVICE_ROOM times the
# elements expected to pass; a step whose pool outgrows it is redone by the host-driven
# stages, and the tensor's later steps get twice the room, up to DEVICE_ROOM_MAX.
DEVICE_ROOM = 4.0
DEVICE_ROOM_MAX = 64.0

# Below this coefficient of variation (σ²/μ² < 1e-10) data are numerically constant for
# float32 statistics: the GP fit's limit is a point mass, whose every quantile is the point.
_POINT_MASS_CV2 = 1e-10
# Gamma fit: s = ln mean − mean ln is ≥ 0 (Jensen) and 0 only for constant data; below this
# it is float32 rounding noise of the log-mean, and the fit's limit is again a point mass.
_POINT_MASS_S = 1e-6



def default_max_stages(ratio: float) -> int:
    """⌈log₂(1/δ)⌉ (at least 1), the clamp of the authors' code: with more stages the later
    per-stage ratios exceed ~½, each stage's fit moves the threshold little while its
    estimation noise still adds up. δ = 0.001 → 10, 0.01 → 7, 0.1 → 4."""
    return max(1, math.ceil(math.log2(1.0 / ratio) - 1e-9))


def default_initial_stages(ratio: float, first_stage_ratio: float) -> int:
    """1 + ⌈ln(δ/δ₁)/ln δ₁⌉ stages (1 when δ ≥ δ₁): each stage then keeps about a fraction
    δ₁ of its input, as the authors' automatic mode (stages=0) does. δ₁ = 0.25:
    δ = 0.001 → 5, 0.01 → 4, 0.1 → 2."""
    if ratio >= first_stage_ratio:
        return 1
    return 1 + math.ceil(math.log(ratio / first_stage_ratio) / math.log(first_stage_ratio) - 1e-9)


def stage_ratios(ratio: float, first_stage_ratio: float, stages: int) -> list[float]:
    """The nominal δ_1..δ_M, ∏ δ_m = δ: what the stages keep of their inputs on a tensor
    without zeros whose fits are right ([δ] for one stage, else [δ₁, r, ..., r] with
    r = (δ/δ₁)^(1/(M−1))). The stages fit at ratios set per step from the counts
    (_SIDCo._first_stage, later_stage_log); these size the device path's buffers, which a
    tensor with zeros fills less."""
    if stages <= 1 or ratio >= first_stage_ratio:
        return [ratio]
    later = (ratio / first_stage_ratio) ** (1.0 / (stages - 1))
    return [first_stage_ratio] + [later] * (stages - 1)


def later_stage_log(pool: int, wanted: float, left: int) -> float | None:
    """L = ln(1/δ_m) of a later stage whose pool holds `pool` elements, with `left` stages
    to go (this one included) and `wanted` = δ·d: δ_m = (wanted/pool)^(1/left), written
    as L = ln(pool/wanted)/left (the device kernels compute the same expression). None
    when the pool holds no more than is wanted: the stages stop there."""
    if pool <= wanted:
        return None
    return math.log(pool / wanted) / left


def exponential_quantile(mean_excess: float, tail_log: float) -> float:
    """(1 − δ) quantile of an exponential with mean `mean_excess`, L = ln(1/δ) given
    (Corollaries 1.1, 2.1)."""
    return mean_excess * tail_log


def gpareto_parameters(mean: float, var: float) -> tuple[float, float]:
    """Moment-matched GP shape α and scale β (Eq. 8–9 / 35) from the mean and variance of
    the exceedances; requires var > 0."""
    r = mean * mean / var
    return 0.5 * (1.0 - r), 0.5 * mean * (r + 1.0)


def gpareto_quantile(alpha: float, beta: float, tail_log: float) -> float:
    """(1 − δ) quantile of GP(α, β) at location 0, L = ln(1/δ) given: (β/α)(δ^(−α) − 1)
    (Eq. 7 / 28), written with expm1 so it tends smoothly to the exponential β·L as
    α → 0."""
    if abs(alpha) < 1e-12:
        return beta * tail_log
    return beta * math.expm1(alpha * tail_log) / alpha


def gamma_parameters(mean: float, mean_log: float) -> tuple[float, float]:
    """Shape α (Minka's closed-form approximation of the MLE, Eq. 16) and scale β = mean/α
    from the mean and the mean log of positive data; requires s = ln mean − mean_log > 0."""
    s = math.log(mean) - mean_log
    alpha = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    return alpha, mean / alpha


def gamma_quantile(alpha: float, beta: float, ratio: float) -> float:
    """(1 − δ) quantile of Gamma(α, scale β): β·P⁻¹(α, 1 − δ) (Eq. 14), computed as the
    inverse of the upper regularised incomplete gamma at δ (the same number, without the
    rounding of 1 − δ for small δ)."""
    from scipy.special import gammainccinv  # lazy: `import compressors` stays light

    return beta * float(gammainccinv(alpha, ratio))


class _FirstStage(NamedTuple):
    """Stage 1's schedule for one step (_SIDCo._first_stage): its ratio among the nonzeros,
    L = ln(1/ratio), and whether it is the only stage."""

    ratio: float
    tail_log: float
    single: bool


class _SIDCo(ThresholdSparsifier):
    """Multi-stage SIDCo; subclasses choose the first-stage and later-stage fits."""

    first_fit: ClassVar[str]
    later_fit: ClassVar[str]

    def __init__(
        self,
        ratio: float = 0.01,
        first_stage_ratio: float = 0.25,
        adaptive: bool = True,
        adapt_interval: int = 5,
        eps_high: float = 0.2,
        eps_low: float = 0.2,
        max_stages: int | None = None,
        initial_stages: int | None = None,
    ):
        super().__init__(ratio)
        self.first_stage_ratio = check_finite_range(
            first_stage_ratio, "first_stage_ratio", 0.0, 1.0, low_open=True, high_open=True,
            hint="δ₁ is the fraction the first stage keeps (paper: 0.25)")
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive={adaptive!r} must be True or False")
        self.adaptive = adaptive
        self.adapt_interval = check_positive_int(adapt_interval, "adapt_interval")
        tolerance = "the tolerance ε of Eq. 12 satisfies 0 ≤ ε < 1"
        self.eps_high = check_finite_range(eps_high, "eps_high", 0.0, 1.0, low_open=False,
                                           high_open=True, hint=tolerance)
        self.eps_low = check_finite_range(eps_low, "eps_low", 0.0, 1.0, low_open=False,
                                          high_open=True, hint=tolerance)
        if max_stages is None:
            max_stages = default_max_stages(self.ratio)
        self.max_stages = check_positive_int(max_stages, "max_stages")
        if initial_stages is None:
            initial_stages = min(default_initial_stages(self.ratio, self.first_stage_ratio),
                                 self.max_stages)
        self.initial_stages = check_positive_int(initial_stages, "initial_stages")
        if self.initial_stages > self.max_stages:
            raise ValueError(
                f"initial_stages={initial_stages} exceeds max_stages={self.max_stages}; "
                "raise max_stages or start with fewer stages")

    # -- the schedule ------------------------------------------------------------------

    def _first_stage(self, numel: int, nonzeros: int, stages: int) -> _FirstStage | None:
        """Stage 1 of a step with `stages` stages on `numel` elements, `nonzeros` (≥ 1) of
        them nonzero: the fraction of the nonzeros wanted is ρ = δ·(d/n₀) (exactly δ
        without zeros); None when ρ ≥ 1 (every nonzero is kept)."""
        rho = self.ratio * (numel / nonzeros)
        if rho >= 1.0:
            return None
        if stages == 1 or rho >= self.first_stage_ratio:
            return _FirstStage(rho, -math.log(rho), True)
        first = self.first_stage_ratio
        return _FirstStage(first, -math.log(first), False)

    def _schedule(self, stages: int) -> tuple[int, float]:
        """What identifies a step's schedule (the speculation's history is kept per one)."""
        return stages, self.first_stage_ratio

    def _reported_stages(self, stages: int) -> int:
        """Outcome.extra["stages"]: the stage count M in use (adaptation's), 1 where
        δ ≥ δ₁ (then every step has one stage). A step may end its stages earlier (ρ ≥ δ₁,
        or a pool holding no more than k)."""
        return 1 if self.ratio >= self.first_stage_ratio else stages

    # -- one stage's threshold --------------------------------------------------------

    def _first_threshold(self, mag: torch.Tensor, nonzeros: int,
                         plan: _FirstStage | None) -> float:
        """Stage 1: fit the nonzero magnitudes (location 0), `nonzeros` of them, at the
        plan's ratio; their smallest where every nonzero is kept (plan None)."""
        positive = mag if nonzeros == mag.numel() else mag[mag > 0]
        if plan is None:
            return float(positive.min())
        mean = float(positive.sum(dtype=torch.float64)) / nonzeros
        if self.first_fit == "exponential":
            return exponential_quantile(mean, plan.tail_log)
        if self.first_fit == "gpareto":
            mean, var = mean_and_variance(positive, mean)
            return self._gpareto_threshold(lambda: float(positive.min()), 0.0, mean, var,
                                           plan.tail_log)
        mean_log = float(torch.log(positive.to(torch.float64)).sum()) / nonzeros
        return self._gamma_threshold(mean, mean_log, plan.ratio,
                                     lambda: float(positive.min()))

    def _later_threshold(self, pool: torch.Tensor, t: float, tail_log: float) -> float:
        """Stage m ≥ 2: fit the exceedances y = pool − t of the previous threshold t."""
        # Shifted first (in float64): the exceedances' variance is then not a small
        # difference of large second moments.
        excess = pool.to(torch.float64) - t
        if self.later_fit == "exponential":
            return t + exponential_quantile(float(excess.sum()) / pool.numel(), tail_log)
        mean, var = mean_and_variance(excess)
        return self._gpareto_threshold(lambda: float(pool.min()), t, mean, var, tail_log)

    @staticmethod
    def _gpareto_threshold(pool_min, t: float, mean: float, var: float,
                           tail_log: float) -> float:
        """`pool_min()`: the smallest fitted magnitude (asked for only at a point mass)."""
        if not var > _POINT_MASS_CV2 * mean * mean:
            # Point mass (all exceedances equal): the GP limit puts every quantile at the
            # point; take the smallest element so ties are kept despite rounding.
            return pool_min()
        alpha, beta = gpareto_parameters(mean, var)
        return t + gpareto_quantile(alpha, beta, tail_log)

    @staticmethod
    def _gamma_threshold(mean: float, mean_log: float, ratio: float, min_positive) -> float:
        """Gamma first stage from the mean and the mean log of the nonzero magnitudes (the
        gamma model lives on (0, ∞)); `min_positive()` is asked for only at a point mass."""
        s = math.log(mean) - mean_log
        if not s > _POINT_MASS_S:
            # The nonzeros are (numerically) one value: the fit's limit is a point mass at
            # it; keep all of them.
            return min_positive()
        alpha, beta = gamma_parameters(mean, mean_log)
        return gamma_quantile(alpha, beta, ratio)

    # -- the step ---------------------------------------------------------------------

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> torch.Tensor | Selected:
        state = ctx.state
        stages = state.get("stages", self.initial_stages)
        found = self._select_native(acc, stages, ctx, k) if use_native(acc) else None
        if found is None:
            found = (*self._select_reference(acc, stages), None)
        # kept only once the first read of acc has passed (ctx.check_finite: nothing is
        # written before a NaN/Inf is found)
        state["stages"] = stages
        indices, threshold, state["speculated"] = found  # (the native path's diagnostic)
        reported = self._reported_stages(stages)
        if indices is None:  # all zero: nothing to send, and no information for adaptation
            self.report(ctx, stages=reported, threshold=0.0)
            return empty_indices(acc.device)
        self.report(ctx, stages=reported, threshold=threshold)
        if self.adaptive and self.ratio < self.first_stage_ratio:
            chosen = indices.indices if isinstance(indices, Selected) else indices
            self._adapt(state, chosen.numel() / k)
        return indices

    def _select_reference(self, acc: torch.Tensor, stages: int):
        """Pure torch: (indices, threshold in |acc| units), or (None, 0) if all zero."""
        mag = magnitudes(acc)
        mean = mean_abs(mag)
        if mean == 0.0:
            return None, 0.0
        # a = |acc|/||acc||₂ in the paper; every fit is scale-equivariant, so the fits run
        # on |acc| (rescaled only where second moments would under/overflow) and the
        # threshold is converted back to |acc| units for the report.
        scale, mean = rescale_for_moments(mag, mean)
        numel = mag.numel()
        nonzeros = int(torch.count_nonzero(mag))
        plan = self._first_stage(numel, nonzeros, stages)
        threshold = self._first_threshold(mag, nonzeros, plan)
        if plan is not None and not plan.single:
            wanted = self.ratio * numel
            pool = mag
            for stage in range(1, stages):
                pool = pool[pool > threshold]
                tail_log = later_stage_log(pool.numel(), wanted, stages - stage)
                if tail_log is None:  # no more than wanted exceeds: the stages stop
                    break
                threshold = self._later_threshold(pool, threshold, tail_log)
        return nonzero_indices(mag >= threshold), threshold * scale

    def _select_native(self, acc: torch.Tensor, stages: int, ctx: Context, k: int):
        """The native path: on CUDA the stages with their thresholds kept on the device
        (_select_device) where that path passed its check on this device, else driven from
        the host (_select_host)."""
        if acc.device.type == "cuda" and _device_stages_usable(acc.device, self):
            return self._select_device(acc, stages, ctx, k)
        return self._select_host(acc, stages, ctx, k)

    def _select_device(self, acc: torch.Tensor, stages: int, ctx: Context, k: int,
                       speculate: bool = True):
        """_select_host's stages with no host synchronisation between them
        (compressors/_native/gpu_sidco.py): the same fits, schedule, compactions
        (COMPACT_BELOW) and final selection, the thresholds fitted on the device, one
        copy to the host at the end. Stage 1's schedule (ρ from the nonzeros counted by
        the first read) and each later stage's ratio (from its pool's count) are decided
        on the device; a stage that stops leaves the threshold and the stop on the board
        for the stages after it. SIDCo-P's gamma stage is fitted on the host (scipy), its
        later ones on the device. What the device path flags (a GP fit under
        cancellation or at a point mass, every nonzero kept, a pool past its buffer, a
        final threshold not above its pool's) is redone by _select_host: the same
        selection either way.

        When the previous steps' thresholds are known (as for _select_host's speculative
        read), the first read of acc also keeps the elements near the guessed first
        threshold and those above the guessed second one, in acc's order
        (Stages.speculate): stage 2 is fitted from them and the later stages read that
        pool, so acc is read once. Where the guess did not hold (flagged on the device),
        the step is redone without it. Returns what _select_host does."""
        from compressors._native import gpu_sidco as dev  # noqa: PLC0415 (imports triton)

        # pools sized from the shares expected to pass (the nominal schedule's: a tensor
        # with zeros passes fewer), times `room`: doubled for later steps (up to
        # DEVICE_ROOM_MAX) each time one outgrew its buffer
        room = ctx.state.get("device_room", DEVICE_ROOM)
        nominal = stage_ratios(self.ratio, self.first_stage_ratio, stages)
        wanted = self.ratio * acc.numel()
        bounds = None
        if speculate and acc.numel() < dev.SPEC_LIMIT:
            bounds = self._speculation_bounds(stages, ctx)
        last = stages - 1
        board = dev.Stages(acc, stages + (bounds is not None), room)
        gp = self.later_fit != "exponential"
        spec = None
        if bounds is not None:
            spec = board.speculate(*bounds, pa_slot=last + 1,
                                   squares=self.first_fit == "gpareto", mid_squares=gp,
                                   logs=self.first_fit == "gamma",
                                   **_speculation_shares(nominal))
        # one stage known on the host: δ ≥ δ₁ (so ρ ≥ δ₁), or from the gamma stage's fit
        one_stage = self.ratio >= self.first_stage_ratio
        if self.first_fit == "gamma":
            if spec is None:
                st = _native.stats(acc, logs=True)
            else:
                st = _native.Stats(*dev.gpu.reduce_stats(spec.part))
            check_sum_finite(acc, st.sum, ctx)
            mean = st.sum / st.count
            if mean == 0.0:
                return None, 0.0, None
            if not SAFE_MEAN[0] <= mean <= SAFE_MEAN[1]:
                return None
            plan = self._first_stage(st.count, st.nonzero, stages)
            board.set(0, self._first_threshold_native(acc, st, plan))
            one_stage = one_stage or plan is None or plan.single
        else:
            board.first(gp=self.first_fit == "gpareto", ratio=self.ratio,
                        first_ratio=self.first_stage_ratio, stages=stages, spec=spec)
        if one_stage or stages == 1:
            out = board.final(board.source(), 0, None, 0, cap=math.ceil(room * k) + 4096)
            last = 0
            base = None
        else:
            if spec is None:
                src, base, base_slot, after = board.source(), None, 0, 1
                share = nominal[0] * nominal[1]
            else:  # stage 2 from the read; the later ones from its pool (|x| > pool_above)
                board.second_from(spec, gp=gp, wanted=wanted, left=stages - 1)
                src, base, base_slot, after, share = spec.pool, spec.pool, last + 1, 2, 1.0
            for slot in range(after, stages):
                above = True
                if slot >= 2 and (base is None or share <= COMPACT_BELOW):
                    src = board.compact(src, slot - 1, share)
                    base, base_slot, above, share = src, slot - 1, False, 1.0
                board.later(src, slot - 1, slot, above=above, gp=gp, wanted=wanted,
                            left=stages - slot)
                if slot >= 2:
                    share *= nominal[slot]
            if base is None:  # two stages: from acc, about k of it
                out = board.final(src, last, None, 0, cap=math.ceil(room * k) + 4096)
            else:
                out = board.final(src, last, base, base_slot)
        flags, total, thresholds = board.read()
        if flags & dev.FLAG_NONFINITE and ctx.check_finite:
            raise _native.NonFinite("the tensor holds NaN or Inf")
        if flags & dev.FLAG_ZERO:
            return None, 0.0, None
        if flags & dev.FLAG_UNSAFE:
            return None
        if flags & dev.FLAG_MISS:
            # The guess did not hold (or stage 1 chose a single stage, or stage 2 stopped:
            # the pool read then holds too little): the step again without it (what
            # overflowed here may be the later pools at thresholds fitted from an
            # incomplete window: the redo sizes its own buffers), and no speculation on
            # the next step either.
            found = self._select_device(acc, stages, ctx, k, speculate=False)
            ctx.state["speculation"]["would_hold"] = False  # (the redo's _remember set it)
            return found if found is None else (*found[:2], False)
        hit = None if spec is None else True
        if one_stage and spec is not None:  # the read's stream was not needed: no guess
            ctx.state["speculation"]["would_hold"] = False  # to check on the next step
            hit = False
        if flags & dev.FLAG_OVERFLOW:
            ctx.state["device_room"] = min(2 * room, DEVICE_ROOM_MAX)
        if flags & dev.FLAG_REDO:  # (_select_host keeps the thresholds for the next guess)
            found = self._select_host(acc, stages, ctx, k)
            return found if found is None else (*found[:2], hit)
        if last > 0 and thresholds[1] != thresholds[0]:  # (equal: stage 2 stopped)
            self._remember(ctx, thresholds[0], thresholds[1], stages)
        indices = out.positions[:total].clone()
        return Selected(indices, out.values[:total].clone()), thresholds[last], hit

    def _select_host(self, acc: torch.Tensor, stages: int, ctx: Context, k: int):
        """The same stages on fused native passes: one read of acc for the first fit's
        statistics and the nonzeros, one for the second stage's, one that compacts the
        survivors of the second stage (positions and values); later stages read their pool
        in place, or compact it first where at most COMPACT_BELOW of it is expected to
        pass (the count above the last threshold times the ratio it was fitted at); the
        final selection comes from the last pool (its threshold is above the pool's, so
        nothing outside it can pass). When the previous step's thresholds are known, the
        first read also takes what the second stage needs near them and the pool above
        them (_native.sidco_spec): where the new thresholds land inside those bounds, the
        second and third reads are not needed; where not, they run as above. The
        selection is the same either way. The pools carry acc's values, so the final
        selection comes with the values to send (Selected). (Selected, threshold, whether
        the speculation held: None when not tried), or None when the data need the
        reference path's rescaling."""
        first = self.first_fit
        bounds = None
        if (acc.dtype == torch.float32 and acc.device.type == "cpu" and acc.is_contiguous()
                and acc.numel() < _native.NARROW_LIMIT):
            bounds = self._speculation_bounds(stages, ctx)
        spec = None
        if bounds is not None:
            # Σ squares for a GP first stage, mid's for its GP fit; logs for a gamma one;
            # the nonzeros always
            st, *rest = _native.sidco_spec(
                acc, *bounds, squares=first == "gpareto", logs=first == "gamma",
                mid_squares=self.later_fit != "exponential",
                room=_native.stream_room(acc.numel()))
            spec = _Speculative(*bounds, *rest)
        else:
            st = _native.stats(acc, squares=first == "gpareto", logs=first == "gamma",
                               nonzeros=True)
        check_sum_finite(acc, st.sum, ctx)  # the folded NaN/Inf check (ctx.check_finite)
        mean = st.sum / st.count
        if mean == 0.0:
            return None, 0.0, None
        if not SAFE_MEAN[0] <= mean <= SAFE_MEAN[1]:
            return None
        plan = self._first_stage(st.count, st.nonzero, stages)
        threshold = self._first_threshold_native(acc, st, plan)
        hit = None if spec is None else False  # None: not tried
        if plan is None or plan.single:
            if spec is not None:  # no second threshold: no guess to check next step
                ctx.state["speculation"]["would_hold"] = False
            return native_pick(acc, threshold, expected=k), threshold, hit
        wanted = self.ratio * st.count
        # Stage 2 fits the exceedances straight from acc (a stats pass with no output), or
        # from the speculative read; from stage 3 on, a stage reads the exceedances of the
        # last threshold from the current pool: in place (a pass that counts only those
        # above it) while they are expected to be more than COMPACT_BELOW of the pool,
        # else compacted first with their positions (the survivors of the first pool of
        # acc), so that later passes read only them.
        # maps[0]: acc positions of the first pool; maps[j]: positions in pool j of pool
        # j + 1. Only the final selection (about δ·d elements) is mapped back through them.
        # `above`: the pool holds elements at or below it that this stage must not see,
        # else None; `expected`: about how many of the pool exceed `threshold` (the last
        # stage's count times the ratio it fitted at).
        base, maps, pool, above, expected = None, [], acc, None, 0.0
        for stage in range(1, stages):
            left = stages - stage
            if stage == 1:
                first_threshold = threshold
                found = None
                if spec is not None:
                    found = self._second_threshold_speculative(acc, spec, threshold, wanted,
                                                               left)
                    if found is not None and found[1] is not None and _at_least(
                            found[1], spec.pool_above, acc.dtype):
                        hit = True  # the stream's pool holds everything above `new`
                        base, maps, pool = spec.pool_above, [spec.positions], spec.values
                if found is None:
                    found = self._later_threshold_native(acc, threshold, wanted, left,
                                                         above=threshold)
                _, new, expected = found
                if new is None:  # no more than wanted exceeds: the stages stop
                    break
                self._remember(ctx, first_threshold, new, stages)
                threshold = new
                continue
            if base is None or expected <= COMPACT_BELOW * pool.numel():
                # (acc itself is always compacted)
                local, pool = _compact(pool, threshold, expected / pool.numel())
                maps.append(local)
                base, above = threshold, None
                if pool.numel() == 0:
                    break
            else:
                above = threshold
            _, new, expected = self._later_threshold_native(pool, threshold, wanted, left,
                                                            above=above)
            if new is None:  # no more than wanted exceeds: the stages stop
                break
            threshold = new
        if base is None or pool.numel() == 0 or not _above(threshold, base, acc.dtype):
            return native_pick(acc, threshold, expected=k), threshold, hit
        # the pools carry acc's values (signed): those selected are the ones sent
        indices, values = _native.select(pool, threshold, values=True, signed=True)
        for positions in reversed(maps):
            indices = positions.index_select(0, indices)
        return Selected(indices, values), threshold, hit

    # -- speculation from the previous step --------------------------------------------

    def _speculation_bounds(self, stages: int, ctx: Context):
        """(window, upper, pool_above) for a speculative first read (_native.sidco_spec on
        the CPU, gpu_sidco's on CUDA) around this step's guess of the first two thresholds,
        or None: no speculation on the first steps, with one stage, after a change of the
        schedule (the stage count), or when the last guess would not have held (thresholds
        on the move, or no second stage: a miss costs more than the plain reads). The
        callers take only the inputs their read supports."""
        history = ctx.state.get("speculation")
        if (history is None or not history["would_hold"] or stages < 2
                or self.ratio >= self.first_stage_ratio
                or history["schedule"] != self._schedule(stages)):
            return None
        first, second = _guess(history["thresholds"])
        bounds = _bounds(first, second)
        return bounds if bounds[1] <= bounds[2] else None

    def _remember(self, ctx: Context, first: float, second: float, stages: int) -> None:
        """Keep the last two steps' first two thresholds, and whether the guess made from
        the earlier ones would have held for this step's."""
        history = ctx.state.get("speculation")
        used = self._schedule(stages)
        past = history["thresholds"] if history and history["schedule"] == used else []
        would_hold = False
        if past:
            window, upper, pool_above = _bounds(*_guess(past))
            would_hold = window <= first < upper and second >= pool_above
        ctx.state["speculation"] = {"thresholds": (past + [(first, second)])[-2:],
                                    "schedule": used, "would_hold": would_hold}

    def _second_threshold_speculative(self, acc: torch.Tensor, spec: _Speculative, t: float,
                                      wanted: float, left: int):
        """Stage 2 from the speculative read, when the first threshold `t` lies in its
        window (window ≤ t < upper as float32): what _later_threshold_native returns
        (the count of the exceedances of t is then exact). None when it does not (the
        caller then fits from acc)."""
        window, upper, mid = spec.window, spec.upper, spec.mid
        if not (_at_least(t, window, acc.dtype) and _above(upper, t, acc.dtype)):
            return None
        # the exceedances: mid (|x| ≥ upper) and the window's above t
        gp = self.later_fit != "exponential"
        st = _native.stats(spec.window_values, above=t, shift=t, squares=gp)
        n = st.count + mid.count
        tail_log = later_stage_log(n, wanted, left)
        if tail_log is None:
            return n, None, 0.0
        if not gp:  # mid holds Σ|x|: Σ(|x| − t) = Σ|x| − n·t
            new = self._threshold_from_sums(acc, t, t, tail_log, n,
                                            st.sum + mid.sum - mid.count * t, 0.0)
        else:
            # mid holds Σz, Σz² of z = |x| − u (u: upper as float32); y = z + (u − t)
            d = _as_dtype(upper, acc.dtype) - t
            sum_y = st.sum + mid.sum + mid.count * d
            sumsq_y = st.sumsq + mid.sumsq + 2 * d * mid.sum + mid.count * d * d
            new = self._threshold_from_sums(acc, t, t, tail_log, n, sum_y, sumsq_y)
        return n, new, n * math.exp(-tail_log)

    def _first_threshold_native(self, acc: torch.Tensor, st: _native.Stats,
                                plan: _FirstStage | None) -> float:
        """Stage 1's threshold from the first read's Stats of acc (its mean checked
        nonzero and within SAFE_MEAN): Σ|x| and the nonzeros, with Σx² for a GP fit or
        Σ ln|x| for a gamma one (exact zeros add nothing to the sums: only the divisor
        leaves them out). A further pass only under cancellation or in degenerate cases;
        the smallest nonzero |x| where every nonzero is kept (plan None)."""
        nonzeros = st.nonzero
        # the fitted elements: |x| > 0, or all of acc when it holds no zero (the same)
        above = None if nonzeros == st.count else 0.0

        def min_positive() -> float:
            return _native.stats(acc, above=0.0, extremes=True).min

        if plan is None:
            return min_positive()
        mean = st.sum / nonzeros
        if self.first_fit == "exponential":
            return exponential_quantile(mean, plan.tail_log)
        if self.first_fit == "gpareto":
            mean_g, var = moments_from_sums(
                mean, st.sumsq / nonzeros,
                lambda m: _native.stats(acc, above=above, shift=m, squares=True).sumsq
                / nonzeros)
            return self._gpareto_threshold(min_positive, 0.0, mean_g, var, plan.tail_log)
        return self._gamma_threshold(mean, st.log_sum / nonzeros, plan.ratio, min_positive)

    def _later_threshold_native(self, pool: torch.Tensor, t: float, wanted: float, left: int,
                                above: float | None = None):
        """A later stage by fused native passes, on the elements of `pool` above `above`
        (all of them when None: a compacted pool), with `left` stages to go (this one
        included): (the count of its exceedances of t, the new threshold or None where the
        stages stop, about how many exceed the new threshold)."""
        st = _native.stats(pool, above=above, shift=t, squares=self.later_fit != "exponential")
        tail_log = later_stage_log(st.count, wanted, left)
        if tail_log is None:
            return st.count, None, 0.0
        new = self._threshold_from_sums(pool, above, t, tail_log, st.count, st.sum, st.sumsq)
        return st.count, new, st.count * math.exp(-tail_log)

    def _threshold_from_sums(self, source: torch.Tensor, above: float | None, t: float,
                             tail_log: float, n: int, sum_y: float, sumsq_y: float) -> float:
        """A later stage's threshold from the count n, Σy and Σy² (read for the GP fit
        only) of the exceedances y = |x| − t, the elements of `source` above `above`
        (read again only for the GP fit's second pass under cancellation or its
        point-mass minimum), at L = tail_log."""
        if self.later_fit == "exponential":
            return t + exponential_quantile(sum_y / n, tail_log)
        mean, var = moments_from_sums(
            sum_y / n, sumsq_y / n,
            lambda m: _native.stats(source, above=above, shift=t + m, squares=True).sumsq / n)
        return self._gpareto_threshold(
            lambda: _native.stats(source, above=above, extremes=True).min, t, mean, var,
            tail_log)

    def _adapt(self, state: dict, quality: float) -> None:
        """Adapt_Stages of Algorithm 1 on the mean k̂/k of the last adapt_interval steps."""
        state["quality_sum"] = state.get("quality_sum", 0.0) + quality
        state["quality_steps"] = state.get("quality_steps", 0) + 1
        if state["quality_steps"] < self.adapt_interval:
            return
        average = state["quality_sum"] / state["quality_steps"]
        stages = state["stages"]
        if average > 1.0 + self.eps_high:
            stages -= 1
        elif average < 1.0 - self.eps_low:
            stages += 1
        state["stages"] = min(max(stages, 1), self.max_stages)
        state["quality_sum"] = 0.0
        state["quality_steps"] = 0


_device_checked: dict = {}  # (device, variant) -> whether _select_device may be used there


def _device_stages_usable(device: torch.device, sidco: _SIDCo) -> bool:
    """Whether SIDCo's device-side stages (_select_device) are used on `device` for this
    variant: checked once per device and variant against the host-driven path on a
    synthetic gradient (a Triton that cannot compile the kernels, or any difference, leaves
    the host-driven path in use, with a warning)."""
    key = (device, type(sidco).__name__)
    if key not in _device_checked:
        _device_checked[key] = _check_device_stages(device, type(sidco))
    return _device_checked[key]


def _check_device_stages(device: torch.device, variant: type) -> bool:
    import warnings  # noqa: PLC0415

    problem = None
    try:
        g = torch.Generator().manual_seed(5)

        def laplace(n: int) -> torch.Tensor:
            u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
            return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)

        base = laplace(300_007)
        # the positions of the last step's exact zeros (90%): stage 1 on the nonzeros, and
        # at ratio 0.05 (ρ = 0.5) a single stage whose later pools keep their ties
        zeros = torch.randperm(base.numel(), generator=g)[:270_000]
        for ratio in (0.001, 0.05):
            sidco = variant(ratio=ratio)
            k = max(1, int(ratio * base.numel()))
            stages = sidco.initial_stages
            on_device, on_host = (Context(rank=0, world_size=1, step=0, name="check",
                                          state={}, generator=g, shared_seed=0)
                                  for _ in range(2))
            # three steps of a growing gradient (the third is read speculatively), then
            # one with exact zeros
            speculated = False
            for step in range(4):
                acc = base * (1 + 0.02 * step) + 0.1 * laplace(base.numel())
                if step == 3:
                    acc[zeros] = 0.0
                acc = acc.to(device)
                got = sidco._select_device(acc, stages, on_device, k)
                want = sidco._select_host(acc, stages, on_host, k)
                if not (_same_selection(got[0], want[0])
                        and abs(got[1] - want[1]) <= 1e-12 * abs(want[1])):
                    problem = (f"its selection at ratio {ratio}, step {step} differs from the "
                               "host-driven path's")
                    break
                speculated |= got[2] is True
            if problem is None and not speculated:
                problem = f"its speculative read was not taken at ratio {ratio}"
            if problem is not None:
                break
    except Exception as exc:  # noqa: BLE001 (whatever fails: report it, use the host path)
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        warnings.warn(f"SIDCo's device-side stages are unusable on {device} ({problem}); "
                      "using the host-driven stages", RuntimeWarning, stacklevel=4)
    return problem is None


def _same_selection(a: Selected, b: Selected) -> bool:
    """The same positions (whatever their integer dtype) and the same values."""
    return (torch.equal(a.indices.to(torch.int64), b.indices.to(torch.int64))
            and torch.equal(a.values, b.values))


def _compact(pool: torch.Tensor, t: float, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in `pool` (ascending; int32 on the CPU, see pool_index_dtype) and values
    (signed, as in acc) of its elements with |x| > t; `keep`: the fraction expected to
    pass."""
    if pool.dtype == torch.float32:
        _, local, values = _native.pool(
            pool, t, dense=keep > _native.DENSE_FRACTION,
            reserve=int(1.25 * keep * pool.numel()) + 1024, index_dtype=pool_index_dtype(pool),
            signed=True)
        return local, values
    return _native.select(pool, t, strict=True, values=True, signed=True,
                          reserve=int(2 * keep * pool.numel()))


class _Speculative(NamedTuple):
    """The speculative first read (_native.sidco_spec): its bounds and what it found."""

    window: float
    upper: float
    pool_above: float
    mid: _native.Stats  # |acc| ≥ upper
    # views of this thread's stream room (_native.stream_room): read before select returns
    positions: _native.StreamPositions  # acc positions of the stream (index_select)
    values: torch.Tensor  # their acc (signed): |acc| > pool_above
    window_values: torch.Tensor  # acc at window ≤ |acc| < upper (no positions: not sent)


def _speculation_shares(ratios: list[float]) -> dict:
    """The fractions of acc expected in the device read's window and pool (their
    buffers' sizes): for an exponential tail fitted at stage 1's and stage 2's nominal
    ratios (stage_ratios: a tensor with zeros, whose stages keep fractions of the
    nonzeros, fills less), δ₁·(δ₁^−m − δ₁^m) near the first threshold and (δ₁δ₂)^(1−m)
    above (1 − m) times the second, m = SPECULATION_MARGIN."""
    m, first, both = SPECULATION_MARGIN, ratios[0], ratios[0] * ratios[1]
    return {"keep_window": first * (first ** -m - first ** m), "keep_pool": both ** (1 - m)}


def _guess(thresholds: list[tuple[float, float]]) -> tuple[float, float]:
    """This step's first two thresholds guessed from the last one or two steps': the last
    pair times its growth over the one before (with error feedback the residual, and so
    every threshold, grows for many steps), or the last pair alone."""
    if len(thresholds) < 2:
        return thresholds[-1]
    (a1, a2), (b1, b2) = thresholds[-2:]
    return b1 * (b1 / a1), b2 * (b2 / a2)


def _bounds(first: float, second: float) -> tuple[float, float, float]:
    """(window, upper, pool_above) of the speculative read around a guess."""
    return (first * (1 - SPECULATION_MARGIN), first * (1 + SPECULATION_MARGIN),
            second * (1 - SPECULATION_MARGIN))


def _as_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as a comparison with a tensor of that dtype sees it."""
    if dtype == torch.float64:
        return float(value)
    if dtype == torch.float32:  # as torch's conversion, a few µs less per call
        return _native.round_f32(value)
    return float(torch.tensor(value, dtype=dtype))


def _above(threshold: float, base: float, dtype: torch.dtype) -> bool:
    """Whether t > base once both are rounded to dtype (how the comparisons see them):
    then {|x| ≥ t} lies inside the pool {|x| > base}."""
    return _as_dtype(threshold, dtype) > _as_dtype(base, dtype)


def _at_least(threshold: float, base: float, dtype: torch.dtype) -> bool:
    """Whether t ≥ base once both are rounded to dtype: then {|x| > t} lies inside the
    pool {|x| > base}."""
    return _as_dtype(threshold, dtype) >= _as_dtype(base, dtype)


@register("sidco_e")
class SIDCoExponential(_SIDCo):
    """SIDCo-E: multi-stage exponential (double-exponential gradients; |g| ~ Exp)."""

    first_fit = "exponential"
    later_fit = "exponential"


@register("sidco_gp")
class SIDCoGeneralizedPareto(_SIDCo):
    """SIDCo-GP: multi-stage generalized Pareto (heavy, polynomial tails)."""

    first_fit = "gpareto"
    later_fit = "gpareto"


@register("sidco_p")
class SIDCoGammaPareto(_SIDCo):
    """SIDCo-P: gamma first stage, generalized Pareto on the exceedances after it."""

    first_fit = "gamma"
    later_fit = "gpareto"
