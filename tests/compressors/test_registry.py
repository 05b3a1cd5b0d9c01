"""Tests every registered compressor gets for free (timm's test_models pattern):
shape/dtype round trip, error-feedback invariant, determinism, bad input."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import SimulatedGroup, SparseSent

NAMES = compressors.list_compressors()
WORKERS = 3


def params_for(name: str, ratio: float = 0.05) -> dict:
    """Paper defaults, with a ratio that keeps small test tensors meaningful."""
    return {"ratio": ratio} if "ratio" in compressors.default_params(name) else {}


def grads_for(seed: int, numel: int = 4096, workers: int = WORKERS, dtype=torch.float32, shape=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(workers):
        t = torch.randn(numel, generator=g).to(dtype)
        out.append(t.view(shape) if shape else t)
    return out


def test_registry_lists_the_whole_family():
    expected = {
        "none", "fp16", "topk", "randomk", "dgc", "redsync", "gaussianksgd", "sidco_e",
        "sidco_gp", "sidco_p", "mstopk", "hard_threshold", "dragonn",
    }
    assert expected <= set(NAMES), f"missing: {sorted(expected - set(NAMES))}"
    assert compressors.list_compressors("sidco*") == ["sidco_e", "sidco_gp", "sidco_p"]


def test_registry_refuses_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        @compressors.register("topk")
        class Another(compressors.Sparsifier):
            def select(self, acc, k, ctx):
                return torch.arange(k)

    with pytest.raises(KeyError, match="unknown compressor 'topkk'.*registered"):
        compressors.build("topkk")
    with pytest.raises(TypeError, match="no parameter 'ratoi'.*accepts"):
        compressors.build("topk", ratoi=0.1)


@pytest.mark.parametrize("name", NAMES)
def test_declares_pattern_and_defaults(name):
    cls = compressors.get_class(name)
    assert isinstance(cls.pattern, compressors.Pattern)
    assert cls.default_feedback in ("none", "residual", "momentum")
    c = compressors.build(name)
    assert c.name == name
    # Every default parameter is readable back, so configs can be generated from them.
    assert set(compressors.default_params(name)) <= set(c.params())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_shape_dtype_and_agreement(name, dtype):
    group = SimulatedGroup(compressors.build(name, **params_for(name)), WORKERS, seed=1)
    grads = grads_for(0, dtype=dtype, shape=(64, 64))
    before = [g.clone() for g in grads]
    for step in range(2):
        outs = group.step(grads)
        for o in outs:
            assert o.aggregate.shape == (64 * 64,)
            assert o.aggregate.dtype == dtype
            assert torch.isfinite(o.aggregate.float()).all()
            assert torch.equal(o.aggregate, outs[0].aggregate), "workers disagree"
            assert o.bytes_sent > 0
    for g, b in zip(grads, before):
        assert torch.equal(g, b), "the caller's gradient was modified"


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_invariant(name):
    """acc == sent + residual: what was not sent is kept, nothing more, nothing less."""
    c = compressors.build(name, **params_for(name))
    group = SimulatedGroup(c, WORKERS, feedback="residual", seed=2)
    for step in range(3):
        grads = grads_for(10 + step)
        accs = []
        for sess, g in zip(group.sessions, grads):
            prev = sess.residual("grad")
            accs.append(g.clone() if prev is None else prev.clone().add_(g))
        outs = group.step(grads, name="grad")
        for sess, acc, o in zip(group.sessions, accs, outs):
            residual = sess.residual("grad")
            sent = o.sent.dense(acc.numel())
            if isinstance(o.sent, SparseSent):
                assert torch.equal(sent + residual, acc)
            else:
                assert torch.equal(residual, acc - sent)


@pytest.mark.parametrize("name", [n for n in NAMES if compressors.get_class(n).sparse])
def test_momentum_correction_masks_what_was_sent(name):
    c = compressors.build(name, **params_for(name))
    group = SimulatedGroup(c, 2, feedback="momentum", seed=3)
    for step in range(3):
        outs = group.step(grads_for(20 + step, workers=2))
    for sess, o in zip(group.sessions, outs):
        st = sess.state("grad")["feedback"]
        idx = o.sent.indices.long()
        assert torch.all(st["momentum"][idx] == 0)
        assert torch.all(st["velocity"][idx] == 0)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_under_seed(name):
    def run(seed):
        group = SimulatedGroup(compressors.build(name, **params_for(name)), WORKERS, seed=seed)
        return [group.step(grads_for(30 + s))[0].aggregate for s in range(3)]

    for a, b in zip(run(7), run(7)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n in NAMES if compressors.get_class(n).exact])
def test_exact_compressors_return_the_mean(name):
    grads = grads_for(40)
    outs = SimulatedGroup(compressors.build(name), WORKERS).step(grads)
    torch.testing.assert_close(outs[0].aggregate, sum(grads) / WORKERS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", ["nan", "inf", "empty", "int"])
def test_bad_input_is_refused_clearly(name, bad):
    g = torch.randn(100)
    if bad == "nan":
        g[3] = float("nan")
        err, msg = FloatingPointError, "contains NaN"
    elif bad == "inf":
        g[5] = float("inf")
        err, msg = FloatingPointError, "contains Inf"
    elif bad == "empty":
        g = torch.empty(0)
        err, msg = ValueError, "is empty"
    else:
        g = torch.arange(100)
        err, msg = TypeError, "floating"
    group = SimulatedGroup(compressors.build(name, **params_for(name)), 2)
    with pytest.raises(err, match=msg):
        group.step([g, g.clone()])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["zeros", "constant", "one", "noncontiguous"])
def test_degenerate_input_gives_a_correct_result(name, kind):
    if kind == "zeros":
        grads = [torch.zeros(1000), torch.zeros(1000)]
    elif kind == "constant":
        grads = [torch.full((1000,), 0.25), torch.full((1000,), 0.25)]
    elif kind == "one":
        grads = [torch.tensor([0.5]), torch.tensor([-1.5])]
    else:
        base = grads_for(50, numel=64 * 32, workers=2)
        grads = [b.view(64, 32).t() for b in base]  # non-contiguous views
        assert not grads[0].is_contiguous()
    c = compressors.build(name, **params_for(name))
    outs = SimulatedGroup(c, 2, seed=5).step(grads)
    agg = outs[0].aggregate
    assert torch.isfinite(agg).all()
    if kind == "zeros":
        assert torch.equal(agg, torch.zeros_like(agg)), "compressing zeros must give zeros"
    if kind == "noncontiguous":
        ref = SimulatedGroup(compressors.build(name, **params_for(name)), 2, seed=5).step(
            [g.contiguous() for g in grads]
        )
        assert torch.equal(agg, ref[0].aggregate)


@pytest.mark.parametrize("name", [n for n in NAMES if "ratio" in compressors.default_params(n)])
@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan")])
def test_ratio_out_of_range_is_refused(name, ratio):
    with pytest.raises(ValueError, match="ratio"):
        compressors.build(name, ratio=ratio)
