"""Property tests of the SIDCo family (compressors/sidco.py): estimation quality k̂/k after
stage adaptation on the distribution each fit models, the direction of stage adaptation,
the stage thresholds against an independent float64 reference built on scipy's quantiles,
degenerate inputs, scale and dtype invariance, and parameter validation."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from scipy import special, stats

import compressors
from compressors import SimulatedGroup
from compressors.sidco import default_initial_stages, default_max_stages, stage_ratios
from repro.sources import synthetic

VARIANTS = ["sidco_e", "sidco_gp", "sidco_p"]
# The source whose |g| follows the distribution each variant's first stage fits.
MODELLED = {"sidco_e": "laplace", "sidco_gp": "student-t", "sidco_p": "gamma"}
RATIOS = [0.1, 0.01, 0.001]


@functools.lru_cache(maxsize=None)
def stream(kind: str, size: int, workers: int, steps: int, seed: int = 0):
    """Per-step gradient lists of a synthetic source, shared by the tests of this module."""
    return tuple(tuple(synthetic(kind, size, workers, seed, s)) for s in range(steps))


def run(name: str, grads, feedback: str, **params):
    """Step a simulated group through `grads`; per step: mean k̂/k over workers and the
    outcomes of rank 0."""
    compressor = compressors.build(name, **params)
    group = SimulatedGroup(compressor, len(grads[0]), feedback=feedback, seed=0)
    quality, first = [], []
    for step_grads in grads:
        outs = group.step(list(step_grads))
        quality.append(sum(o.selected / o.target for o in outs) / len(outs))
        first.append(outs[0])
    return quality, first


def one_step(compressor, x):
    """One worker, no feedback, one step on `x` (a numpy array or a tensor): its Outcome."""
    x = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return SimulatedGroup(compressor, 1, feedback="none").step([x])[0]


def single_stage(name: str, ratio: float, stages: int = 1, **params):
    return compressors.build(name, ratio=ratio, initial_stages=stages, adaptive=False,
                             max_stages=max(stages, 1), **params)


# --- estimation quality ---------------------------------------------------------------


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", VARIANTS)
def test_quality_with_error_feedback_on_the_modelled_source(name, ratio):
    """SIDCo's claim (Fig. 1c, Fig. 9): with error feedback and adapted stages, the mean
    k̂/k stays within ε = 20% of 1 on gradients of the family it models."""
    grads = stream(MODELLED[name], 100_000, 2, 30)
    quality, outs = run(name, grads, "residual", ratio=ratio)
    mean = sum(quality[-10:]) / 10
    assert 0.8 <= mean <= 1.25, f"{name} δ={ratio}: mean k̂/k {mean:.3f} over the last 10 steps"
    for o in outs:
        assert 1 <= o.extra["stages"] <= default_max_stages(ratio)
        assert o.extra["threshold"] > 0


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", VARIANTS)
def test_fit_alone_is_accurate_on_the_modelled_source(name, ratio):
    """Without error feedback every worker's |acc| is exactly the modelled distribution:
    the multi-stage fit then lands within 15% of k on average."""
    grads = stream(MODELLED[name], 100_000, 2, 30)[:15]
    quality, _ = run(name, grads, "none", ratio=ratio)
    mean = sum(quality[-5:]) / 5
    assert 0.85 <= mean <= 1.15, f"{name} δ={ratio}: mean k̂/k {mean:.3f}"


def test_mismatched_fit_fails_where_the_adaptation_rule_cannot_help():
    """Where fits fail: the exponential fit on log-normal tails under-selects at many
    stages and over-selects at one, so k̂ does not grow with M; Adapt_Stages' rule (too
    few → M + 1) then drives M to max_stages and k̂/k stays far below 1."""
    grads = stream("lognormal", 100_000, 1, 30)
    quality, outs = run("sidco_e", grads, "none", ratio=0.001)
    assert sum(quality[-5:]) / 5 < 0.5
    assert outs[-1].extra["stages"] == default_max_stages(0.001)


# --- stage adaptation -----------------------------------------------------------------


def stage_trace(initial: int, steps: int = 24, interval: int = 2):
    grads = stream("normal", 100_000, 1, steps)
    quality, outs = run("sidco_e", grads, "none", ratio=0.001, initial_stages=initial,
                        adapt_interval=interval)
    return quality, [o.extra["stages"] for o in outs]


def test_adaptation_adds_stages_when_too_few_are_selected():
    """A single exponential stage on half-normal magnitudes puts the threshold far in the
    tail (k̂ ≈ 0); each window below 1 − ε_L adds a stage until k̂/k is in the band."""
    quality, stages = stage_trace(initial=1)
    assert stages[0] == 1 and quality[0] < 0.1
    assert all(b >= a for a, b in zip(stages, stages[1:])), stages
    assert stages[-1] > 2
    assert 0.8 <= sum(quality[-4:]) / 4 <= 1.2, (quality, stages)


def test_adaptation_removes_stages_when_too_many_are_selected():
    """Ten exponential stages on half-normal magnitudes over-select (each stage's mean
    excess overstates the light tail's); windows above 1 + ε_H remove stages."""
    quality, stages = stage_trace(initial=10)
    assert stages[0] == 10 and quality[0] > 1.25
    assert all(b <= a for a, b in zip(stages, stages[1:])), stages
    assert stages[-1] < 7
    assert 0.8 <= sum(quality[-4:]) / 4 <= 1.25, (quality, stages)


def test_adaptation_happens_every_q_steps_and_only_outside_the_band():
    _, stages = stage_trace(initial=1, steps=20, interval=5)
    changes = [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    assert changes and all(i % 5 == 0 for i in changes), stages
    # Laplace magnitudes are exponential: every stage count is on target, M never moves.
    _, outs = run("sidco_e", stream("laplace", 100_000, 1, 20), "none", ratio=0.001,
                  initial_stages=3, adapt_interval=2)
    assert {o.extra["stages"] for o in outs} == {3}
    # adaptive=False keeps the initial count whatever the quality.
    _, outs = run("sidco_e", stream("normal", 100_000, 1, 20), "none", ratio=0.001,
                  initial_stages=1, adaptive=False)
    assert {o.extra["stages"] for o in outs} == {1}


def test_stage_schedule():
    for ratio in RATIOS + [0.0003]:
        for m in range(1, 8):
            ratios = stage_ratios(ratio, 0.25, m)
            assert math.isclose(math.prod(ratios), ratio, rel_tol=1e-12)
            assert len(ratios) == (1 if m == 1 else m)
            if m > 1:
                assert ratios[0] == 0.25
    assert stage_ratios(0.3, 0.25, 5) == [0.3]  # δ ≥ δ₁: one stage
    assert [default_initial_stages(r, 0.25) for r in (0.5, 0.1, 0.01, 0.001)] == [1, 2, 4, 5]
    assert [default_max_stages(r) for r in (0.5, 0.1, 0.01, 0.001)] == [1, 4, 7, 10]
    c = compressors.build("sidco_e", ratio=0.001)
    assert (c.initial_stages, c.max_stages, c.first_stage_ratio) == (5, 10, 0.25)
    assert c.adapt_interval == 5
    assert (c.adaptive, c.eps_high, c.eps_low) == (True, 0.2, 0.2)


# --- thresholds against an independent reference --------------------------------------


def reference_threshold(values: np.ndarray, name: str, ratio: float, stages: int) -> float:
    """Algorithm 1 in float64 numpy, each stage's quantile from scipy.stats with the
    paper's estimators (exponential MLE, GP moment matching with σ², Minka's gamma)."""
    a = np.abs(values.astype(np.float64))
    ratios = stage_ratios(ratio, 0.25, stages)
    first = {"sidco_e": "exp", "sidco_gp": "gp", "sidco_p": "gamma"}[name]
    later = "exp" if name == "sidco_e" else "gp"
    t, pool = 0.0, a
    for m, r in enumerate(ratios):
        if m:
            pool = pool[pool > t]
        y = pool - t
        fit = first if m == 0 else later
        if fit == "exp":
            t = t + stats.expon.ppf(1 - r, scale=y.mean())
        elif fit == "gp":
            q = y.mean() ** 2 / y.var()
            t = t + stats.genpareto.ppf(1 - r, c=0.5 * (1 - q), scale=0.5 * y.mean() * (q + 1))
        else:
            s = np.log(y.mean()) - np.log(y).mean()
            shape = (3 - s + np.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
            t = stats.gamma.ppf(1 - r, a=shape, scale=y.mean() / shape)
    return float(t)


def signed_sample(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], size=n)
    if kind == "exp":
        mag = rng.exponential(2.0, n)
    elif kind == "gp":
        mag = stats.genpareto.rvs(c=0.1, scale=1.5, size=n, random_state=rng)
    else:
        mag = rng.gamma(0.5, 2.0, n)
    return (sign * mag).astype(np.float32)


FAMILY = {"sidco_e": "exp", "sidco_gp": "gp", "sidco_p": "gamma"}
TRUE_QUANTILE = {
    "exp": lambda r: stats.expon.ppf(1 - r, scale=2.0),
    "gp": lambda r: stats.genpareto.ppf(1 - r, c=0.1, scale=1.5),
    "gamma": lambda r: stats.gamma.ppf(1 - r, a=0.5, scale=2.0),
}


@pytest.mark.parametrize("ratio", [0.3, 0.01, 0.001])
@pytest.mark.parametrize("name", VARIANTS)
def test_single_stage_threshold_is_the_fitted_quantile(name, ratio):
    """One stage on an exact exponential / GP / gamma sample: the threshold is scipy's
    quantile of the fitted distribution (closed form for exponential and GP, the inverse
    incomplete gamma for gamma), close to the true quantile, and the selection is exactly
    {|x| ≥ threshold}."""
    x = signed_sample(FAMILY[name], 400_000, seed=1)
    out = one_step(single_stage(name, ratio), x)
    threshold = out.extra["threshold"]
    assert out.extra["stages"] == 1
    assert threshold == pytest.approx(reference_threshold(x, name, ratio, 1), rel=1e-4)
    assert threshold == pytest.approx(TRUE_QUANTILE[FAMILY[name]](ratio), rel=0.04)
    assert out.selected == int((torch.from_numpy(x).abs() >= threshold).sum())


@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("name", VARIANTS)
def test_multi_stage_threshold_matches_the_reference(name, stages):
    """Later stages fit the exceedances shifted by the previous threshold (PoT), each at
    δ_m = (δ/δ₁)^(1/(M−1)); on the family's own sample the result stays near the true
    quantile too."""
    ratio = 0.001
    x = signed_sample(FAMILY[name], 400_000, seed=2)
    out = one_step(single_stage(name, ratio, stages), x)
    assert out.extra["stages"] == stages
    expected = reference_threshold(x, name, ratio, stages)
    assert out.extra["threshold"] == pytest.approx(expected, rel=2e-3)
    assert out.extra["threshold"] == pytest.approx(TRUE_QUANTILE[FAMILY[name]](ratio), rel=0.1)


def test_gamma_fit_leaves_exact_zeros_out():
    """The gamma model lives on (0, ∞): with half the entries exactly zero the fit runs
    on the nonzeros at ratio δ·d/nnz, so k̂/k stays near 1 instead of collapsing."""
    x = signed_sample("gamma", 400_000, seed=3)
    x[::2] = 0.0
    for ratio in (0.01, 0.001):
        out = one_step(single_stage("sidco_p", ratio), x)
        assert 0.85 <= out.selected / out.target <= 1.15
        nz = np.abs(x[x != 0]).astype(np.float64)
        s = np.log(nz.mean()) - np.log(nz).mean()
        shape = (3 - s + np.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
        expected = nz.mean() / shape * special.gammainccinv(shape, ratio * x.size / nz.size)
        assert out.extra["threshold"] == pytest.approx(expected, rel=1e-4)


# --- degenerate inputs, scale and dtype -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["zeros", "constant", "one"])
@pytest.mark.parametrize("name", VARIANTS)
def test_degenerate_inputs_give_finite_consistent_results(name, kind, dtype):
    """No NaN; the aggregate is the mean of what the workers sent; acc == sent + residual.
    A constant tensor is a point mass: a threshold keeps all ties or none (the GP and
    gamma fits' limit is the point itself, so they keep all; the exponential's quantile
    lies above it, so it keeps none). Zeros are never sent."""
    d = {"zeros": 1000, "constant": 1000, "one": 1}[kind]
    value = {"zeros": 0.0, "constant": 0.25, "one": -1.5}[kind]
    grads = [torch.full((d,), value, dtype=dtype), torch.full((d,), value, dtype=dtype)]
    group = SimulatedGroup(compressors.build(name, ratio=0.01), 2, feedback="residual", seed=0)
    for step in range(3):
        accs = [g.clone() if step == 0 else s.residual("grad").clone() + g
                for s, g in zip(group.sessions, grads)]
        outs = group.step(grads, name="grad")
        sent = [o.sent.dense(d).to(torch.float32) for o in outs]
        expected = (sent[0] + sent[1]) / 2
        for o, s, acc in zip(outs, group.sessions, accs):
            assert torch.isfinite(o.aggregate.float()).all()
            assert torch.isfinite(torch.tensor(o.extra["threshold"]))
            torch.testing.assert_close(o.aggregate.float(), expected)
            assert torch.equal(o.sent.dense(d) + s.residual("grad"), acc)
            if kind == "zeros":
                assert o.selected == 0
            else:
                assert o.selected == (0 if name == "sidco_e" else d)


@pytest.mark.parametrize("name", VARIANTS)
def test_selection_is_scale_free(name):
    """a = |acc|/‖acc‖₂: multiplying the gradient by 2⁻¹⁰⁰, 2⁶⁰ or 2¹²⁰ (where float32
    second moments underflow / overflow, and at 2¹²⁰ even the sum does) selects the same
    set, up to rounding at the threshold, and scales the reported threshold."""
    x = torch.from_numpy(signed_sample(FAMILY[name], 200_000, seed=4))
    base = one_step(compressors.build(name, ratio=0.001), x)
    idx = set(base.sent.indices.tolist())
    for scale in (2.0**-100, 2.0**60, 2.0**120):
        out = one_step(compressors.build(name, ratio=0.001), x * scale)
        assert len(idx ^ set(out.sent.indices.tolist())) <= 2
        assert out.extra["threshold"] == pytest.approx(base.extra["threshold"] * scale, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", VARIANTS)
def test_half_precision_statistics_are_taken_in_float32(name, dtype):
    x = torch.from_numpy(signed_sample(FAMILY[name], 100_000, seed=5)).to(dtype)
    half = one_step(compressors.build(name, ratio=0.01), x)
    full = one_step(compressors.build(name, ratio=0.01), x.float())
    assert torch.equal(half.sent.indices, full.sent.indices)
    assert half.aggregate.dtype == dtype
    assert 0.5 <= half.selected / half.target <= 2.0


# --- parameters -----------------------------------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize(
    "param,value",
    [
        ("first_stage_ratio", 0.0), ("first_stage_ratio", 1.0), ("first_stage_ratio", float("nan")),
        ("adapt_interval", 0), ("adapt_interval", 2.5), ("adapt_interval", True),
        ("eps_high", -0.1), ("eps_high", 1.0), ("eps_low", -0.1), ("eps_low", 1.5),
        ("max_stages", 0), ("max_stages", 1.5), ("initial_stages", 0), ("initial_stages", 11),
        ("adaptive", "yes"),
    ],
)
def test_invalid_parameters_are_refused_by_name(name, param, value):
    with pytest.raises(ValueError, match=param):
        compressors.build(name, ratio=0.001, **{param: value})
