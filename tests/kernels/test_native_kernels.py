"""The C++ kernels (compressors/kernels/cpu.py): the fused statistics + pool pass (SIDCo's
pools), the selections and counts, the hashed sample (DGC/DRAGONN), the batched sparse
decode, the sign and level sums, DRAGONN's slots, and the float32 comparison paths.

Each is checked against what it replaces, bit for bit, on inputs large enough for two
threads (MIN_PER_THREAD elements per thread), at sizes that leave ragged tails, and with
thresholds that put elements exactly on the boundary."""

from __future__ import annotations

import math

import pytest
import torch

import compressors
from compressors import Session, drive
from compressors.kernels import build, cpu, ops
from repro.testing import with_threads

needs_native = pytest.mark.skipif(not ops.available(),
                                  reason=f"native kernels unavailable: {ops.error()}")

# 1 thread, 2 threads with a ragged last block, 3+ threads
SIZES = [1, 13, 1000, 2 * cpu.MIN_PER_THREAD + 37, 4 * cpu.MIN_PER_THREAD + 5]


def _laplace(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(dtype)


@needs_native
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("quantile", [0.0, 0.5, 0.9375, 0.999])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_pool_equals_select_and_stats(n, dense, quantile, index_dtype):
    x = _laplace(n, seed=n)
    # A threshold equal to one of the magnitudes: that element must be left out (strict).
    t = float(x.abs().kthvalue(max(1, int(quantile * n))).values)
    st, idx, val = cpu.pool(x, t, above=t / 2, shift=t / 2, squares=True, extremes=True,
                                dense=dense, index_dtype=index_dtype)
    ref_idx, ref_val = cpu.select(x, t, strict=True, values=True)
    assert idx.dtype == index_dtype
    idx = idx.long()
    assert torch.equal(idx, ref_idx)
    assert torch.equal(val, ref_val)
    assert torch.equal(idx, torch.nonzero(x.abs() > t).squeeze(1))
    assert st == cpu.stats(x, above=t / 2, shift=t / 2, squares=True, extremes=True)
    # Without `above` no statistics are computed and the pool is the same.
    none, idx2, _ = cpu.pool(x, t, dense=dense)
    assert none is None and torch.equal(idx2, idx)


@needs_native
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_pool_does_not_depend_on_the_thread_count(dense, index_dtype):
    x = _laplace(4 * cpu.MIN_PER_THREAD + 5, seed=3)
    t = float(x.abs().quantile(0.9))
    runs = [with_threads(k, lambda: cpu.pool(x, t, above=t / 3, shift=t / 3,
                                                 squares=True, dense=dense,
                                                 index_dtype=index_dtype))
            for k in (1, 2, 3)]
    for st, idx, val in runs[1:]:
        assert st == runs[0][0]
        assert torch.equal(idx, runs[0][1]) and torch.equal(val, runs[0][2])


@needs_native
@pytest.mark.parametrize("dense", [False, True])
def test_pool_into_a_workspace_narrows_itself_in_place(dense):
    """pool(..., workspace=): the values only, in a workspace kept between calls; a pool
    taken from a view of that workspace (a search narrowing its probe set) equals the
    fresh pool."""
    x = _laplace(4 * cpu.MIN_PER_THREAD + 5, seed=8)
    ts = [float(x.abs().quantile(q)) for q in (0.5, 0.8, 0.95)]
    with_threads(2, ops.release_workspaces)
    pool, ptr = x, None
    for t in ts:
        want = cpu.pool(pool.clone(), t, dense=dense, strict=False)[2]
        st, idx, got = with_threads(2, lambda p=pool, t=t: cpu.pool(
            p, t, dense=dense, strict=False, above=t, workspace="test"))
        assert idx is None and st is not None
        assert torch.equal(got, want)
        assert torch.equal(got, x.abs()[x.abs() >= t])  # the same pool straight from x
        # one workspace: the first pool sized it for half of x, and every later one is
        # smaller
        assert ptr is None or got.data_ptr() == ptr
        pool, ptr = got, got.data_ptr()
    with_threads(2, ops.release_workspaces)


@needs_native
def test_pool_workspace_holds_half_the_tensor_so_the_next_step_reuses_it():
    """A search's first pool from the gradient keeps at most half of it: the workspace is
    sized for that from the first call, so a later step whose pool is larger (up to half)
    is written into the same workspace instead of a new one."""
    x = _laplace(4 * cpu.MIN_PER_THREAD + 5, seed=9)
    ops.release_workspaces()
    first = cpu.pool(x, float(x.abs().quantile(0.6)), strict=False, workspace="test")[2]
    ptr = first.data_ptr()
    t = float(x.abs().quantile(0.52))
    later = cpu.pool(x, t, strict=False, workspace="test")[2]
    assert first.numel() < later.numel() <= x.numel() // 2
    assert later.data_ptr() == ptr
    assert torch.equal(later, x.abs()[x.abs() >= t])
    ops.release_workspaces()


@needs_native
def test_pool_refuses_float64():
    with pytest.raises(TypeError, match="float32"):
        cpu.pool(torch.zeros(10, dtype=torch.float64), 0.5)
    with pytest.raises(ValueError, match="int64, or int32"):
        cpu.pool(torch.zeros(10), 0.5, index_dtype=torch.int16)


@needs_native
def test_float32_comparisons_at_the_threshold():
    # Magnitudes on a coarse grid: thousands of elements sit exactly at each threshold,
    # in every lane position of the 8- and 16-element groups, with both signs.
    n = 2 * cpu.MIN_PER_THREAD + 29
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-6, 7, (n,), generator=g).to(torch.float32) * 0.125
    x[::97] = -0.0
    for t in (0.0, 0.125, 0.375, 0.75, 1.0):
        a = x.abs()
        assert cpu.count(x, t) == int((a >= t).sum())
        assert cpu.count(x, t, strict=True) == int((a > t).sum())
        assert torch.equal(cpu.select(x, t)[0], torch.nonzero(a >= t).squeeze(1))
        assert torch.equal(cpu.select(x, t, strict=True)[0], torch.nonzero(a > t).squeeze(1))
        # the branch-free layout (an expected count above DENSE_FRACTION of x)
        for strict in (False, True):
            idx, val = cpu.select(x, t, strict=strict, values=True, reserve=n)
            ref = torch.nonzero(a > t if strict else a >= t).squeeze(1)
            assert torch.equal(idx, ref) and torch.equal(val, a[ref])


