"""Property-based fuzzing of every registered compressor and of the training config's
validation: odd shapes, dtypes, extreme values and parameters at their bounds either work
or are refused with one of the documented exceptions, whose message names the input and
what is allowed; nothing else escapes.

Documented refusals: TypeError (a wrong type: an integer gradient, a non-number
parameter), ValueError (a value out of range, an empty tensor, an impossible config),
FloatingPointError (a NaN or an Inf in a gradient), KeyError (an unknown compressor),
FileNotFoundError (a missing data path).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compressors
from compressors import SimulatedGroup

NAMES = compressors.list_compressors()
DOCUMENTED = (TypeError, ValueError, FloatingPointError, KeyError, FileNotFoundError)
# Examples per property and compressor (hypothesis draws this many; the heavy lane and
# anyone hunting set GRADCOMP_FUZZ_EXAMPLES higher).
EXAMPLES = int(os.environ.get("GRADCOMP_FUZZ_EXAMPLES", "25"))

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SPECIALS = {
    "zeros": lambda n: torch.zeros(n),
    "constant": lambda n: torch.full((n,), 0.37),
    "denormal": lambda n: torch.full((n,), 1e-41) * torch.randn(n).sign(),
    "huge": lambda n: torch.randn(n) * 1e37,
    "tiny": lambda n: torch.randn(n) * 1e-30,
    "mixed": lambda n: torch.randn(n) * torch.logspace(-20, 20, n),
    "normal": lambda n: torch.randn(n),
    "nan": lambda n: torch.randn(n).index_fill_(0, torch.tensor([n // 2]), math.nan),
    "inf": lambda n: torch.randn(n).index_fill_(0, torch.tensor([0]), math.inf),
    "-inf": lambda n: torch.randn(n).index_fill_(0, torch.tensor([n - 1]), -math.inf),
}
SHAPES = [(), (1,), (2,), (3,), (7,), (5, 3), (1, 1, 1), (257,), (64, 33), (4097,)]


def _message_names_the_problem(exc: BaseException) -> bool:
    """A refusal's message says something specific (not an empty or bare message)."""
    text = str(exc)
    return len(text) > 20


def _ratio_params(name: str, ratio: float) -> dict:
    return {"ratio": ratio} if "ratio" in compressors.default_params(name) else {}


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from(FLOAT_DTYPES),
       kind=st.sampled_from(sorted(SPECIALS)), workers=st.integers(1, 4),
       ratio=st.sampled_from([1e-9, 1e-4, 0.01, 0.5, 1.0]),
       feedback=st.sampled_from(["default", "none", "residual"]), seed=st.integers(0, 3))
def test_compressor_inputs(name, shape, dtype, kind, workers, ratio, feedback, seed):
    torch.manual_seed(seed)
    numel = math.prod(shape)
    grads = [SPECIALS[kind](max(numel, 1))[:numel].reshape(shape).to(dtype)
             for _ in range(workers)]
    # (a value beyond the dtype's range is an Inf once cast: then it is a non-finite input)
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    try:
        compressor = compressors.build(name, **_ratio_params(name, ratio))
        group = SimulatedGroup(compressor, workers, feedback=feedback, seed=seed)
        for _ in range(2):
            outs = group.step(grads)
    except DOCUMENTED as exc:
        assert _message_names_the_problem(exc), repr(exc)
        if not finite:  # a NaN/Inf gradient is refused as such, naming it
            assert isinstance(exc, FloatingPointError) and ("NaN" in str(exc)
                                                            or "Inf" in str(exc)), repr(exc)
        else:
            assert not isinstance(exc, FloatingPointError), f"{name}: {exc!r} on finite input"
        return
    assert finite, f"{name} accepted a {kind} gradient"
    for o in outs:
        assert o.aggregate.numel() == numel and o.aggregate.dtype == dtype
        assert torch.equal(o.aggregate, outs[0].aggregate)
        # finite in, finite out: no statistic may overflow on values the dtype holds
        assert bool(torch.isfinite(o.aggregate).all()), f"{name}: non-finite aggregate"


