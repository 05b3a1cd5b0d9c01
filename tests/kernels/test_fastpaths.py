"""The fused kernels (compressors/kernels: ops.py picks them per tensor) select exactly
what the pure-torch reference paths select, and everything falls back cleanly without
them.

The reference path is forced with GRADCOMP_NATIVE=0 (read at every call)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import compressors
from compressors import Session, drive
from compressors.kernels import build, cpu, ops
from repro.testing import with_threads

needs_native = pytest.mark.skipif(not ops.available(),
                                  reason=f"native kernels unavailable: {ops.error()}")

SPARSIFIERS = ["hard_threshold", "gaussianksgd", "redsync", "sidco_e", "sidco_gp", "sidco_p",
               "dgc", "dragonn"]
SIZES = [1, 7, 9, 1000, 2**17 + 3, 300_001]


def _laplace(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(dtype)


def _reference(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        assert not ops.supports(torch.zeros(3))
        return fn()


# -- kernels against torch ---------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
def test_select_and_count_match_torch(n, dtype):
    x = _laplace(n, dtype, seed=n)
    mag = x.abs()
    ts = [0.0, float(mag.median()), float(mag.max()), float(mag.max()) * 2, 2.5e-3,
          float(mag[n // 2]), 1e-3 + 1e-12]  # last: rounds in float32 as torch rounds it
    for t in ts:
        for strict in (False, True):
            mask = mag > t if strict else mag >= t
            expected = mask.nonzero().view(-1)
            idx, val = ops.select(x, t, strict=strict, values=True)
            assert idx.dtype == torch.int64 and torch.equal(idx, expected), (t, strict)
            assert torch.equal(val, mag[expected])
            assert ops.count(x, t, strict=strict) == expected.numel()
            for reserve in (0, n):  # skipping groups without a hit, and branch-free
                idx, val = ops.select(x, t, strict=strict, values=True, signed=True,
                                          reserve=reserve)
                assert torch.equal(idx, expected) and torch.equal(val, x[expected])


@needs_native
def test_ties_signed_zeros_nan_and_mapped_pools():
    x = torch.tensor([0.5, -0.5, 0.25, -0.0, 0.0, float("nan"), 0.5, -1.0, 0.5, 0.75] * 5000)
    for t in (0.5, 0.0, 1.0, 2.0):
        for strict in (False, True):
            mask = x.abs() > t if strict else x.abs() >= t  # NaN compares False in both
            idx, _ = ops.select(x, t, strict=strict)
            assert torch.equal(idx, mask.nonzero().view(-1))
    pool_idx, pool = ops.select(x, 0.25, strict=True, values=True)
    idx, _ = ops.select(pool, 0.5, index_map=pool_idx)
    assert torch.equal(idx, (x.abs() >= 0.5).nonzero().view(-1))
    empty, vals = ops.select(x, 5.0, values=True)
    assert empty.numel() == 0 and vals.numel() == 0 and empty.dtype == torch.int64


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stats_match_float64_reductions(dtype):
    x = _laplace(300_001, dtype, seed=3)
    x[::7] = 0.0
    a = x.abs().double()
    st = ops.stats(x, squares=True, extremes=True, logs=True)
    assert st.count == x.numel() and st.nonzero == int((a > 0).sum())
    assert st.sum == pytest.approx(float(a.sum()), rel=1e-13)
    assert st.sumsq == pytest.approx(float((a * a).sum()), rel=1e-13)
    assert st.max == float(a.max()) and st.min == 0.0
    assert st.log_sum == pytest.approx(float(a[a > 0].log().sum()), rel=1e-12)
    t = float(a.median())
    above = ops.stats(x, above=t, shift=t, squares=True, extremes=True)
    sel = a[x.abs() > t].double()
    assert above.count == sel.numel() and above.min == float(sel.min())
    assert above.sum == pytest.approx(float((sel - t).sum()), rel=1e-12)
    assert above.sumsq == pytest.approx(float(((sel - t) ** 2).sum()), rel=1e-12)
    # Fixed blocks: the result does not depend on the thread count.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.stats(x, squares=True)
    finally:
        torch.set_num_threads(before)
    assert (one.sum, one.sumsq) == (ops.stats(x, squares=True).sum,
                                    ops.stats(x, squares=True).sumsq)


@needs_native
def test_float32_log_sum_from_the_bits_at_the_edges_of_the_range():
    """float32's Σ ln|x| is taken from the float bits (exponent fields added, mantissas
    multiplied); blocks with infinities or NaNs take the widening loop, and so do blocks
    with subnormals in the AVX2 loop (AVX-512's getexp and getmant take them). Every
    block (32768 elements), each kind of tail, and the speculative read's nonzero count
    agree with float64 sums of logs."""
    block = 2**15
    x = _laplace(4 * block + 21, torch.float32, seed=9)
    x[block:2 * block:5] = 0.0                                   # zeros: add nothing
    x[2 * block + 100] = 1e-40                                   # a subnormal in block 2
    x[2 * block + 101] = -torch.finfo(torch.float32).tiny        # smallest normal
    x[3 * block:4 * block] = torch.tensor(1.9999999, dtype=torch.float32) * 2.0**100
    x[3 * block + 7] = torch.finfo(torch.float32).max            # largest finite
    x[-3:] = torch.tensor([3e-39, 0.0, -7.5])                    # a subnormal in the tail
    a = x.abs().double()
    for lo, hi in ((0, x.numel()), (0, block), (block, 2 * block), (2 * block, 3 * block),
                   (3 * block, 4 * block), (4 * block, x.numel()), (5, 37)):
        part, ref = x[lo:hi], a[lo:hi]
        st = ops.stats(part, logs=True)
        assert st.log_sum == pytest.approx(float(ref[ref > 0].log().sum()), rel=1e-12), (lo, hi)
        assert st.nonzero == int((ref > 0).sum())
        first, *_ = cpu.sidco_spec(part, 1.0, 2.0, 3.0, logs=True)
        assert (first.nonzero, first.log_sum) == (st.nonzero, st.log_sum)
    y = x.clone()
    y[block + 3] = float("nan")  # that block is summed wide, the NaN left out (not > 0)
    r = y.abs().double()
    assert ops.stats(y, logs=True).log_sum == pytest.approx(
        float(r[r > 0].log().sum()), rel=1e-12)
    y[block + 3] = float("inf")  # ln ∞ = ∞, from the widening loop as well
    st = ops.stats(y, logs=True)
    assert st.log_sum == math.inf and st.nonzero == int((y != 0).sum())


# -- compressors: native path == reference path ------------------------------------------

def _run(name: str, grads: list[torch.Tensor], ratio: float) -> list:
    session = Session(compressors.build(name, ratio=ratio), world_size=1, feedback="none",
                      seed=11, measure=False)
    return [drive([session.exchange("g", g, step)])[0] for step, g in enumerate(grads)]


def _inputs(kind: str, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    if kind == "laplace":
        return [_laplace(n, dtype, seed=s) for s in range(6)]
    if kind == "ties":  # few distinct magnitudes: many elements sit exactly at thresholds
        g = torch.Generator().manual_seed(5)
        return [(torch.randint(-8, 9, (n,), generator=g).to(dtype) * 2.5e-4) for _ in range(3)]
    if kind == "zeros":
        return [torch.zeros(n, dtype=dtype)]
    if kind == "sparse":  # mostly zeros, a few nonzeros
        x = torch.zeros(n, dtype=dtype)
        x[:: max(1, n // 50)] = _laplace(len(range(0, n, max(1, n // 50))), dtype)
        return [x]
    raise AssertionError(kind)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, d", [(1, 1), (1, 2), (3, 4), (2, 8), (1, 16), (4, 1 << 10),
                                     (1, 1 << 15), (3, 1 << 17), (1, 1 << 20)])
def test_native_fwht_equals_the_torch_butterflies(monkeypatch, dtype, rows, d):
    from compressors.kernels.ops import fwht_
    g = torch.Generator().manual_seed(d + rows)
    x = torch.randn(rows, d, generator=g, dtype=torch.float64).to(dtype).squeeze(0)
    for normalize in (False, True):
        expected = _reference(monkeypatch, lambda n=normalize: fwht_(x.clone(), normalize=n))
        got = fwht_(x.clone(), normalize=normalize)
        # Same butterflies (a + b, (a + b) − 2b) in the same stage order: the same bits.
        assert torch.equal(got, expected), (normalize, (got - expected).abs().max())
    y = cpu.fwht_(x.clone())  # a transform twice is d times the identity
    torch.testing.assert_close(cpu.fwht_(y) / d, x, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("n", [1, 1000, 3 << 18])
def test_native_thc_encoding_equals_the_torch_path(monkeypatch, n):
    from compressors.thc import RotatedGrid
    from compressors.thc_table import get_table
    table = torch.tensor(get_table(4, 30, 1 / 32), dtype=torch.float32)
    x = _laplace(n, torch.float32, seed=n) * 50  # some coordinates clamp
    norm = float(x.norm())

    def encode():
        grid = RotatedGrid.make(n, norm, 1 / 32, 30, seed=7, device="cpu")
        gen = torch.Generator().manual_seed(3)
        return grid.encode(x, table, gen, count_clamped=True)

    expected = _reference(monkeypatch, encode)
    got = encode()
    assert got[1] == expected[1] and got[0].dtype == expected[0].dtype == torch.int32
    assert torch.equal(got[0], expected[0])


@needs_native
def test_native_fwht_does_not_depend_on_the_thread_count():
    x = torch.randn(1 << 21)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.fwht_(x.clone())
        torch.set_num_threads(max(2, old))
        assert torch.equal(cpu.fwht_(x.clone()), one)
    finally:
        torch.set_num_threads(old)


@needs_native
@pytest.mark.parametrize("name", SPARSIFIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind, n, ratio", [
    ("laplace", 1000, 0.01), ("laplace", 200_003, 0.001), ("laplace", 200_003, 0.1),
    ("ties", 50_000, 0.01), ("zeros", 4096, 0.01), ("sparse", 100_000, 0.001),
])
def test_native_path_selects_exactly_what_the_reference_selects(monkeypatch, name, dtype, kind,
                                                                n, ratio):
    grads = _inputs(kind, n, dtype)
    fast = _run(name, grads, ratio)
    slow = _reference(monkeypatch, lambda: _run(name, grads, ratio))
    for f, s in zip(fast, slow):
        assert torch.equal(f.sent.indices, s.sent.indices)
        assert torch.equal(f.sent.values, s.sent.values)
        assert torch.equal(f.aggregate, s.aggregate)
        assert f.extra.keys() == s.extra.keys()
        for key, value in s.extra.items():
            assert f.extra[key] == pytest.approx(value, rel=1e-12, abs=0), key


def _model_gradients() -> dict[str, torch.Tensor]:
    """The gradients of a small language-model-like network after one backward pass: an
    embedding whose rows for tokens the batch never holds are exact zeros (most of them:
    the tokens are drawn from a Zipf-like law), hidden layers behind a ReLU (the columns
    of units that stayed off are zeros), and a few small tensors (a 10-element bias)."""
    g = torch.Generator().manual_seed(0)
    vocab, width, hidden, classes = 6000, 48, 96, 10
    weights = {"embedding": torch.randn(vocab, width, generator=g) * 0.1,
               "hidden.weight": torch.randn(hidden, width, generator=g) / width**0.5,
               "hidden.bias": torch.randn(hidden, generator=g) * 0.1,
               "out.weight": torch.randn(classes, hidden, generator=g) / hidden**0.5,
               "out.bias": torch.zeros(classes)}
    for w in weights.values():
        w.requires_grad_(True)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    tokens = torch.multinomial(1 / ranks, 64 * 12, replacement=True, generator=g).view(64, 12)
    labels = torch.randint(0, classes, (64,), generator=g)
    h = weights["embedding"][tokens].mean(dim=1)
    h = torch.relu(h @ weights["hidden.weight"].T + weights["hidden.bias"])
    logits = h @ weights["out.weight"].T + weights["out.bias"]
    torch.nn.functional.cross_entropy(logits, labels).backward()
    return {name: w.grad.reshape(-1).clone() for name, w in weights.items()}


@needs_native
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p", "dragonn"])
@pytest.mark.parametrize("ratio", [0.001, 0.01])
def test_model_gradients_select_what_the_reference_selects(monkeypatch, name, ratio):
    """On a model's gradients (exact zero rows of an embedding, ReLU zeros, a 10-element
    bias), step after step with every threshold growing by a steady factor (so that from
    the third step on SIDCo's first read of the embedding is the speculative one at
    δ = 0.001), the fused kernels on 2 threads send bit for bit the indices and values the
    pure-torch path sends."""
    grads = _model_gradients()
    embedding = grads["embedding"]
    assert 0.8 < float((embedding == 0).float().mean()) < 0.99  # most rows untouched
    assert 0 < int((grads["hidden.weight"] == 0).sum()) < grads["hidden.weight"].numel()

    def run() -> list:
        session = Session(compressors.build(name, ratio=ratio), world_size=1,
                          feedback="none", seed=3, measure=False)
        steps = []
        for step in range(5):
            outs = [drive([session.exchange(key, g * 1.04**step, step)])[0]
                    for key, g in grads.items()]
            speculated = session.states["embedding"]["compressor"].get("speculated")
            steps.append((outs, speculated))
        return steps

    fast = with_threads(2, run)
    slow = _reference(monkeypatch, run)
    for step, ((f_outs, speculated), (s_outs, _)) in enumerate(zip(fast, slow)):
        for key, f, s in zip(grads, f_outs, s_outs):
            assert torch.equal(f.sent.indices, s.sent.indices), (step, key)
            assert torch.equal(f.sent.values, s.sent.values), (step, key)
            assert f.sent.indices.numel() > 0, (step, key)
        if name.startswith("sidco") and ratio == 0.001 and step >= 2:
            # the embedding's first read speculated (at δ = 0.01 its first two thresholds
            # lie within the speculation's margins of each other: the plain reads)
            assert speculated is True, step


@needs_native
@pytest.mark.parametrize("name", SPARSIFIERS)
def test_bad_input_refused_the_same_way_on_both_paths(monkeypatch, name):
    bad = _laplace(1000, torch.float32)
    bad[3] = float("nan")
    session = Session(compressors.build(name, ratio=0.01), world_size=1)
    with pytest.raises(FloatingPointError) as fast:
        drive([session.exchange("g", bad, 0)])

    def slow_error():
        with pytest.raises(FloatingPointError) as err:
            drive([Session(compressors.build(name, ratio=0.01), world_size=1)
                   .exchange("g", bad, 0)])
        return str(err.value)

    assert str(fast.value) == _reference(monkeypatch, slow_error)
    with pytest.raises(ValueError, match="out of range"):
        compressors.build(name, ratio=1.5)


def test_unsupported_tensors_take_the_reference_path():
    assert not ops.supports(torch.zeros(10, dtype=torch.float16))
    assert not ops.supports(torch.zeros(10, 2).t())  # not contiguous
    assert not ops.supports(torch.zeros(0))


# -- fallback ----------------------------------------------------------------------------

def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("GRADCOMP_NATIVE", "0")
    assert build.load() is None and not ops.available()
    out = _run("sidco_e", [_laplace(10_000, torch.float32)], 0.01)[0]
    assert out.selected > 0


def test_missing_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_error", None)
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setenv("GRADCOMP_NATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv("GRADCOMP_NATIVE", raising=False)  # enabled, but cannot build
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert build.load() is None
    assert "no C++ compiler" in ops.error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every call
        assert not ops.supports(torch.zeros(5))
        out = _run("dgc", [_laplace(10_000, torch.float32)], 0.01)[0]
    assert out.selected > 0


def test_abs_into_workspace_reuses_one_buffer_per_dtype():
    """torch.topk's |acc| (Top-k, CLT-k, DEFT) of a tensor of SMALL_ABS elements or more
    is written into a workspace kept between calls: the same values as x.abs(), in x's
    shape, the same memory call after call (grown for a larger tensor), one workspace per
    dtype, given back by release_workspaces. A smaller tensor gets a fresh |x|."""
    ops.release_workspaces()
    n = ops.SMALL_ABS
    x = _laplace(n + 1024, torch.float32, seed=1).view(64, -1)
    first = ops.abs_into_workspace(x)
    assert first.shape == x.shape and torch.equal(first, x.abs())
    y = _laplace(n + 700, torch.float32, seed=2)
    again = ops.abs_into_workspace(y)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, y.abs())
    wide = ops.abs_into_workspace(y.double())
    assert wide.dtype == torch.float64 and torch.equal(wide, y.double().abs())
    assert ops.abs_into_workspace(y).data_ptr() == first.data_ptr()  # float32's kept
    big = ops.abs_into_workspace(_laplace(2 * n, torch.float32, seed=3))
    assert big.numel() == 2 * n and torch.equal(big, _laplace(2 * n, torch.float32, seed=3).abs())
    small = _laplace(700, torch.float32, seed=4)
    fresh = ops.abs_into_workspace(small)
    assert torch.equal(fresh, small.abs())
    assert fresh.data_ptr() != ops.abs_into_workspace(y).data_ptr()
    ops.release_workspaces()
    half = torch.tensor([-1.5, 2.0, -0.0], dtype=torch.float16)
    assert torch.equal(ops.abs_into_workspace(half), half.abs())
    ops.release_workspaces()