@needs_native
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 65_541, 2 * cpu.MIN_PER_THREAD + 37])
@pytest.mark.parametrize("quantile", [0.0, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_branch_free_selection_equals_the_skipping_one(n, quantile, threads):
    # select() writes its hits branch-free when more than DENSE_FRACTION are expected to
    # pass (`reserve`): positions and values must be those of the skipping layout, for
    # both comparisons, with and without values, at any thread count.
    x = _laplace(n, seed=n + threads)
    t = float(x.abs().kthvalue(max(1, int(quantile * n))).values)
    assert cpu.DENSE_FRACTION < 1  # so reserve=n takes the branch-free layout
    for strict in (False, True):
        for values in (False, True):
            skip = cpu.select(x, t, strict=strict, values=values)
            dense = with_threads(threads, lambda: cpu.select(
                x, t, strict=strict, values=values, reserve=n))
            assert torch.equal(dense[0], skip[0]) and dense[0].dtype == torch.int64
            assert (dense[1] is None) == (not values)
            if values:
                assert torch.equal(dense[1], skip[1])


@needs_native
@pytest.mark.parametrize("n", [5, 8, 9, 2 * cpu.MIN_PER_THREAD + 37])
def test_branch_free_selection_finds_every_nan_and_inf(n):
    x = _laplace(n, seed=4)
    x[n // 2] = torch.finfo(torch.float32).max  # finite
    cpu.select(x, 1e-3, check_finite=True, reserve=n)
    for bad in (float("nan"), float("inf"), -float("inf")):
        # first element, the middle, the last (a ragged tail when n % 8), the second part
        for pos in {0, n // 2 - 1, n - 1, 3 * n // 4}:
            y = x.clone()
            y[pos] = bad
            with pytest.raises(cpu.NonFinite):
                with_threads(2, lambda: cpu.select(y, 1e-3, check_finite=True,
                                                       reserve=n))
            # without the check the same call selects (NaN compares false, Inf passes)
            idx, _ = cpu.select(y, 1e-3, reserve=n)
            assert torch.equal(idx, torch.nonzero(y.abs() >= 1e-3).squeeze(1))


def _run(name: str, grads: list[torch.Tensor], ratio: float) -> list:
    session = Session(compressors.build(name, ratio=ratio), world_size=1, feedback="none",
                      seed=11, measure=False)
    return [drive([session.exchange("g", g, step)])[0] for step, g in enumerate(grads)]


@needs_native
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p", "dgc", "dragonn", "mstopk",
                                  "gaussianksgd", "redsync"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_two_thread_native_path_selects_what_the_reference_selects(monkeypatch, name, ratio):
    # Large enough for two threads in every pass (the pools of the first SIDCo stages are
    # compacted branch-free: δ₁·δ₂ > 2%), over several steps with their own data.
    grads = [_laplace(3 * cpu.MIN_PER_THREAD + 11, seed=s) for s in range(3)]
    fast = with_threads(2, lambda: _run(name, grads, ratio))
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        slow = _run(name, grads, ratio)
    for f, s in zip(fast, slow):
        assert f.sent.indices.numel() > 0
        assert torch.equal(f.sent.indices, s.sent.indices)
        assert torch.equal(f.sent.values, s.sent.values)


@needs_native
def test_hard_threshold_keeps_its_last_count_and_selects_what_the_reference_selects(
        monkeypatch):
    # λ keeps about 10% of each step: from the second step on the last count (kept in the
    # state) asks for the branch-free layout; the selections stay the torch path's.
    grads = [_laplace(3 * cpu.MIN_PER_THREAD + 11, seed=s) for s in range(3)]
    lam = float(grads[0].abs().quantile(0.9))

    def run():
        session = Session(compressors.build("hard_threshold", lam=lam, ratio=0.1),
                          world_size=1, feedback="none", seed=3, measure=False)
        out = [drive([session.exchange("g", g, step)])[0] for step, g in enumerate(grads)]
        return out, session

    fast, session = with_threads(2, run)
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        slow, _ = run()
    counts = [f.sent.indices.numel() for f in fast]
    assert min(counts) > cpu.DENSE_FRACTION * grads[0].numel()
    for f, s in zip(fast, slow):
        assert torch.equal(f.sent.indices, s.sent.indices)
        assert torch.equal(f.sent.values, s.sent.values)
    assert session.states["g"]["compressor"]["count"] == counts[-1]


@needs_native
@pytest.mark.parametrize("kind", ["laplace", "ties", "sparse", "constant"])
@pytest.mark.parametrize("ratio", [0.001, 0.05, 0.5])
def test_mstopk_native_search_equals_the_reference(monkeypatch, kind, ratio):
    n = 50_003
    g = torch.Generator().manual_seed(7)
    if kind == "laplace":
        x = _laplace(n, seed=4)
    elif kind == "ties":  # many elements exactly at every candidate threshold
        x = torch.randint(-8, 9, (n,), generator=g).to(torch.float32) * 2.5e-4
    elif kind == "sparse":
        x = torch.zeros(n)
        x[::97] = _laplace(len(range(0, n, 97)), seed=5)
    else:  # more than k elements tie at the maximum: the first k of them are sent
        x = torch.full((n,), -3e-3)
    fast = _run("mstopk", [x], ratio)[0]
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        slow = _run("mstopk", [x], ratio)[0]
    assert torch.equal(fast.sent.indices, slow.sent.indices)
    assert fast.sent.indices.numel() <= max(1, int(n * ratio))
    assert fast.extra == slow.extra


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 9, 2 * cpu.MIN_PER_THREAD + 37])
def test_all_finite_finds_every_nan_and_inf(dtype, n):
    x = _laplace(n, seed=2, dtype=dtype)
    assert cpu.all_finite(x)
    big = torch.finfo(dtype).max
    x[n // 2] = big  # the largest finite value is finite
    assert cpu.all_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for pos in {0, n // 3, n - 1}:
            y = x.clone()
            y[pos] = bad
            assert not cpu.all_finite(y), (bad, pos)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 1000, 300_001])
def test_sample_abs_reads_the_hashed_positions(dtype, n):
    from compressors.kernels.counter_stream import counter_hash, seed_words

    x = _laplace(n, seed=6, dtype=dtype)
    seed = 0x1234_5678_9ABC_DEF0
    for s in (1, 17, 70_000):
        positions = (counter_hash(torch.arange(s), seed) * n) >> 32
        assert int(positions.max()) < n and int(positions.min()) >= 0
        assert torch.equal(cpu.sample_abs(x, s, *seed_words(seed)),
                           x.index_select(0, positions).abs())


def test_hashed_sample_positions_are_uniform():
    # DGC's CPU sample positions p_i = (h(i)·d) >> 32: a chi-square test over 64 equal
    # bins of [0, d) and a test that the draws of two seeds are unrelated; a position
    # stream that ignored the high bits of h or repeated across seeds would fail them.
    from compressors.kernels.counter_stream import counter_hash

    d, s, bins = 26_000_003, 640_000, 64
    p = (counter_hash(torch.arange(s), 99) * d) >> 32
    counts = torch.bincount(p * bins // d, minlength=bins).double()
    chi2 = float(((counts - s / bins) ** 2 / (s / bins)).sum())
    assert chi2 < 120, chi2  # 63 degrees of freedom: P(chi2 > 120) < 1e-4
    q = (counter_hash(torch.arange(s), 100) * d) >> 32
    same = float((p == q).double().mean())
    assert same < 1e-3
    corr = torch.corrcoef(torch.stack([p.double(), q.double()]))[0, 1]
    assert abs(float(corr)) < 0.01


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_mstopk_native_keeps_ties_at_the_lower_bound(monkeypatch, seed):
    # Found in review: late bisection probes round to the same float32 as the lower
    # bound; a probe set shrunk to {|x| > bound} had dropped the elements tied at it, so
    # the native search accepted a probe whose true count exceeds k and sent 100 > k = 70.
    g = torch.Generator().manual_seed(seed)
    below = float(torch.tensor(0.5).nextafter(torch.tensor(0.0)))
    x = torch.cat([torch.rand(900, generator=g) * 1e-3, torch.full((200,), below),
                   torch.full((60,), 0.5), 0.6 + 0.4 * torch.rand(40, generator=g)])
    x = x[torch.randperm(x.numel(), generator=g)].contiguous()
    ratio = 70 / x.numel()
    fast = _run("mstopk", [x], ratio)[0]
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        slow = _run("mstopk", [x], ratio)[0]
    assert fast.sent.indices.numel() <= 70
    assert torch.equal(fast.sent.indices, slow.sent.indices)
    assert fast.extra == slow.extra


@needs_native
@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 65_541, 2 * cpu.MIN_PER_THREAD + 37])
def test_exceedance_sums_match_float64_torch(n):
    # The float32 fast path for count and Σ(|x| − t) over {|x| > t} against float64 sums.
    x = _laplace(n, seed=n)
    a = x.abs().double()
    for q in (0.0, 0.5, 0.99):
        t = float(torch.tensor(float(a.quantile(q)) if n > 1 else 0.0, dtype=torch.float32))
        st = cpu.stats(x, above=t, shift=t)
        keep = a > t
        assert st.count == int(keep.sum())
        assert st.sum == pytest.approx(float((a[keep] - t).sum()), rel=1e-12, abs=1e-300)


@needs_native
def test_pool_ge_and_gt_differ_only_at_ties():
    x = torch.tensor([0.5, -0.5, 0.25, 0.75, -1.0] * 20_000, dtype=torch.float32)
    _, gt, _ = cpu.pool(x, 0.5, dense=True)
    _, ge, vals = cpu.pool(x, 0.5, dense=True, strict=False)
    assert torch.equal(gt, torch.nonzero(x.abs() > 0.5).squeeze(1))
    assert torch.equal(ge, torch.nonzero(x.abs() >= 0.5).squeeze(1))
    assert torch.equal(vals, x.abs()[ge])
    for dense in (False, True):  # x itself with `signed`, on every writing path
        for index_dtype in (torch.int64, torch.int32):
            _, ge, vals = cpu.pool(x, 0.5, dense=dense, strict=False, signed=True,
                                       index_dtype=index_dtype)
            assert torch.equal(ge.long(), torch.nonzero(x.abs() >= 0.5).squeeze(1))
            assert torch.equal(vals, x[ge.long()])
    with pytest.raises(TypeError, match="contiguous CPU float32"):
        cpu.pool(x[::2], 0.5)
    with pytest.raises(ValueError, match="no index_map"):
        cpu.select(x, 0.5, values=True, signed=True, index_map=torch.arange(x.numel()))


@needs_native
@pytest.mark.parametrize("arch", [[], ["-march=native", "-mno-avx512f"]],
                         ids=["portable", "without-avx512"])
@pytest.mark.heavy
def test_other_builds_give_the_same_results(tmp_path, monkeypatch, arch):
    # The library is built with -march=native and, if that fails, without it (generic
    # x86-64: no AVX, the scalar/vector-extension fallbacks); on a CPU with AVX-512 the
    # native build takes AVX-512 loops that a CPU with only AVX2 does not. Build the
    # fallback, and the native build without AVX-512 (the same as the native one on a CPU
    # without it), and check each selects and counts what the native build does.
    build.compile_library(build.compiler(), tmp_path / "p.so", arch=tuple(arch))
    portable = build.open_library(tmp_path / "p.so")
    x = _laplace(2 * cpu.MIN_PER_THREAD + 37, seed=9)
    x[::101] = 0.0  # zeros: left out of the nonzeros and of Σ ln|x|
    t = float(x.abs().quantile(0.95))

    def results():
        return (cpu.count(x, t), cpu.select(x, t, values=True),
                cpu.select(x, t, values=True, check_finite=True, reserve=x.numel()),
                cpu.pool(x, t, above=t / 2, shift=t / 2, dense=True),
                cpu.stats(x, squares=True, extremes=True), cpu.all_finite(x),
                cpu.sample_abs(x, 5000, 3, 4),
                cpu.scatter_mean(*_payload(x.numel(), 70_001, 1, torch.int32, x.dtype),
                                     torch.empty_like(x), 3),
                cpu.pack_signs(x),
                cpu.add_signs_(x.clone(), cpu.pack_signs(x.flip(0)),
                                   torch.tensor([0, 1000, x.numel()]), torch.tensor([0.5, 2.0])),
                cpu.add_levels_(x.clone(), (x * 3e4).to(torch.int16),
                                    torch.tensor([0, 1000, x.numel()]), torch.tensor([0.5, -2.0])),
                cpu.sidco_spec(x, t / 3, t / 2, t, squares=True),
                cpu.stats(x, logs=True),
                cpu.sidco_spec(x, t / 3, t / 2, t, logs=True, mid_squares=True),
                cpu.stats(x, nonzeros=True), cpu.stats(x, squares=True, nonzeros=True),
                cpu.stats(x.double(), nonzeros=True),
                cpu.stats(x, above=t / 2, shift=t / 2, squares=True, nonzeros=True))

    expected = results()
    monkeypatch.setattr(build, "_lib", portable)
    got = results()
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert all(torch.equal(a, b) for a, b in zip(got[2], expected[1]))  # branch-free
    assert got[3][0] == expected[3][0]
    assert torch.equal(got[3][1], expected[3][1]) and torch.equal(got[3][2], expected[3][2])
    assert got[4] == expected[4] and got[5] == expected[5]
    assert torch.equal(got[6], expected[6])
    assert torch.equal(got[7], expected[7])
    assert torch.equal(got[8], expected[8])
    assert torch.equal(got[9], expected[9])
    assert torch.equal(got[10], expected[10])
    (first, mid, idx, val, win), (first_n, mid_n, idx_n, val_n, win_n) = got[11], expected[11]
    assert first == first_n  # the lane structure of gc_stats, both builds
    assert mid.count == mid_n.count and mid.count > 0
    assert mid.sum == pytest.approx(mid_n.sum, rel=1e-12)
    assert mid.sumsq == pytest.approx(mid_n.sumsq, rel=1e-12)
    assert torch.equal(idx.tensor(), idx_n.tensor()) and torch.equal(val, val_n)
    assert torch.equal(win, win_n) and win.numel() > 0
    # Σ ln|x|: each build's own lanes (the same in its stats and its speculative read)
    logs, logs_n = got[12], expected[12]
    assert logs.nonzero == logs_n.nonzero == int((x != 0).sum())
    assert logs.log_sum == pytest.approx(logs_n.log_sum, rel=1e-12)
    (first, mid, idx, val, win), (first_n, mid_n, idx_n, val_n, win_n) = got[13], expected[13]
    assert (first.nonzero, first.log_sum) == (logs.nonzero, logs.log_sum)
    assert (first.count, first.sum, first.sumsq) == (first_n.count, first_n.sum, 0.0)
    assert mid.count == mid_n.count and mid.sumsq == pytest.approx(mid_n.sumsq, rel=1e-12)
    assert torch.equal(idx.tensor(), idx_n.tensor()) and torch.equal(val, val_n)
    # the nonzeros alone (SIDCo's first reads): the same lanes as without them, both builds
    nonzeros = int((x != 0).sum())
    assert got[11][0].nonzero == expected[11][0].nonzero == nonzeros
    for a, b in zip(got[14:], expected[14:]):
        assert a == b and a.nonzero == nonzeros
    assert (got[14].sum, got[15].sumsq) == (cpu.stats(x).sum,
                                            cpu.stats(x, squares=True).sumsq)


@needs_native
@pytest.mark.parametrize("n, threads", [(1, 1), (37, 1), (100_003, 1), (600_007, 2),
                                        (600_007, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stats_count_the_nonzeros_alone_when_asked(n, threads, dtype):
    """stats(nonzeros=True) counts #{x ≠ 0} over every element (with `above` too), with
    the other statistics unchanged (bit for bit over every element, as SIDCo's first
    reads take them; above a bound Σy may be added in another order) and no extremes;
    without it (and without extremes or logs) the count is 0. Zeros of either sign,
    subnormals and a tensor with no nonzero at all."""
    x = _laplace(n, seed=n).to(dtype)
    x[::7] = 0.0
    x[1::13] = -0.0
    if n > 40:
        x[5] = torch.finfo(dtype).tiny / 4  # a subnormal: nonzero
    want = int((x != 0).sum())
    for above, squares in ((None, False), (None, True), (0.5e-3, False), (0.5e-3, True)):
        plain = with_threads(threads, lambda a=above, q=squares: cpu.stats(
            x, above=a, shift=1e-4, squares=q))
        got = with_threads(threads, lambda a=above, q=squares: cpu.stats(
            x, above=a, shift=1e-4, squares=q, nonzeros=True))
        assert plain.nonzero == 0 and got.nonzero == want
        if above is None:
            assert (got.count, got.sum, got.sumsq) == (plain.count, plain.sum, plain.sumsq)
        assert got.count == plain.count
        assert got.sum == pytest.approx(plain.sum, rel=1e-12)
        assert got.sumsq == pytest.approx(plain.sumsq, rel=1e-12)
        assert (got.max, got.min) == (-1.0, math.inf)
    assert cpu.stats(torch.zeros(n, dtype=dtype), nonzeros=True).nonzero == 0


@needs_native
def test_release_workspaces_then_the_kernels_still_work():
    x = _laplace(2 * cpu.MIN_PER_THREAD + 3, seed=1)
    before = cpu.pool(x, 1e-3, dense=True)
    ops.release_workspaces()
    after = cpu.pool(x, 1e-3, dense=True)
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])


@needs_native
@pytest.mark.parametrize("numel, nk, m", [(1, 1, 1), (10, 3, 4), (5000, 700, 400),
                                          (2**31 + 5, 3000, 2000), (2**32, 50, 64)])
def test_dragonn_slots_equal_write_slots(numel, nk, m):
    # Collisions are frequent (nk > m in some cases); for numel > 2^31 the priority keeps
    # fewer than 32 hash bits. Keys index a smaller stand-in acc (values are read there).
    from compressors.dragonn import draw_hash_seeds
    from compressors.kernels.reference import priority_layout, write_slots

    g = torch.Generator().manual_seed(nk)
    acc = _laplace(min(numel, 100_003), seed=3)
    keys = torch.randperm(acc.numel(), generator=g)[:nk].sort().values
    large = numel > acc.numel()
    if large:  # keys spread over the large index range; no values read
        keys = (keys * (numel // acc.numel())).unique()
    for _ in range(3):
        seeds = draw_hash_seeds(g)
        ref = write_slots(keys, m, seeds, numel)
        slots, values = cpu.dragonn_slots(keys, m, *priority_layout(numel),
                                              tuple(seeds.tolist()), acc, values=not large)
        assert torch.equal(slots, ref)
        # the keys' values handed in (as the selection writes them) instead of read from
        # acc: the same slots (the keys' ordinals order as the keys do) and values
        stand_in = torch.randn(keys.numel(), generator=g)
        by_ordinal, from_keys = cpu.dragonn_slots(
            keys, m, *priority_layout(numel), tuple(seeds.tolist()), acc,
            key_values=acc.index_select(0, keys) if not large else stand_in)
        assert torch.equal(by_ordinal, ref)
        if not large:
            assert torch.equal(values,
                               acc.index_select(0, ref.clamp(min=0)).masked_fill_(ref < 0, 0))
            assert torch.equal(from_keys, values)
        else:  # each slot's value is its key's, found by ordinal
            ordinal = torch.searchsorted(keys, ref.clamp(min=0))
            assert torch.equal(from_keys, stand_in[ordinal].masked_fill_(ref < 0, 0))
    if nk > 1:
        with pytest.raises(ValueError, match="ascending keys"):
            cpu.dragonn_slots(keys.flip(0).contiguous(), m, *priority_layout(numel),
                                  tuple(seeds.tolist()), acc, key_values=stand_in)


def _payload(n: int, m: int, seed: int, index_dtype: torch.dtype, dtype: torch.dtype):
    """m (index, value) pairs over [0, n): about a third repeat an earlier index (ranks'
    selections overlap), values of mixed scale so the order of the additions shows."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (m,), generator=g)
    if m > 3:
        repeat = torch.rand(m, generator=g) < 0.33
        idx = torch.where(repeat, idx[torch.randint(0, m, (m,), generator=g)], idx)
    val = torch.randn(m, generator=g, dtype=torch.float64) * torch.exp(
        4 * torch.randn(m, generator=g, dtype=torch.float64))
    return idx.to(index_dtype), val.to(dtype)


@needs_native
@pytest.mark.parametrize("n, m", [(1, 1), (1000, 0), (1000, 5000), (65_536, 100),
                                  (65_537, 3000), (2 * cpu.MIN_PER_THREAD + 37, 70_001)])
@pytest.mark.parametrize("divisor", [1, 2, 3, 8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_mean_equals_index_add_then_divide(n, m, divisor, index_dtype, dtype, threads):
    """Bit for bit torch's zero_, index_add_ (additions in pair order) and div_, with the
    region walk, the shared counting sort (m ≥ 2^16 pairs on two threads) and the
    once-only division of repeated indices."""
    idx, val = _payload(n, m, seed=n + m, index_dtype=index_dtype, dtype=dtype)
    expected = torch.zeros(n, dtype=dtype).index_add_(0, idx, val)
    if divisor > 1:
        expected.div_(divisor)
    out = torch.full((n,), float("nan"), dtype=dtype)  # every element must be written
    got = with_threads(threads, lambda: cpu.scatter_mean(idx, val, out, divisor))
    assert got is out
    assert torch.equal(out, expected)


def _ranks_payload(n: int, ranks: int, k: int, seed: int, dtype: torch.dtype):
    """`ranks` ascending selections of about k indices each (as a threshold sparsifier
    sends them), concatenated: one ascending run per rank, overlapping across ranks, with
    an index repeated inside a rank too; values of mixed scale."""
    g = torch.Generator().manual_seed(seed)
    runs = []
    for _ in range(ranks):
        run = torch.randint(0, n, (k,), generator=g).sort().values
        run[1::7] = run[0::7][: run[1::7].numel()]  # repeats, still ascending
        runs.append(run)
    idx = torch.cat(runs)
    val = torch.randn(idx.numel(), generator=g, dtype=torch.float64) * torch.exp(
        4 * torch.randn(idx.numel(), generator=g, dtype=torch.float64))
    return idx, val.to(dtype)


@needs_native
@pytest.mark.parametrize("n, ranks, k", [
    (1000, 2, 300), (65_537, 3, 5000), (300_007, 8, 4000),
    (300_007, 64, 50),  # as many runs as are merged (MERGE_RUNS)
    (300_007, 65, 50),  # one more: counted and sorted by region instead
    (2_200_001, 4, 20_000),  # above 8 MiB of float32: written with streaming stores
])
@pytest.mark.parametrize("divisor", [1, 3, 16])  # 16: scaled by 1/16 as written out
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_scatter_mean_of_ascending_runs_equals_index_add(n, ranks, k, divisor, dtype,
                                                         index_dtype, threads):
    """The K ranks' ascending selections are merged region by region, a cursor per run, runs
    in order: bit for bit torch's zero_, index_add_ and div_ (an element's additions keep
    the pairs' order, across ranks and within one). The runs' ends are found a vector of
    indices at a time, wherever they fall in one."""
    idx, val = _ranks_payload(n, ranks, k, seed=n + ranks, dtype=dtype)
    idx = idx.to(index_dtype)
    expected = torch.zeros(n, dtype=dtype).index_add_(0, idx, val)
    if divisor > 1:
        expected.div_(divisor)
    out = torch.full((n,), float("nan"), dtype=dtype)
    got = with_threads(threads, lambda: cpu.scatter_mean(idx, val, out, divisor))
    assert got is out
    assert torch.equal(out, expected)


@needs_native
@pytest.mark.parametrize("n", [1000, 2_200_001])  # written plainly, and streamed
@pytest.mark.parametrize("divisor", [2, 16, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatter_mean_divides_edge_values_as_torch_does(n, divisor, dtype):
    """A power-of-two divisor scales by its inverse as the region is written out: the same
    bits as torch's div_ for values whose quotient is subnormal, ±0, huge or infinite."""
    info = torch.finfo(dtype)
    special = torch.tensor([info.tiny, info.tiny * 3.3, info.tiny / 7, -info.tiny * 1.7,
                            info.max, -info.max, -0.0, 0.0, float("inf"), 5e-324 * 9,
                            1.0 / 3.0], dtype=torch.float64).to(dtype)
    idx = torch.linspace(0, n - 1, special.numel()).long()
    idx = torch.cat([idx, idx[::2]])  # repeats across two runs: added, then divided once
    val = torch.cat([special, special[::2] * 0.75])
    expected = torch.zeros(n, dtype=dtype).index_add_(0, idx, val).div_(divisor)
    out = torch.full((n,), float("nan"), dtype=dtype)
    cpu.scatter_mean(idx, val, out, divisor)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(out.view(bits), expected.view(bits))  # -0.0 and +0.0 told apart
    assert int((expected != 0).sum()) >= 8 and bool(expected.isinf().any())


@needs_native
def test_scatter_mean_refuses_a_bad_index_before_writing():
    idx = torch.tensor([0, 5, 10, 3], dtype=torch.int32)
    val = torch.ones(4)
    out = torch.full((10,), 7.0)
    with pytest.raises(IndexError, match="index 10 at position 2"):
        cpu.scatter_mean(idx, val, out, 2)
    with pytest.raises(IndexError, match="index -1 at position 0"):
        cpu.scatter_mean(torch.tensor([-1, 2]), val[:2], out, 1)
    assert torch.equal(out, torch.full((10,), 7.0))
    with pytest.raises(TypeError, match="scatter_mean"):
        cpu.scatter_mean(idx, val.double(), out, 1)  # values of another dtype


@needs_native
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_mean_finds_the_first_bad_index_inside_a_vector(index_dtype, threads):
    """Indices are checked a vector at a time: a bad one anywhere (either share of two
    threads, any lane) is reported at its position, the first one in order, and nothing
    is written."""
    n, m = 100_000, 70_001
    idx = torch.linspace(0, n - 1, m).long().to(index_dtype)
    val = torch.ones(m)
    out = torch.full((n,), 7.0)
    for bad, where, want in (([n], [40_003], 40_003), ([-3], [60_001], 60_001),
                             ([n + 5, -1], [50_002, 45_007], 45_007), ([n], [m - 1], m - 1)):
        broken = idx.clone()
        broken[where] = torch.tensor(bad, dtype=index_dtype)
        with pytest.raises(IndexError, match=f"index {broken[want]} at position {want}"):
            with_threads(threads, lambda: cpu.scatter_mean(broken, val, out, 2))
        assert torch.equal(out, torch.full((n,), 7.0))


@needs_native
@pytest.mark.parametrize("world", [1, 3])
def test_sparse_mean_native_equals_the_torch_path(monkeypatch, world):
    """compressors.base.sparse_mean (every sparsifier's decode) with and without the
    native kernel."""
    from compressors.base import sparse_mean

    n = 300_001
    parts = [_payload(n, 20_000, seed=s, index_dtype=torch.int32, dtype=torch.float32)
             for s in range(world)]
    idx, val = [p[0] for p in parts], [p[1] for p in parts]
    native = sparse_mean(idx, val, n, world, torch.float32)
    monkeypatch.setattr(ops, "supports_cpu", lambda t: False)
    assert torch.equal(native, sparse_mean(idx, val, n, world, torch.float32))
