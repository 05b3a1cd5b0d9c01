"""Property tests of the SIDCo family (compressors/sidco.py): estimation quality k̂/k after
stage adaptation on the distribution each fit models, on gradients with many exact zeros
and on an LSTM-shaped gradient with an embedding, the direction of stage adaptation, the
schedule (stage 1 on the nonzeros, later ratios from the pools' sizes), the stage
thresholds against an independent float64 reference built on scipy's quantiles, the
native path against the reference path, degenerate inputs, scale and dtype invariance,
and parameter validation."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from scipy import special, stats

import compressors
from compressors import SimulatedGroup, sidco
from compressors.kernels import ops, sidco_pipeline
from compressors.sidco import (
    default_initial_stages,
    default_max_stages,
    later_stage_log,
    stage_ratios,
)
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


def zero_heavy(kind: str, zeros: float, size: int = 100_000, workers: int = 4,
               steps: int = 20, seed: int = 0):
    """Per-step gradient lists of a synthetic source whose coordinates at a fixed set of
    round(zeros·size) positions (drawn once) are exact zeros on every worker and step,
    as embedding rows no batch touches are. The draws are the module's cached stream's
    (one per kind for both ratios and both fractions of zeros), zeroed in copies."""
    g = torch.Generator().manual_seed(seed + 17)
    positions = torch.randperm(size, generator=g)[:round(zeros * size)]
    for step_grads in stream(kind, size, workers, steps, seed):
        yield [x.clone().index_fill_(0, positions, 0.0) for x in step_grads]


def mean_quality(name: str, grads, ratio: float, workers: int = 4) -> tuple[float, list]:
    """Mean k̂/k over workers and steps of a simulated group with the compressor's own
    error feedback (repro measure's k_ratio_mean), and every step's k̂/k."""
    group = SimulatedGroup(compressors.build(name, ratio=ratio), workers, seed=0)
    quality = []
    for step_grads in grads:
        quality += [o.selected / o.target for o in group.step(step_grads)]
    return sum(quality) / len(quality), quality


@pytest.mark.parametrize("zeros", [0.9, 0.99])
@pytest.mark.parametrize("ratio", [0.01, 0.001])
@pytest.mark.parametrize("name", VARIANTS)
def test_quality_on_gradients_with_many_exact_zeros(name, ratio, zeros):
    """90% and 99% of the coordinates exact zeros (fixed positions), the rest the family
    each variant models, 4 workers with error feedback: the zeros are left out of stage
    1's fit and every later stage fits at the ratio its pool's real size asks for, so the
    mean k̂/k over 20 steps stays within [0.8, 1.25] (with the fixed schedule
    (δ/δ₁)^(1/(M−1)) it is 0.03–0.61 here). At 99% zeros and δ = 0.01 there are as many
    nonzeros as k: every one of them is kept."""
    mean, quality = mean_quality(name, zero_heavy(MODELLED[name], zeros), ratio)
    assert 0.8 <= mean <= 1.25, f"{name} δ={ratio} zeros={zeros}: mean k̂/k {mean:.3f}"
    assert min(quality) >= 0.5, quality


VOCAB, EMBED, HIDDEN, PROJECTION, TOKENS = 10_000, 24, 32, 200, 400


def lstm_gradients(step: int, workers: int, seed: int = 0) -> list[torch.Tensor]:
    """One step's gradients of a small LSTM language model, per worker, as one flat
    tensor (one DDP bucket, 254,024 elements): its embedding (VOCAB × EMBED), whose rows
    are nonzero only for the tokens of the worker's batch (TOKENS drawn Zipf-like, about
    200 distinct: 98% of the rows zero), then the dense LSTM weights (input EMBED,
    hidden HIDDEN) and the dense decoder (HIDDEN → PROJECTION, its bias), each at its
    own scale."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    rank = torch.arange(1, VOCAB + 1, dtype=torch.float64)
    cdf = torch.cumsum(rank ** -1.1, 0)
    cdf /= cdf[-1].clone()
    lstm = 4 * HIDDEN * (EMBED + HIDDEN) + 8 * HIDDEN
    decoder = HIDDEN * PROJECTION + PROJECTION
    out = []
    for _ in range(workers):
        tokens = torch.searchsorted(cdf, torch.rand(TOKENS, generator=g, dtype=torch.float64))
        tokens = tokens.clamp_(max=VOCAB - 1)
        embedding = torch.zeros(VOCAB, EMBED)
        embedding.index_add_(0, tokens, torch.randn(TOKENS, EMBED, generator=g) * 1e-3)
        u = torch.rand(lstm + decoder, generator=g) - 0.5
        dense = -u.sign() * torch.log1p(-2 * u.abs())  # Laplace
        dense[:lstm] *= 0.5e-3
        dense[lstm:] *= 2e-3
        out.append(torch.cat([embedding.view(-1), dense]))
    return out


