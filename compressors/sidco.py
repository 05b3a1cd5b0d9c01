"""SIDCo (Abdelmoniem et al., MLSys 2021): threshold sparsification from a fitted
sparsity-inducing distribution, multi-stage peak-over-threshold fitting, and adaptive
stage count (sidco.txt: Algorithm 1, Section 2.4, Appendix B.3).

Per step (Algorithm 1, Sparsify, lines 2-8), on a = |acc| / ||acc||₂ with d elements, n₀
of them nonzero, k = δ·d wanted (a real number, not the rounded target), M stages:
  stage 1   (lines 2-3) fit the chosen distribution to the n₀ nonzero magnitudes only
            and take its (1 − δ₁') quantile η₁. Among the nonzeros the fraction wanted
            is ρ = k/n₀: ρ ≥ 1 keeps every nonzero (η₁ = the smallest |x| > 0, no later
            stage); M = 1 or ρ ≥ δ₁ is one stage at δ₁' = ρ; else δ₁' = δ₁;
  stage m   (lines 3-4, the loop) the pool is what exceeds η_{m−1}, p elements. If p ≤ k
            the stages stop and η_{m−1} stays; else fit the exceedances (shifted by
            η_{m−1}) at δ_m = (k/p)^(1/(M − m + 1)), the k still wanted over the pool's
            real size spread over the stages left: η_m = η_{m−1} + F⁻¹(1 − δ_m);
  select    (line 8) {i : a_i ≥ η_last} on the full tensor, in one pass.
Why the ratios come from the counts: gradients with many exact zeros (90–99%) break the
paper's fixed schedule δ_m = (δ/δ₁)^(1/(M−1)): the zeros drag the first fit's scale down
and k̂/k falls to 0.04–0.6 at any M. Left out of the fit, the zeros move no threshold, and
ratios set from each pool's real size let every later stage make up for the stages
before it. Without zeros and with fits that hold (p ≈ δ₁·d) these are the paper's ratios.

Every Q = adapt_interval steps the mean k̂/k of those steps moves M (lines 4-7 and
Adapt_Stages, lines 17-22; per tensor and worker, in ctx.state): above 1 + ε_H → M − 1,
below 1 − ε_L → M + 1, clamped to [1, max_stages].

Start-up. By default M starts at default_initial_stages (each stage keeping about δ₁ of
its input). The paper starts single-stage and adapts, over-sending in the first steps
(Section 4.2 on Fig. 3(d), Appendix E.1 on Fig. 9(o)): initial_stages=1. One stage on
gradients with tails heavier than its fit over-selects (k̂/k ≈ 5 for sidco_e on
Student-t magnitudes at δ = 0.001, ≈ 11 in the first steps of sidco-fig9's LSTM at
δ = 0.001), and there the printed rule deadlocks: over-selection gives M − 1 = 0, which
the clamp returns to 1, so M stays 1 and the run over-sends throughout. Only added
stages, fitting the tail on what exceeds the first threshold, bring k̂/k down. So with
initial_stages=1 the rule keeps a floor F (state["floor"], at first 1): a window above
1 + ε_H at M ≤ F adds a stage and raises F to it; every other move is the printed one
(above 1 + ε_H at M > F → M − 1, below 1 − ε_L → M + 1). Every count below F has been
seen over-selecting, so the printed M − 1 there would only send more (on Student-t
gradients at δ = 0.001 one noisy window at M = 3 takes sidco_e back to 2, then to 1, each
sending 3–5× k); at F = 1 it is the deadlock. The start-up
thus adds stages while the windows over-select and keeps the count they settle at. Only
a run started at one stage does this: the default start keeps the printed rule.

Fits (Thresh_Estimation, lines 9-15; all scale-equivariant, so thresholds on a and on
|acc| differ only by the norm; each quantile written with L = ln(1/δ_m)):
  exponential   η = t + mean(y)·L                                 y = exceedances − t
  gen. Pareto   α = ½(1 − μ²/σ²), β = ½μ(μ²/σ² + 1) (moment matching on y; σ² is the
                variance, as Appendix B.3 derives — Algorithm 1 misprints σ),
                η = t + (β/α)(e^(αL) − 1), the exponential limit as α → 0
  gamma         s = ln mean(a) − mean(ln a), α = (3 − s + √((s − 3)² + 24s)) / (12s),
                β = mean(a)/α, η = β·P⁻¹(α, 1 − δ) with the exact inverse regularised
                incomplete gamma (scipy, on two scalars; Eq. 14, not the α ≤ 1 bound 15)
Variants: sidco_e (exponential, then exponential), sidco_gp (GP, then GP), sidco_p
(gamma first stage, then GP).

This module holds the method in torch (`select_reference`). Where the kernels take acc,
compressors/kernels/sidco_pipeline.py runs the same stages on fused passes (host-driven,
speculative, or with the thresholds kept on a CUDA device), with the fits below.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch

from compressors.base import Context, Selected
from compressors.kernels import sidco_pipeline
from compressors.kernels.magnitudes import (
    magnitudes,
    mean_abs,
    mean_and_variance,
    nonzero_indices,
    rescale_for_moments,
)
from compressors.registry import register
from compressors.threshold import (
    ThresholdSparsifier,
    check_finite_range,
    check_positive_int,
    nothing_selected,
)

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
    (_SIDCo.first_stage, later_stage_log); these size the device path's buffers, which a
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


class FirstStage(NamedTuple):
    """Stage 1's schedule for one step (_SIDCo.first_stage): its ratio among the nonzeros,
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
        elif (isinstance(initial_stages, bool) or not isinstance(initial_stages, int)
              or initial_stages < 1):
            raise ValueError(
                f"initial_stages={initial_stages!r} must be an integer ≥ 1: the stage count "
                "the first step uses (1: the paper's single-stage start-up; None: "
                "1 + ⌈ln(δ/δ₁)/ln δ₁⌉, each stage keeping about δ₁ of its input)")
        self.initial_stages = initial_stages
        if self.initial_stages > self.max_stages:
            raise ValueError(
                f"initial_stages={initial_stages} exceeds max_stages={self.max_stages}; "
                "raise max_stages or start with fewer stages")

    # -- the schedule ------------------------------------------------------------------

    def first_stage(self, numel: int, nonzeros: int, stages: int) -> FirstStage | None:
        """Stage 1 of a step with `stages` stages on `numel` elements, `nonzeros` (≥ 1) of
        them nonzero: the fraction of the nonzeros wanted is ρ = δ·(d/n₀) (exactly δ
        without zeros); None when ρ ≥ 1 (every nonzero is kept)."""
        rho = self.ratio * (numel / nonzeros)
        if rho >= 1.0:
            return None
        if stages == 1 or rho >= self.first_stage_ratio:
            return FirstStage(rho, -math.log(rho), True)
        first = self.first_stage_ratio
        return FirstStage(first, -math.log(first), False)

    def nominal_ratios(self, stages: int) -> list[float]:
        return stage_ratios(self.ratio, self.first_stage_ratio, stages)

    def later_stage_log(self, pool: int, wanted: float, left: int) -> float | None:
        return later_stage_log(pool, wanted, left)

    def _reported_stages(self, stages: int) -> int:
        """Outcome.extra["stages"]: the stage count M in use (adaptation's), 1 where
        δ ≥ δ₁ (then every step has one stage). A step may end its stages earlier (ρ ≥ δ₁,
        or a pool holding no more than k)."""
        return 1 if self.ratio >= self.first_stage_ratio else stages

    # -- Thresh_Estimation (lines 9-15): a stage's threshold from its statistics -------

    @staticmethod
    def exponential_threshold(t: float, mean_excess: float, tail_log: float) -> float:
        return t + exponential_quantile(mean_excess, tail_log)

    @staticmethod
    def gpareto_threshold(pool_min, t: float, mean: float, var: float,
                          tail_log: float) -> float:
        """`pool_min()`: the smallest fitted magnitude (asked for only at a point mass)."""
        if not var > _POINT_MASS_CV2 * mean * mean:
            # Point mass (all exceedances equal): the GP limit puts every quantile at the
            # point; take the smallest element so ties are kept despite rounding.
            return pool_min()
        alpha, beta = gpareto_parameters(mean, var)
        return t + gpareto_quantile(alpha, beta, tail_log)

    @staticmethod
    def gamma_threshold(mean: float, mean_log: float, ratio: float, min_positive) -> float:
        """Gamma first stage from the mean and the mean log of the nonzero magnitudes (the
        gamma model lives on (0, ∞)); `min_positive()` is asked for only at a point mass."""
        s = math.log(mean) - mean_log
        if not s > _POINT_MASS_S:
            # The nonzeros are (numerically) one value: the fit's limit is a point mass at
            # it; keep all of them.
            return min_positive()
        alpha, beta = gamma_parameters(mean, mean_log)
        return gamma_quantile(alpha, beta, ratio)

    def _first_threshold(self, mag: torch.Tensor, nonzeros: int,
                         plan: FirstStage | None) -> float:
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
            return self.gpareto_threshold(lambda: float(positive.min()), 0.0, mean, var,
                                          plan.tail_log)
        mean_log = float(torch.log(positive.to(torch.float64)).sum()) / nonzeros
        return self.gamma_threshold(mean, mean_log, plan.ratio, lambda: float(positive.min()))

    def _later_threshold(self, pool: torch.Tensor, t: float, tail_log: float) -> float:
        """Stage m ≥ 2: fit the exceedances y = pool − t of the previous threshold t."""
        # Shifted first (in float64): the exceedances' variance is then not a small
        # difference of large second moments.
        excess = pool.to(torch.float64) - t
        if self.later_fit == "exponential":
            return self.exponential_threshold(t, float(excess.sum()) / pool.numel(), tail_log)
        mean, var = mean_and_variance(excess)
        return self.gpareto_threshold(lambda: float(pool.min()), t, mean, var, tail_log)

    # -- the step (Sparsify) ------------------------------------------------------------

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        state = ctx.state
        stages = state.get("stages", self.initial_stages)
        found = sidco_pipeline.select(acc, k, stages, self, state, ctx.check_finite)
        if found is None:  # the kernels do not take acc, or its mean needs rescaling
            indices, threshold = self.select_reference(acc, stages)
            found = (None if indices is None else Selected.gather(acc, indices), threshold,
                     None)
        # kept only once the first read of acc has passed (ctx.check_finite: nothing is
        # written before a NaN/Inf is found)
        state["stages"] = stages
        chosen, threshold, state["speculated"] = found  # (the fused paths' diagnostic)
        reported = self._reported_stages(stages)
        if chosen is None:  # all zero: nothing to send, and no information for adaptation
            return nothing_selected(acc, stages=reported, threshold=0.0)
        fitted = chosen.indices.numel()  # what the fits selected: the quality adaptation sees
        if fitted == 0 and self.ratio * acc.numel() < 1:
            # Fewer than 1/δ values (16 at δ = 0.01): the fitted (1 − δ)-quantile lies
            # beyond the largest of them in most steps (the exponential's mean·ln(1/δ)
            # exceeds the sample maximum, about mean·ln d, when d < 1/δ), so the tensor
            # would send nothing and its error-feedback residual grow without bound; its
            # largest value is sent instead (k = 1).
            top = torch.topk(acc.reshape(-1).abs(), k)
            chosen = Selected.gather(acc, top.indices.sort().values)
            threshold = float(top.values.min())
        if self.adaptive and self.ratio < self.first_stage_ratio:  # lines 4-7
            self._adapt(state, fitted / k)
        return chosen._replace(extra={"stages": reported, "threshold": threshold})

    def select_reference(self, acc: torch.Tensor, stages: int):
        """Lines 2-8 in torch: (indices, threshold in |acc| units), or (None, 0) if all
        zero."""
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
        plan = self.first_stage(numel, nonzeros, stages)
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

    def _adapt(self, state: dict, quality: float) -> None:
        """Adapt_Stages (lines 17-22) on the mean k̂/k of the last adapt_interval steps;
        with initial_stages=1, over-selection at the floor adds a stage (see the module
        docstring; state["floor"])."""
        state["quality_sum"] = state.get("quality_sum", 0.0) + quality
        state["quality_steps"] = state.get("quality_steps", 0) + 1
        if state["quality_steps"] < self.adapt_interval:
            return
        average = state["quality_sum"] / state["quality_steps"]
        stages = state["stages"]
        if average > 1.0 + self.eps_high:
            if self.initial_stages == 1 and stages <= state.get("floor", 1):
                # the single-stage start-up: over-selecting at the floor, where the
                # printed M − 1 is clamped back to 1 (at M = 1) or returns to a count
                # that over-selected more, a stage is added and the floor raised to it
                stages += 1
                state["floor"] = min(stages, self.max_stages)
            else:
                stages -= 1
        elif average < 1.0 - self.eps_low:
            stages += 1
        state["stages"] = min(max(stages, 1), self.max_stages)
        state["quality_sum"] = 0.0
        state["quality_steps"] = 0


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
