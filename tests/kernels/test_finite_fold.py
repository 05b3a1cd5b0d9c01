"""The NaN/Inf check folded into a compressor's first read (Session + ctx.check_finite).

Without error feedback nothing is written before the compressor runs, so compressors whose
native path starts with a full statistics or selection pass over acc find non-finite values
there and the Session skips its own read pass. The error must be the Session's (naming the
gradient and NaN or Inf), nothing may change (the worker's random stream is put back), and
a finite gradient must give exactly what the unfolded path gives."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import Session, drive, session
from compressors.kernels import ops

needs_native = pytest.mark.skipif(not ops.available(),
                                  reason=f"native kernels unavailable: {ops.error()}")

FOLDING = ["hard_threshold", "gaussianksgd", "redsync", "mstopk", "sidco_e", "sidco_gp",
           "sidco_p", "dgc", "dragonn"]
# 70_001: several native blocks (one thread) and a ragged tail after the last group of 16.
N = 70_001
POSITIONS = [0, 15, 16, 40_000, N - 1]
# Large enough for the kernels to split the work over two threads: the flags of every
# thread's part must reach the result.
N_THREADED = 4 * ops.MIN_PER_THREAD + 5


def _grad(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g, dtype=torch.float64).mul_(1e-3).to(dtype)


def _build(name: str):
    params = {"ratio": 0.01} if "ratio" in compressors.default_params(name) else {}
    return compressors.build(name, **params)


def _run(sess: Session, grad: torch.Tensor, step: int = 0):
    return drive([sess.exchange("w", grad, step)])[0]


def _count_checks(monkeypatch) -> list[int]:
    calls = []
    real = session.all_finite

    def counting(t):
        calls.append(t.numel())
        return real(t)

    monkeypatch.setattr(session, "all_finite", counting)
    return calls


@needs_native
@pytest.mark.parametrize("name", FOLDING)
def test_compressors_declare_the_fold_on_native_tensors_only(name):
    c = _build(name)
    assert c.folds_finite_check(_grad())
    assert not c.folds_finite_check(torch.randn(10, dtype=torch.float16))  # no native path
    assert not compressors.build("topk").folds_finite_check(_grad())  # no checking pass


@needs_native
@pytest.mark.parametrize("name", FOLDING)
def test_finite_gradient_same_result_without_the_separate_pass(name, monkeypatch):
    grad = _grad(1)
    folded = Session(_build(name), feedback="none", seed=3)
    checked = Session(_build(name), feedback="none", seed=3, check_finite=False)
    calls = _count_checks(monkeypatch)
    for step in range(3):
        a, b = _run(folded, grad, step), _run(checked, grad, step)
        assert torch.equal(a.sent.indices, b.sent.indices)
        assert torch.equal(a.aggregate, b.aggregate)
    assert calls == []  # the Session never read the gradient for the check
    # With error feedback (compensate writes first) the Session checks, once per step.
    ef = Session(_build(name), feedback="residual", seed=3)
    _run(ef, grad)
    assert calls == [N]


@needs_native
@pytest.mark.parametrize("name", FOLDING)
@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "Inf"),
                                       (float("-inf"), "Inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_raises_the_sessions_error_and_changes_nothing(name, bad, word, dtype):
    sess = Session(_build(name), feedback="none", seed=5)
    _run(sess, _grad(2, dtype))  # a first step: the state and the stream are in use
    state = {k: v for k, v in sess.state("w")["compressor"].items()}
    for pos in POSITIONS:
        grad = _grad(3, dtype)
        grad[pos] = bad
        before = sess.generator(grad.device).get_state()
        with pytest.raises(FloatingPointError, match=rf"gradient 'w' contains {word}"):
            _run(sess, grad, 1)
        assert torch.equal(sess.generator(grad.device).get_state(), before), pos
        assert sess.state("w")["compressor"].keys() == state.keys()
    # The worker goes on exactly as one that never saw the bad gradients.
    twin = Session(_build(name), feedback="none", seed=5)
    _run(twin, _grad(2, dtype))
    a, b = _run(sess, _grad(4, dtype), 1), _run(twin, _grad(4, dtype), 1)
    assert torch.equal(a.sent.indices, b.sent.indices)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float64_sum_overflow_is_not_mistaken_for_inf(dtype):
    # float64 magnitudes whose sum overflows: every element finite, so no error (the
    # folded check confirms a non-finite float64 sum with a real check pass).
    # (float32 magnitudes near their maximum: a float64 sum of them never overflows)
    grad = _grad(7, torch.float64).mul_(1e308 if dtype == torch.float64 else 1e40).to(dtype)
    assert torch.isfinite(grad).all()
    overflows = not torch.isfinite(grad.abs().sum(dtype=torch.float64))
    assert overflows == (dtype == torch.float64)
    out = _run(Session(compressors.build("sidco_e", ratio=0.01), feedback="none"), grad)
    assert out.selected > 0 and torch.isfinite(out.aggregate).all()


@needs_native
@pytest.mark.parametrize("name", FOLDING)
def test_a_failed_first_step_leaves_no_state(name):
    sess = Session(_build(name), feedback="none", seed=5)
    grad = _grad(8)
    grad[N // 2] = float("nan")
    with pytest.raises(FloatingPointError, match="contains NaN"):
        _run(sess, grad)
    assert sess.states == {}
    # the state a later good step creates is the one a fresh worker creates
    twin = Session(_build(name), feedback="none", seed=5)
    a, b = _run(sess, _grad(9)), _run(twin, _grad(9))
    assert torch.equal(a.sent.indices, b.sent.indices)
    assert sess.states.keys() == twin.states.keys()
    assert sess.states["w"]["compressor"].keys() == twin.states["w"]["compressor"].keys()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_check_finite_on_two_threads(dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(N_THREADED, generator=g, dtype=torch.float64).to(dtype)
        t = 3.0
        assert torch.equal(ops.select(x, t, check_finite=True)[0],
                           (x.abs() >= t).nonzero().view(-1))
        # positions in the second thread's part only (and its last element)
        for pos in (N_THREADED // 2 + 1, 3 * N_THREADED // 4, N_THREADED - 1):
            y = x.clone()
            y[pos] = float("nan")
            with pytest.raises(ops.NonFinite):
                ops.select(y, t, check_finite=True)
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strict", [False, True])
def test_select_check_finite_finds_every_position(dtype, strict):
    x = _grad(6, dtype)
    t = float(x.abs().kthvalue(N - 100).values)
    ref = ops.select(x, t, strict=strict, values=True)
    got = ops.select(x, t, strict=strict, values=True, check_finite=True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for pos in POSITIONS + [N - 2, N - 17]:
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[pos] = bad
            with pytest.raises(ops.NonFinite):
                ops.select(y, t, strict=strict, check_finite=True)
            # without the flag the same call is a plain selection (NaN never passes)
            idx, _ = ops.select(y, t, strict=strict)
            want = (y.abs() > t if strict else y.abs() >= t).nonzero().view(-1)
            assert torch.equal(idx, want)