@pytest.mark.parametrize("ratio", [0.01, 0.001])
@pytest.mark.parametrize("name", VARIANTS)
def test_quality_on_an_lstm_gradient_with_an_embedding(name, ratio):
    """An LSTM language model's gradient exchanged as one flat tensor (lstm_gradients:
    93% exact zeros at the first step, fewer as error feedback keeps the rows touched
    earlier), 4 workers: the mean k̂/k over 20 steps stays within [0.8, 1.25] (with the
    fixed schedule (δ/δ₁)^(1/(M−1)) it is 0.42–0.65 here)."""
    first = lstm_gradients(0, 4)[0]
    assert first.numel() == 254_024 and 0.92 < float((first == 0).float().mean()) < 0.93
    grads = (lstm_gradients(step, 4) for step in range(20))
    mean, quality = mean_quality(name, grads, ratio)
    assert 0.8 <= mean <= 1.25, f"{name} δ={ratio}: mean k̂/k {mean:.3f}"
    assert min(quality) >= 0.5, quality


@pytest.mark.skipif(not ops.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("name", VARIANTS)
def test_native_and_reference_paths_select_the_same_on_zero_heavy_tensors(name, monkeypatch):
    """The fused native stages (sidco_pipeline.select_host) and the pure-torch reference
    (select_reference) select exactly the same positions at every stage count on tensors
    with 0–99.9% exact zeros, on each family and on a tensor with two clusters of
    magnitudes (where later stages stop: a pool holding no more than k); the thresholds
    agree to rounding."""
    stops = []
    real = sidco.later_stage_log

    def spy(pool, wanted, left):
        found = real(pool, wanted, left)
        stops.append(found is None and pool > 0)
        return found

    monkeypatch.setattr(sidco, "later_stage_log", spy)
    rng = np.random.default_rng(11)
    tensors = []
    for kind, zeros in (("exp", 0.5), ("gp", 0.9), ("gamma", 0.99), ("exp", 0.999)):
        x = signed_sample(kind, 200_003, seed=int(zeros * 1000))
        x[rng.random(x.size) < zeros] = 0.0
        tensors.append(torch.from_numpy(x))
    clusters = torch.zeros(200_003)
    clusters[:190_000] = torch.rand(190_000, generator=torch.Generator().manual_seed(3)) * 1e-3
    clusters[190_000:199_853] = 1.0  # the pool after stage 1: 10,003 elements, of which
    clusters[199_853:] = 2.0  # fewer than k = 200 above a threshold between 1 and 2
    tensors.append(clusters)
    c = compressors.build(name, ratio=0.001)
    for x in tensors:
        k = max(1, int(0.001 * x.numel()))
        for stages in (1, 2, 3, 5, 10):
            got, threshold, _ = sidco_pipeline.select_host(x, k, stages, c, {})
            want, ref_threshold = c.select_reference(x, stages)
            assert torch.equal(got.indices.long(), want), (name, stages)
            assert torch.equal(got.values, x[want])
            assert threshold == pytest.approx(ref_threshold, rel=1e-12)
    assert any(stops)


def test_later_stages_make_up_for_a_mismatched_fit():
    """The exponential fit on log-normal tails puts one stage's threshold far too low (k̂
    ≈ 20k); each later stage fits at the ratio its pool's real size asks for, so a stage
    that kept too many is made up for by the next: k̂/k moves towards 1 as stages are
    added, and with adaptation it stays near 1."""
    grads = stream("lognormal", 100_000, 1, 30)
    by_stages = {}
    for m in (1, 2, 3, 5, 10):
        quality, _ = run("sidco_e", grads[:4], "none", ratio=0.001, initial_stages=m,
                         adaptive=False)
        by_stages[m] = sum(quality) / len(quality)
    assert by_stages[1] > 10 and by_stages[2] > 2, by_stages
    for m in (3, 5, 10):
        assert 0.7 <= by_stages[m] <= 1.3, by_stages
    quality, _ = run("sidco_e", grads, "none", ratio=0.001)
    assert 0.7 <= sum(quality[-10:]) / 10 <= 1.3, quality


# --- stage adaptation -----------------------------------------------------------------


def stage_trace(initial: int, steps: int = 24, interval: int = 2, **params):
    grads = stream("normal", 100_000, 1, steps)
    quality, outs = run("sidco_e", grads, "none", ratio=0.001, initial_stages=initial,
                        adapt_interval=interval, **params)
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
    """Ten exponential stages on half-normal magnitudes over-select a little (the later
    stages' mean excess overstates the light tail's); with a tight ε_H the windows above
    1 + ε_H remove stages, one at a time, until k̂/k is in the band."""
    quality, stages = stage_trace(initial=10, eps_high=0.05)
    assert stages[0] == 10 and quality[0] > 1.05
    assert all(b <= a for a, b in zip(stages, stages[1:])), stages
    assert stages[-1] < 9
    assert 0.8 <= sum(quality[-4:]) / 4 <= 1.1, (quality, stages)


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


# --- the paper's single-stage start-up (initial_stages=1) --------------------------------


def adapted(compressor, stages: int, windows, state=None):
    """The stage count after each window's mean k̂/k, through _adapt (adapt_interval=1)."""
    state = {"stages": stages} if state is None else state
    out = []
    for quality in windows:
        compressor._adapt(state, quality)
        out.append(state["stages"])
    return out, state


def test_single_stage_start_up_adds_stages_where_the_printed_rule_deadlocks():
    """Adapt_Stages as printed removes a stage above 1 + ε_H, so an over-selecting single
    stage stays at M = max(0, 1) = 1 for good. Started at one stage, over-selection at
    the floor adds a stage and raises the floor; the other moves are the printed ones."""
    printed = compressors.build("sidco_e", ratio=0.001, adapt_interval=1)
    assert printed.initial_stages == 5
    assert adapted(printed, 1, [3.0, 3.0, 3.0])[0] == [1, 1, 1]  # the deadlock
    assert adapted(printed, 5, [3.0, 0.5, 1.0])[0] == [4, 5, 5]
    start = compressors.build("sidco_e", ratio=0.001, adapt_interval=1, initial_stages=1)
    stages, state = adapted(start, 1, [3.0, 2.0, 1.0, 0.5, 1.5, 1.5, 1.0])
    # over → 2, over → 3 (floor 3), in band, under → 4 (printed), over above the floor
    # → 3 (printed), over at the floor → 4 (floor 4), in band
    assert stages == [2, 3, 3, 4, 3, 4, 4] and state["floor"] == 4
    # at max_stages the count stays (clamped), with the floor there
    top = compressors.build("sidco_e", ratio=0.001, adapt_interval=1, initial_stages=1,
                            max_stages=2)
    stages, state = adapted(top, 1, [3.0, 3.0, 3.0])
    assert stages == [2, 2, 2] and state["floor"] == 2


@pytest.mark.parametrize("name", ["sidco_e", "sidco_p"])
def test_single_stage_start_up_over_sends_then_settles(name):
    """Student-t magnitudes (tails heavier than the first fit's), 2 workers, δ = 0.001:
    one stage sends several times k (the paper's start-up over-sending), the stages
    added while the windows over-select bring the mean k̂/k of the last 10 steps into
    the ε band [0.8, 1.2], and M never returns to 1."""
    grads = stream("student-t", 100_000, 2, 30)  # (shared with the quality tests)
    quality, outs = run(name, grads, "none", ratio=0.001, initial_stages=1)
    stages = [o.extra["stages"] for o in outs]
    assert stages[:5] == [1] * 5 and sum(quality[:5]) / 5 > 2.0, quality[:5]
    assert min(stages[5:]) >= 2, stages
    mean = sum(quality[-10:]) / 10
    assert 0.8 <= mean <= 1.2, (mean, stages)
    # the default start over-sends far less at first
    default, _ = run(name, grads[:5], "none", ratio=0.001)
    assert sum(default) < 0.5 * sum(quality[:5]), (default, quality[:5])


@pytest.mark.parametrize("name", VARIANTS)
def test_single_stage_start_up_keeps_the_error_feedback_invariant(name):
    """acc == sent + residual on every worker and step while the start-up moves M."""
    d, workers = 100_000, 2
    grads = stream("student-t", d, workers, 30)[:12]
    compressor = compressors.build(name, ratio=0.001, initial_stages=1, adapt_interval=2)
    group = SimulatedGroup(compressor, workers, feedback="residual", seed=0)
    stages = set()
    for step, step_grads in enumerate(grads):
        accs = [g.clone() if step == 0 else s.residual("grad").clone() + g
                for s, g in zip(group.sessions, step_grads)]
        outs = group.step([g.clone() for g in step_grads], name="grad")
        for o, s, acc in zip(outs, group.sessions, accs):
            assert torch.equal(o.sent.dense(d) + s.residual("grad"), acc)
            stages.add(o.extra["stages"])
    assert 1 in stages and len(stages) > 1, stages


@pytest.mark.parametrize("value, match", [
    (0, r"initial_stages=0 must be an integer ≥ 1.*1: the paper's single-stage start-up"),
    (1.5, r"initial_stages=1\.5 must be an integer ≥ 1"),
    (True, r"initial_stages=True must be an integer ≥ 1"),
    ("1", r"initial_stages='1' must be an integer ≥ 1"),
    (11, r"initial_stages=11 exceeds max_stages=10"),
])
def test_bad_initial_stages_are_refused_with_the_reason(value, match):
    with pytest.raises(ValueError, match=match):
        compressors.build("sidco_gp", ratio=0.001, initial_stages=value)


def test_stage_schedule():
    """Stage 1 wants ρ = δ·d/n₀ of the nonzeros: exactly δ without zeros; one stage at ρ
    when M = 1 or ρ ≥ δ₁, else δ₁; every nonzero when ρ ≥ 1. A later stage with a pool
    of p wants (δ·d/p)^(1/stages left), and stops the stages when p ≤ δ·d: on a pool of
    δ₁·d (a first fit that is right, no zeros) that is the paper's (δ/δ₁)^(1/(M−1)),
    whose product over the stages is δ (what the device's buffers are sized for)."""
    e = compressors.build("sidco_e", ratio=0.001)
    d = 1_000_000
    for m in (2, 5, 10):
        assert e.first_stage(d, d, m) == (0.25, -math.log(0.25), False)
    assert e.first_stage(d, d, 1) == (0.001, -math.log(0.001), True)
    assert e.first_stage(d, d // 10, 5) == (0.25, -math.log(0.25), False)  # ρ = 0.01
    assert e.first_stage(d, d // 100, 5) == (0.25, -math.log(0.25), False)  # ρ = 0.1
    single = e.first_stage(d, 2500, 5)  # ρ = 0.4 ≥ δ₁: one stage at ρ
    assert single.single and single.ratio == pytest.approx(0.4, rel=1e-15)
    assert single.tail_log == -math.log(single.ratio)
    assert e.first_stage(d, 4000, 5).single  # ρ = δ₁
    assert e.first_stage(d, d // 1000, 5) is None  # ρ = 1: every nonzero
    assert e.first_stage(d, 999, 1) is None
    assert later_stage_log(100, 1000.0, 3) is None and later_stage_log(1000, 1000.0, 1) is None
    assert later_stage_log(0, 0.5, 2) is None
    assert math.exp(-later_stage_log(4000, 1000.0, 1)) == pytest.approx(0.25)
    assert math.exp(-later_stage_log(64_000, 1000.0, 3)) == pytest.approx(0.25)
    for ratio in RATIOS + [0.0003]:
        for m in range(2, 8):
            nominal = stage_ratios(ratio, 0.25, m)
            if ratio < 0.25:
                later = math.exp(-later_stage_log(round(0.25 * d), ratio * d, m - 1))
                assert later == pytest.approx(nominal[1], rel=1e-9)
            assert math.isclose(math.prod(nominal), ratio, rel_tol=1e-12)
            assert len(nominal) == (m if ratio < 0.25 else 1)
    assert stage_ratios(0.3, 0.25, 5) == [0.3]  # δ ≥ δ₁: one stage
    assert [default_initial_stages(r, 0.25) for r in (0.5, 0.1, 0.01, 0.001)] == [1, 2, 4, 5]
    assert [default_max_stages(r) for r in (0.5, 0.1, 0.01, 0.001)] == [1, 4, 7, 10]
    c = compressors.build("sidco_e", ratio=0.001)
    assert (c.initial_stages, c.max_stages, c.first_stage_ratio) == (5, 10, 0.25)
    assert c.adapt_interval == 5
    assert (c.adaptive, c.eps_high, c.eps_low) == (True, 0.2, 0.2)


# --- thresholds against an independent reference --------------------------------------


def reference_threshold(values: np.ndarray, name: str, ratio: float, stages: int,
                        first_ratio: float = 0.25) -> float:
    """Algorithm 1 with the schedule of compressors/sidco.py in float64 numpy: stage 1 on
    the nonzeros at ρ = δ·d/n₀ (one stage when M = 1 or ρ ≥ δ₁, else δ₁), stage m on the
    exceedances at (δ·d/p)^(1/(M − m + 1)) until the pool holds no more than δ·d; each
    stage's quantile from scipy.stats with the paper's estimators (exponential MLE, GP
    moment matching with σ², Minka's gamma)."""
    a = np.abs(values.astype(np.float64))
    nonzero = a[a > 0]
    wanted = ratio * a.size
    rho = wanted / nonzero.size
    if rho >= 1:
        return float(nonzero.min())
    single = stages == 1 or rho >= first_ratio

    def fit(kind: str, pool: np.ndarray, t: float, r: float) -> float:
        y = pool - t
        if kind == "exp":
            return t + stats.expon.ppf(1 - r, scale=y.mean())
        if kind == "gp":
            q = y.mean() ** 2 / y.var()
            return t + stats.genpareto.ppf(1 - r, c=0.5 * (1 - q), scale=0.5 * y.mean() * (q + 1))
        s = np.log(y.mean()) - np.log(y).mean()
        shape = (3 - s + np.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
        return stats.gamma.ppf(1 - r, a=shape, scale=y.mean() / shape)

    first = {"sidco_e": "exp", "sidco_gp": "gp", "sidco_p": "gamma"}[name]
    later = "exp" if name == "sidco_e" else "gp"
    t = fit(first, nonzero, 0.0, rho if single else first_ratio)
    pool = nonzero
    for m in range(2, 1 if single else stages + 1):
        pool = pool[pool > t]
        if pool.size <= wanted:
            break
        t = fit(later, pool, t, (wanted / pool.size) ** (1 / (stages - m + 1)))
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


@pytest.mark.parametrize("name", VARIANTS)
def test_a_ratio_at_or_above_the_first_stage_ratio_is_one_stage_at_any_stage_count(name):
    """δ ≥ δ₁: ρ ≥ δ₁ too, so one stage at ρ whatever M (and the stage count reported is
    1), with or without zeros."""
    x = signed_sample(FAMILY[name], 200_000, seed=6)
    for zeros in (0.0, 0.5):
        x[np.random.default_rng(6).random(x.size) < zeros] = 0.0
        out = one_step(single_stage(name, 0.3, stages=3), x)
        assert out.extra["stages"] == 1
        assert out.extra["threshold"] == pytest.approx(reference_threshold(x, name, 0.3, 1),
                                                       rel=1e-6)


@pytest.mark.parametrize("zeros", [0.0, 0.9])
@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("name", VARIANTS)
def test_multi_stage_threshold_matches_the_reference(name, stages, zeros):
    """Later stages fit the exceedances shifted by the previous threshold (PoT), each at
    the ratio its pool's size gives; stage 1 fits the nonzeros only. On the family's own
    sample, with or without exact zeros, the result stays near the true quantile of the
    nonzeros at δ·d/n₀ too."""
    ratio = 0.001
    x = signed_sample(FAMILY[name], 400_000, seed=2)
    x[np.random.default_rng(2).random(x.size) < zeros] = 0.0
    out = one_step(single_stage(name, ratio, stages), x)
    assert out.extra["stages"] == stages
    expected = reference_threshold(x, name, ratio, stages)
    assert out.extra["threshold"] == pytest.approx(expected, rel=1e-6)
    among_nonzeros = ratio * x.size / np.count_nonzero(x)
    assert out.extra["threshold"] == pytest.approx(
        TRUE_QUANTILE[FAMILY[name]](among_nonzeros), rel=0.1)
    assert 0.8 <= out.selected / out.target <= 1.25


@pytest.mark.parametrize("name", VARIANTS)
def test_first_fit_leaves_exact_zeros_out(name):
    """Every first fit runs on the nonzeros only (exact zeros would drag its scale down):
    with half the entries exactly zero, one stage is the fitted quantile of the nonzeros
    at ρ = δ·d/n₀, and k̂/k stays near 1 instead of collapsing."""
    x = signed_sample(FAMILY[name], 400_000, seed=3)
    x[::2] = 0.0
    nz = np.abs(x[x != 0]).astype(np.float64)
    for ratio in (0.01, 0.001):
        out = one_step(single_stage(name, ratio), x)
        assert 0.85 <= out.selected / out.target <= 1.15
        rho = ratio * x.size / nz.size
        if name == "sidco_e":
            expected = nz.mean() * -math.log(rho)
        elif name == "sidco_gp":
            q = nz.mean() ** 2 / nz.var()
            expected = stats.genpareto.ppf(1 - rho, c=0.5 * (1 - q),
                                           scale=0.5 * nz.mean() * (q + 1))
        else:
            s = np.log(nz.mean()) - np.log(nz).mean()
            shape = (3 - s + np.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
            expected = nz.mean() / shape * special.gammainccinv(shape, rho)
        assert out.extra["threshold"] == pytest.approx(expected, rel=1e-6)
        assert expected == pytest.approx(reference_threshold(x, name, ratio, 1), rel=1e-6)


# --- degenerate inputs, scale and dtype -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["zeros", "constant", "one"])
@pytest.mark.parametrize("name", VARIANTS)
def test_degenerate_inputs_give_finite_consistent_results(name, kind, dtype):
    """No NaN; the aggregate is the mean of what the workers sent; acc == sent + residual.
    A constant tensor is a point mass: a threshold keeps all ties or none (the GP and
    gamma fits' limit is the point itself, so they keep all; the exponential's quantile
    lies above it, so it keeps none). One value (fewer than 1/δ) is sent whatever the
    fit says. Zeros are never sent."""
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
                assert o.selected == (d if name != "sidco_e" or kind == "one" else 0)


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


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
def test_tensor_too_small_for_the_fit_still_sends_and_its_residual_stays_bounded(name):
    """16 values at δ = 0.01 (fewer than 1/δ): the fitted threshold lies above the largest
    value in most steps, so the fit selects nothing; the largest goes instead, and the residual (the gap between
    what was averaged and what was sent, summed over steps) stops growing although
    every gradient has the same positive drift."""
    group = compressors.SimulatedGroup(compressors.build(name, ratio=0.01), world_size=2,
                                       feedback="residual")
    gen = torch.Generator().manual_seed(0)
    gap, norms = torch.zeros(16), {}
    for step in range(400):
        grads = [torch.randn(16, generator=gen) + 0.5 for _ in range(2)]
        out = group.step(grads)
        assert out[0].selected >= 1
        gap += (grads[0] + grads[1]) / 2 - out[0].aggregate
        norms[step] = float(gap.norm())
    # nothing sent: the gap grows by about 0.5·4 = 2 per step (800 after 400 steps)
    assert norms[399] < 20 and norms[399] < 2 * max(norms[99], 1.0)