@pytest.mark.parametrize("name", NAMES)
def test_integer_and_empty_gradients_are_refused(name):
    group = SimulatedGroup(compressors.build(name), 2)
    for bad in (torch.arange(10), torch.zeros(10, dtype=torch.bool),
                torch.zeros(10, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="dtype"):
            group.step([bad, bad])
    with pytest.raises(ValueError, match="empty"):
        group.step([torch.zeros(0), torch.zeros(0)])


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=EXAMPLES, deadline=None)
@given(params=st.data())
def test_compressor_parameters(name, params):
    """Every constructor parameter, drawn around and beyond its valid range (and of the
    wrong type), builds a compressor or is refused with a documented exception."""
    defaults = compressors.default_params(name)
    chosen = {}
    for key, default in defaults.items():
        if params.draw(st.booleans(), label=f"touch {key}"):
            chosen[key] = params.draw(_around(default), label=key)
    try:
        c = compressors.build(name, **chosen)
    except DOCUMENTED as exc:
        assert _message_names_the_problem(exc), repr(exc)
        return
    out = SimulatedGroup(c, 2, seed=0).step([torch.randn(300), torch.randn(300)])
    assert out[0].aggregate.numel() == 300


def _around(default):
    if isinstance(default, bool):
        return st.one_of(st.booleans(), st.sampled_from([0, 1, "yes", None]))
    if isinstance(default, int):
        return st.one_of(st.integers(-3, 70), st.sampled_from([0, 2**40, 1.5, "8", None]))
    if isinstance(default, float):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                         st.sampled_from([0.0, 1.0, -0.5, 1e-12, 2.0, "0.1", None]))
    if isinstance(default, str):
        return st.one_of(st.just(default), st.text(max_size=6), st.sampled_from([None, 3]))
    return st.just(default)


# -- the training config, through repro train's validation -------------------------------------

KEYS = {
    "compressor.ratio": st.one_of(st.floats(-1, 2), st.sampled_from([0.0, 1.0, 1e-9])),
    "cluster.workers": st.integers(-2, 40),
    "steps": st.integers(-3, 5),
    "compressor.granularity": st.sampled_from(["default", "layer", "bucket", "model", "x"]),
    "compressor.feedback": st.sampled_from(["default", "none", "residual", "momentum", "mom"]),
    "compressor.momentum": st.one_of(st.none(), st.floats(-1, 2)),
    "compressor.local_clip": st.sampled_from(["auto", "on", "off", "maybe"]),
    "cluster.mode": st.sampled_from(["spawn", "torchrun", "simulated", "mpi"]),
    "nonfinite": st.sampled_from(["error", "skip", "off", "ignore"]),
    "cluster.timeout_s": st.floats(-5, 100),
    "task.clip": st.one_of(st.none(), st.floats(-1, 5)),
    "compressor.start_step": st.integers(-2, 3),
    "compressor.warmup_steps": st.integers(-1, 3),
    "compressor.warmup_ratio": st.floats(-1, 2),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(["topk", "dgc", "deft", "thc", "powersgd", "none"]))
def test_config_validation(data, name):
    """Random values for the keys a user types by hand: validation passes, or refuses with
    a documented exception whose message names the key."""
    from omegaconf import OmegaConf

    from repro import config as config_mod

    cfg = OmegaConf.merge(config_mod.schema(), {"compressor": {"name": name}})
    cfg.compressor.ratio = compressors.default_params(name).get("ratio")
    touched = []
    for key, strategy in KEYS.items():
        if data.draw(st.booleans(), label=f"touch {key}"):
            value = data.draw(strategy, label=key)
            if key == "compressor.ratio" and cfg.compressor.ratio is None:
                continue
            OmegaConf.update(cfg, key, value, merge=False)
            touched.append(key)
    try:
        config_mod.validate(cfg)
    except DOCUMENTED as exc:
        text = str(exc)
        assert any(k.split(".")[-1] in text for k in touched) or "compressor=" in text, text
