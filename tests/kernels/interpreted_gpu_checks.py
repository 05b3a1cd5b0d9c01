"""The Triton kernels of compressors/kernels/cuda.py run by Triton's CPU interpreter on CPU
tensors, against the torch expressions they replace. Not collected by default (the file
name): tests/kernels/test_gpu_kernels.py runs it in a fresh Python with TRITON_INTERPRET=1, which
must be set before triton is first imported."""

from __future__ import annotations

import pytest
import torch

from compressors import dragonn
from compressors.kernels import cuda as kernels
from compressors.kernels import cuda_sidco as gpu_sidco
from compressors.kernels import reference, sidco_pipeline
from compressors.kernels.counter_stream import counter_hash, seed_words
from compressors.kernels.types import Selected

if not kernels.INTERPRETED:
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/kernels/test_gpu_kernels.py does)")


def _laplace(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


# one element, a partial block, several blocks with a ragged last one
SIZES = [1, 13, 2 * 4096 + 37]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("quantile", [0.0, 0.5, 0.999])
@pytest.mark.parametrize("strict", [False, True])
def test_select_and_count_equal_torch(n, quantile, strict):
    x = _laplace(n, seed=n)
    x[n // 2] = -x[n // 3] if n > 2 else x[0]  # a tie of magnitudes with opposite signs
    # a threshold equal to one of the magnitudes: it is kept (≥) or left out (>)
    t = float(x.abs().kthvalue(max(1, int(quantile * n))).values)
    mask = x.abs() > t if strict else x.abs() >= t
    ref = torch.nonzero(mask).squeeze(1)
    idx, val = kernels.select(x, t, strict=strict, values=True)
    assert idx.dtype == torch.int64 and torch.equal(idx, ref)
    assert torch.equal(val, x.abs()[ref])
    assert kernels.count(x, t, strict=strict) == ref.numel()
    # positions mapped through an index map (a pool's original positions)
    where = torch.randperm(3 * n, generator=torch.Generator().manual_seed(1))[:n].sort().values
    mapped, none = kernels.select(x, t, strict=strict, index_map=where)
    assert none is None and torch.equal(mapped, where[ref])


@pytest.mark.parametrize("n", SIZES)
def test_select_check_finite_finds_nan_and_inf_anywhere(n):
    from compressors.kernels.types import NonFinite

    x = _laplace(n, seed=n + 7)
    t = float(x.abs().kthvalue(max(1, n - 3)).values)
    ref = torch.nonzero(x.abs() >= t).squeeze(1)
    idx, val = kernels.select(x, t, values=True, check_finite=True)
    assert torch.equal(idx, ref) and torch.equal(val, x.abs()[ref])
    for pos in sorted({0, n // 2, n - 1}):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[pos] = bad
            with pytest.raises(NonFinite):
                kernels.select(y, t, check_finite=True)
            # unchecked, the same call selects as torch does (NaN never passes)
            assert torch.equal(kernels.select(y, t)[0],
                               torch.nonzero(y.abs() >= t).squeeze(1))


def test_threshold_is_rounded_to_float32_as_torch_rounds_it():
    x = torch.tensor([1.0, 1.0 + 2**-23, 2.0])
    t = 1.0 + 2**-25  # rounds to 1.0 in float32: torch then keeps the element 1.0
    assert torch.equal(kernels.select(x, t)[0], torch.nonzero(x.abs() >= t).squeeze(1))
    assert kernels.count(x, t) == 3 and kernels.count(x, t, strict=True) == 2
    big = torch.tensor([3.4028234663852886e38, 1.0])
    for t in (3.4028235e38, 3.45e38, 1e300, float("inf")):  # near and past float32's max
        assert torch.equal(kernels.select(big, t)[0], torch.nonzero(big.abs() >= t).squeeze(1))


def test_select_nothing_and_everything():
    x = _laplace(5000, seed=3)
    idx, val = kernels.select(x, float("inf"), values=True)
    assert idx.numel() == 0 and val.numel() == 0
    assert torch.equal(kernels.select(x, 0.0)[0], torch.arange(5000))
    x[::7] = 0.0  # zeros are not above 0
    assert torch.equal(kernels.select(x, 0.0, strict=True)[0], torch.nonzero(x).squeeze(1))


@pytest.mark.parametrize("n", [*SIZES, 80_001])  # the last: programs loop over blocks
def test_stats_match_float64_torch(n):
    x = _laplace(n, seed=n + 1)
    x[::5] = 0.0
    a = x.abs().double()
    t = float(x.abs().median())
    shift = t / 3 + 1e-9  # not a float32 value: must reach the kernel as a double
    got = kernels.stats(x, above=t, shift=shift, squares=True, extremes=True, logs=True)
    above = a[x.abs() > t]
    y = above - shift
    nz = a[a != 0]
    assert got[0] == above.numel() and got[5] == nz.numel()
    assert got[1] == pytest.approx(float(y.sum()), rel=1e-12, abs=1e-300)
    assert got[2] == pytest.approx(float((y * y).sum()), rel=1e-12, abs=1e-300)
    # as the CPU kernels: the max over all elements, the min over those counted
    assert got[3] == float(a.max())
    assert got[4] == (float(above.min()) if above.numel() else float("inf"))
    assert got[6] == pytest.approx(float(nz.log().sum()), rel=1e-12)
    every = kernels.stats(x)
    assert every[0] == n and every[1] == pytest.approx(float(a.sum()), rel=1e-12)
    assert kernels.count(x, t) == int((x.abs() >= t).sum())
    assert kernels.count(x, t, strict=True) == above.numel()


@pytest.mark.parametrize("n", [1, 4097, 80_001])
def test_l2_norm_is_the_float64_norm_without_overflow(n):
    # 1e25² overflows float32: the squares must be added in float64
    x = _laplace(n, seed=n + 7) * 1e25
    got = kernels.l2_norm(x)
    assert got.dtype == torch.float64 and got.shape == (1,) and got.device == x.device
    assert float(got) == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-12)
    assert float(kernels.l2_norm(torch.zeros(n))) == 0.0


@pytest.mark.parametrize("n", [1, 1000, 300_001])
def test_sample_abs_reads_the_counter_stream_positions(n):
    x = _laplace(n, seed=5) * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    seed = 0x0123456789ABCDEF
    s = 2500
    got = kernels.sample_abs(x, s, *seed_words(seed))
    positions = counter_hash(torch.arange(s), seed).mul_(n).bitwise_right_shift_(32)
    assert torch.equal(got, x.abs()[positions])


@pytest.mark.parametrize("numel, nk, m", [(1, 1, 1), (10, 3, 4), (5000, 700, 400),
                                          (5000, 700, 5000), (100_000, 3000, 37)])
def test_dragonn_slots_equal_write_slots(numel, nk, m):
    g = torch.Generator().manual_seed(numel + nk)
    acc = torch.randn(numel, generator=g)
    keys = torch.randperm(numel, generator=g)[:nk].sort().values
    seeds = dragonn.draw_hash_seeds(g)
    index_bits, priority_bits = reference.priority_layout(numel)
    slots, values = kernels.dragonn_slots(keys, m, index_bits, priority_bits,
                                          tuple(seeds.tolist()), acc)
    ref = reference.write_slots(keys, m, seeds, numel)
    assert torch.equal(slots, ref)  # collisions (nk > m) resolved the same way
    assert torch.equal(values, torch.where(ref >= 0, acc[ref.clamp(min=0)], 0.0))
    bare, none = kernels.dragonn_slots(keys, m, index_bits, priority_bits,
                                       tuple(seeds.tolist()), acc, values=False)
    assert none is None and torch.equal(bare, ref)


def test_only_contiguous_float32_is_taken():
    assert kernels.supports(torch.ones(4))  # CPU tensors only under the interpreter
    assert not kernels.supports(torch.ones(4, dtype=torch.float64))
    assert not kernels.supports(torch.ones(4, 2).t())
    assert not kernels.supports(torch.ones(0))


@pytest.mark.parametrize("n", [1, 13, 80_001])
def test_all_finite_finds_every_nan_and_inf(n):
    x = _laplace(n, seed=9)
    assert kernels.all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in {0, n // 2, n - 1}:
            y = x.clone()
            y[where] = bad
            assert not kernels.all_finite(y)


def test_partials_are_reduced_over_several_chunks():
    # more partial rows than the final kernel reads at once (1024): sums carried across
    # chunks, max and min taken over all rows
    g = torch.Generator().manual_seed(3)
    part = torch.rand(7, 2500, generator=g, dtype=torch.float64)
    out = torch.empty(8, dtype=torch.float64)
    kernels._stats_final_kernel[(1,)](part, part.shape[1], out, R=1024)
    sums = part.sum(1)
    for j in (0, 1, 2, 5, 6):
        assert out[j].item() == pytest.approx(sums[j].item(), rel=1e-13)
    assert out[3] == part[3].max() and out[4] == part[4].min()


def test_self_test_passes_and_reports_a_broken_kernel(monkeypatch):
    assert kernels.self_test("cpu") is None

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    real_stats, real_dragonn = kernels.stats, kernels.dragonn_slots

    def wrong_squares(*args, **kwargs):
        got = list(real_stats(*args, **kwargs))
        got[2] *= 1.001
        return tuple(got)

    def wrong_nonzeros(*args, **kwargs):
        got = list(real_stats(*args, **kwargs))
        got[5] += kwargs.get("nonzeros", False)
        return tuple(got)

    def wrong_slots(keys, m, *args, **kwargs):
        slots, values = real_dragonn(keys, m, *args, **kwargs)
        return slots.roll(1), values

    cases = [
        ("count", lambda x, t, strict=False: -1, "count (strict=False) differs from torch"),
        ("select", broken, "RuntimeError: no kernel for this GPU"),
        ("stats", wrong_squares, "stats (above=False, squares=True, extremes=False, "
                                 "logs=False, nonzeros=False) differ from torch"),
        ("stats", wrong_nonzeros, "stats (above=False, squares=False, extremes=False, "
                                  "logs=False, nonzeros=True) differ from torch"),
        ("sample_abs", lambda x, s, k0, k1: torch.zeros(s),
         "sample_abs differs from the counter stream's positions"),
        ("dragonn_slots", wrong_slots, "dragonn_slots differs from write_slots"),
    ]
    for name, replacement, message in cases:
        with monkeypatch.context() as m:
            m.setattr(kernels, name, replacement)
            assert kernels.self_test("cpu") == message


@pytest.mark.parametrize("flags", [(False, False, False, False), (True, False, False, False),
                                   (False, True, False, False), (True, True, False, False),
                                   (False, False, True, False), (True, True, True, False),
                                   (False, False, False, True), (True, False, False, True)])
@pytest.mark.parametrize("above", [None, 0.0, 1e-3])
@pytest.mark.parametrize("nan", [False, True])
def test_stats_equal_the_cpu_kernels(flags, above, nan):
    # every field as compressors.kernels.cpu.stats gives it (the C++ library),
    # including zeros, a NaN, and `above` over which nothing or everything passes; the
    # nonzeros alone (SIDCo's first reads) too
    from compressors.kernels import cpu

    squares, extremes, logs, nonzeros = flags
    x = _laplace(9000, seed=2)
    x[::7] = 0.0
    if nan:
        x[100] = float("nan")
    shift = 2.5e-4
    got = kernels.stats(x, above=above, shift=shift, squares=squares, extremes=extremes,
                        logs=logs, nonzeros=nonzeros)
    want = cpu.stats(x, above=above, shift=shift, squares=squares, extremes=extremes,
                         logs=logs, nonzeros=nonzeros)
    if nonzeros:
        assert got[5] == int((x.abs() > 0).sum())  # (a NaN is not counted)
    want = (want.count, want.sum, want.sumsq, want.max, want.min, want.nonzero, want.log_sum)
    for field, (u, v) in enumerate(zip(got, want)):
        if v != v:  # NaN sums: both NaN
            assert u != u, field
        else:
            assert u == pytest.approx(v, rel=1e-12, abs=1e-300), field


def test_dragonn_slots_keep_the_priority_bits_beyond_2_to_31_elements():
    # numel > 2^31: 32 index bits leave 31 priority bits (the hash shifted right by one);
    # the keys are few, and without values acc is not read, so no large tensor is needed
    numel = 2**31 + 5
    g = torch.Generator().manual_seed(4)
    keys = torch.cat([torch.randint(0, 2**31, (600,), generator=g),
                      torch.tensor([2**31, 2**31 + 4])]).unique()
    seeds = dragonn.draw_hash_seeds(g)
    index_bits, priority_bits = reference.priority_layout(numel)
    assert priority_bits == 31
    slots, none = kernels.dragonn_slots(keys, 97, index_bits, priority_bits,
                                        tuple(seeds.tolist()), torch.zeros(1), values=False)
    assert none is None
    assert torch.equal(slots, reference.write_slots(keys, 97, seeds, numel))


@pytest.mark.parametrize("n", [1, 13, 2 * 4096 + 37])
@pytest.mark.parametrize("strict", [False, True])
def test_select_reads_a_threshold_held_on_the_device(n, strict):
    # the same positions and values whether the threshold comes as a float or as a
    # one-element tensor the kernels read (DGC's threshold, never copied to the host)
    x = _laplace(n, seed=n + 1)
    t = float(x.abs().kthvalue(max(1, n - 40)).values)  # one of the magnitudes: a tie
    want = kernels.select(x, t, strict=strict, values=True)
    got = kernels.select(x, torch.tensor([t]), strict=strict, values=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = torch.nonzero(x.abs() > t if strict else x.abs() >= t).squeeze(1)
    assert torch.equal(got[0], ref)
    with pytest.raises(ValueError, match="one float32"):
        kernels.select(x, torch.tensor([t], dtype=torch.float64))


def test_sample_abs_reads_its_seed_from_the_device():
    x = _laplace(300_001, seed=6)
    seed = 0xFEDCBA9876543210
    words = torch.tensor(seed_words(seed), dtype=torch.int64)
    positions = counter_hash(torch.arange(4000), seed).mul_(300_001).bitwise_right_shift_(32)
    assert torch.equal(kernels.sample_abs(x, 4000, words), x.abs()[positions])
    with pytest.raises(ValueError, match="two int64"):
        kernels.sample_abs(x, 10, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("numel, kept, m", [(1, 1, 1), (13, 5, 4), (2 * 4096 + 37, 700, 400),
                                            (2 * 4096 + 37, 700, 5000), (100_000, 3000, 37),
                                            (5000, 0, 16)])
def test_dragonn_encode_writes_the_slots_of_select_then_write_slots(numel, kept, m):
    # one read of acc with the threshold and seeds on the device gives exactly the slots
    # and values of the two-step path (compaction, then the hash write), collisions
    # included, and counts the candidates
    g = torch.Generator().manual_seed(numel + m)
    acc = _laplace(numel, seed=numel + kept)
    acc[numel // 2] = -acc[numel // 3] if numel > 2 else acc[0]  # a tie of magnitudes
    if kept:
        t = float(acc.abs().kthvalue(numel - kept + 1).values)
    else:
        t = float(acc.abs().max()) * 2
    keys = torch.nonzero(acc.abs() >= t).squeeze(1)
    seeds = dragonn.draw_hash_seeds(g)
    layout = reference.priority_layout(numel)
    ref = reference.write_slots(keys, m, seeds, numel)
    for check in (False, True):
        slots, values, found = kernels.dragonn_encode(acc, torch.tensor([t]), m, *layout,
                                                      seeds, check_finite=check)
        assert torch.equal(slots, ref)
        assert torch.equal(values, torch.where(ref >= 0, acc[ref.clamp(min=0)], 0.0))
        assert found.tolist() == [keys.numel(), 0]


def test_dragonn_encode_flags_nan_and_inf_only_when_asked():
    acc = _laplace(3 * 4096 + 5, seed=12)
    t = torch.tensor([float(acc.abs().kthvalue(acc.numel() - 30).values)])
    seeds = torch.tensor([7, 2**32 - 1])
    layout = reference.priority_layout(acc.numel())
    for where in (0, 4096 + 1000, acc.numel() - 1):
        for bad in (float("nan"), float("inf")):
            y = acc.clone()
            y[where] = bad
            assert int(kernels.dragonn_encode(y, t, 64, *layout, seeds, check_finite=True)[2][1])
            assert int(kernels.dragonn_encode(y, t, 64, *layout, seeds)[2][1]) == 0
    with pytest.raises(ValueError, match="two int64"):
        kernels.dragonn_encode(acc, t, 64, *layout, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="tensor on the device"):
        kernels.dragonn_encode(acc, 0.5, 64, *layout, seeds)


# ----------------------------------------------------------------------------------------
# SIDCo's device-side stages (compressors/kernels/cuda_sidco.py, sidco_pipeline.select_device)


def _sidco(name: str, ratio: float):
    import compressors
    from compressors.base import Context

    s = compressors.build(name, ratio=ratio)
    stage_count = s.initial_stages

    def ctx(check_finite: bool = False):
        return Context(rank=0, world_size=1, step=0, name="g", state={},
                       generator=torch.Generator(), shared_seed=0, check_finite=check_finite)
    return s, stage_count, ctx


def _device(fits, acc, stages, ctx, k, **kwargs):
    """sidco_pipeline.select_device for a variant, with a step's Context."""
    return sidco_pipeline.select_device(acc, k, stages, fits, ctx.state, ctx.check_finite,
                                        **kwargs)


def _host(fits, acc, stages, ctx, k):
    """sidco_pipeline.select_host for a variant, with a step's Context."""
    return sidco_pipeline.select_host(acc, k, stages, fits, ctx.state, ctx.check_finite)


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3])
@pytest.mark.parametrize("n", [50_000, 123_457])
def test_sidco_device_stages_select_what_the_host_path_selects(name, ratio, n):

    s, stage_count, ctx = _sidco(name, ratio)
    acc = _laplace(n, seed=n)
    k = max(1, int(ratio * n))
    got, threshold, speculated = _device(s, acc, stage_count, ctx(), k)
    want, host_threshold, _ = _host(s, acc, stage_count, ctx(), k)
    ref, ref_threshold = s.select_reference(acc, stage_count)
    assert got.indices.dtype == torch.int64 and torch.equal(got.indices, ref)
    assert torch.equal(got.values, acc[ref])  # signed, as sent
    assert sidco_pipeline.same_selection(got, want) and speculated is None
    # the same fits; the sums are added in another order than on the host path
    assert threshold == pytest.approx(host_threshold, rel=1e-12)
    assert threshold == pytest.approx(ref_threshold, rel=1e-12)
    assert 0.5 * k <= got.indices.numel() <= 2 * k + 8


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp"])
def test_sidco_device_stages_flag_what_the_host_path_decides(monkeypatch, name):
    from compressors.kernels.types import NonFinite

    s, stage_count, ctx = _sidco(name, 0.001)
    acc = _laplace(60_001, seed=4)
    assert _device(s, torch.zeros(60_001), stage_count, ctx(), 60) == (None, 0.0, None)
    # a mean that needs rescaling: the reference path's (None), as on the host
    assert _device(s, acc * 1e-10, stage_count, ctx(), 60) is None
    assert _host(s, acc * 1e-10, stage_count, ctx(), 60) is None
    bad = acc.clone()
    bad[777] = float("nan")
    with pytest.raises(NonFinite):
        _device(s, bad, stage_count, ctx(check_finite=True), 60)
    assert _device(s, bad, stage_count, ctx(), 60) is None  # left to the reference path
    # what the device path does not decide goes to the host path, with its result
    redone = _spy_host(monkeypatch)
    constant = torch.full((60_001,), 0.5)  # GP: a point mass; E: nothing above stage 1
    constant[::3] = -0.5
    got = _device(s, constant, stage_count, ctx(), 60)
    assert redone and redone[-1] is constant
    ref, _ = s.select_reference(constant, stage_count)
    assert torch.equal(got[0].indices.long(), ref)
    assert ref.numel() == (60_001 if name == "sidco_gp" else 0)


def test_sidco_device_pool_past_its_buffer_is_flagged():
    from compressors.kernels import cuda_sidco as dev

    acc = _laplace(30_000, seed=2)
    stages = dev.Stages(acc, 2)
    t = float(acc.abs().kthvalue(29_000).values)  # 1000 above it
    stages.set(0, t)
    pool = stages.compact(stages.source(), 0, 0.0, cap=999)
    assert int(pool.count) == 1000  # the size before the cap
    assert int(stages.board[0]) == dev.FLAG_REDO | dev.FLAG_OVERFLOW
    stages = dev.Stages(acc, 2)
    stages.set(0, t)
    pool = stages.compact(stages.source(), 0, 0.0, cap=1000)
    assert stages.board[0] == 0
    want = torch.nonzero(acc.abs() > t).squeeze(1)
    assert torch.equal(pool.positions, want) and torch.equal(pool.values, acc[want])
    # a final threshold at the pool's own: elements equal to it are outside the pool
    stages.set(1, t)
    out = stages.final(pool, 1, pool, 0)
    flags, total, thresholds = stages.read()
    assert flags == dev.FLAG_REDO and thresholds == [t, t]
    # above it: the pool holds the selection
    stages = dev.Stages(acc, 2)
    stages.set(0, t)
    pool = stages.compact(stages.source(), 0, 0.0, cap=1000)
    t2 = float(acc.abs().kthvalue(29_900).values)
    stages.set(1, t2)
    out = stages.final(pool, 1, pool, 0)
    flags, total, _ = stages.read()
    want = torch.nonzero(acc.abs() >= t2).squeeze(1)
    assert flags == 0 and total == want.numel() == 101
    assert torch.equal(out.positions[:total], want) and torch.equal(out.values[:total], acc[want])


@pytest.mark.parametrize("strict", [True, False])
def test_sidco_device_compaction_of_a_pool_keeps_acc_positions_and_order(strict):
    # one pass (_compact_kernel) over a pool of several tiles whose buffer holds more
    # than its count: what lies past the count is never taken, positions are acc's
    from compressors.kernels import cuda_sidco as dev

    n = 5 * dev.COMPACT_BLOCK + 77
    acc = _laplace(n, seed=31)
    acc[9] = -acc[10]  # a tie of magnitudes with opposite signs
    stages = dev.Stages(acc, 3)
    t0 = float(acc.abs().kthvalue(n // 4).values)
    stages.set(0, t0)
    pool = stages.compact(stages.source(), 0, 0.0, cap=n)  # about 3n/4 in a buffer of n
    count = int(pool.count)
    want = torch.nonzero(acc.abs() > t0).squeeze(1)
    assert count == want.numel() < n and stages.board[0] == 0
    assert torch.equal(pool.positions[:count], want)
    pool.values[count:] = 1.0  # would pass any threshold if read
    t1 = float(acc.abs()[10])
    stages.set(1, t1)
    inner = stages.compact(pool, 1, 0.0, strict=strict, cap=n)
    got = int(inner.count)
    mask = acc.abs() > t1 if strict else acc.abs() >= t1
    want = torch.nonzero(mask & (acc.abs() > t0)).squeeze(1)
    assert got == want.numel() and stages.board[0] == 0
    assert torch.equal(inner.positions[:got], want)
    assert torch.equal(inner.values[:got], acc[want])  # signed
    assert (10 in inner.positions[:got].tolist()) == (not strict)
    # the look-back region is sized for slots + 1 passes that compact; one more is a
    # caller's bug
    stages.compact(pool, 1, 0.0, cap=n)
    stages.compact(pool, 1, 0.0, cap=n)
    with pytest.raises(RuntimeError, match="more passes that compact"):
        stages.compact(pool, 1, 0.0, cap=n)
    # and its partials' buffer for the speculative read's and one later stage's a slot
    stages = dev.Stages(acc, 1)
    stages.set(0, t0)
    tiles = -(-n // dev.SPEC_BLOCK)
    stages._partials.take(7, tiles), stages._partials.take(3, tiles)
    stages.later(stages.source(), 0, 0, above=True, gp=False, wanted=0.1 * n, left=1)
    assert stages.read()[2][0] > t0
    with pytest.raises(RuntimeError, match="more partials"):
        stages._partials.take(1)


def test_sidco_device_compaction_gives_up_on_a_silent_tile():
    # as the speculative read: a tile whose predecessor never publishes (no program takes
    # tile 0: tickets start at 1) stops waiting after SPIN polls and flags the step for
    # the host path (the count, written by the tile with the last ticket, is not checked:
    # the step is redone)
    from compressors.kernels import cuda_sidco as dev

    progs = 4
    n = progs * dev.COMPACT_BLOCK
    x = _laplace(n, seed=12)
    stages = dev.Stages(x, 2)
    stages.set(0, float(x.abs().median()))
    words = torch.zeros(progs + 1, dtype=torch.int64)
    words[0] = 1
    count = torch.zeros(1, dtype=torch.int64)
    pos, val = torch.empty(n, dtype=torch.int64), torch.empty(n)
    dev._compact_kernel[(progs - 1,)](
        x, n, count, stages.t32, 0, words, pos, val, pos, n, count, stages.board, 0, count, 0,
        STRICT=True, MAPPED=False, N_PTR=False, FINAL=False, HAS_BASE=False,
        BLOCK=dev.COMPACT_BLOCK, SPIN=8, num_warps=dev.COMPACT_WARPS)
    assert int(stages.board[0]) == dev.FLAG_REDO
    assert int(words[0]) == progs and int(words[-1]) & 3 == 2  # every tile published


@kernels.triton.jit
def _look_back_probe(words_ptr, tile, local_ptr, out_ptr, SPIN: kernels.tl.constexpr):
    tl = kernels.tl
    local = tl.load(local_ptr.to(tl.pointer_type(tl.uint64)))
    prefix, found = gpu_sidco._running_offsets(words_ptr.to(tl.pointer_type(tl.uint64)),
                                               tile, local, SPIN)
    tl.store(out_ptr, prefix.to(tl.int64))
    tl.store(out_ptr + 1, found.to(tl.int64))


def _look_back(words: list[int], tile: int, local: int, spin: int) -> tuple[int, bool, int]:
    """gpu_sidco._running_offsets run by one program over `words` (each (value << 2) |
    flag): (prefix, found, the tile's word afterwards)."""
    buf = torch.tensor(words, dtype=torch.int64)
    out = torch.zeros(2, dtype=torch.int64)
    _look_back_probe[(1,)](buf, tile, torch.tensor([local]), out, SPIN=spin)
    return int(out[0]), bool(out[1]), int(buf[tile])


# tile: (its number, tiles with an inclusive sum (flag 2), tiles never heard from (flag 0),
# the first tile whose count the prefix holds, found); the rest publish their count (flag
# 1). With tile 70 the first window reads tiles 69..38, the second 37..6.
LOOK_BACK_CASES = {
    "sum_far_back": (70, [5], [], 5, True),
    "sum_at_the_end_of_a_window": (70, [38], [], 38, True),
    "sum_at_the_start_of_the_next": (70, [37], [], 37, True),
    "sum_nearer_than_a_gap": (70, [60], [50], 60, True),
    "gap_nearer_than_a_sum": (70, [50], [60], 61, False),  # what it added before it
    "none_to_the_start": (40, [], [], 0, True),
    "first_tile": (0, [], [], 0, True),
    "sum_just_before": (33, [32], [], 32, True),
    "silent_tile": (50, [], [20], 21, False),
}


@pytest.mark.parametrize("case", sorted(LOOK_BACK_CASES))
def test_look_back_adds_words_back_to_the_first_sum(case):
    # the look-back's window of LOOK_BACK words: aggregates (flag 1) added back to the
    # nearest inclusive sum (flag 2, whose value counts from tile 0) or tile 0, across
    # windows; a tile never heard from ends the wait after SPIN polls with found False
    from compressors.kernels import cuda_sidco as dev

    assert dev.LOOK_BACK == 32
    tile, inclusive, gaps, first, want_found = LOOK_BACK_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    agg = torch.randint(0, 1 << 20, (tile + 8,), generator=g).tolist()
    flags = [1] * len(agg)
    for t in inclusive:
        flags[t] = 2
    for t in gaps:
        flags[t] = 0
    words = [(a << 2) | f if f else 0 for a, f in zip(agg, flags)]
    words[tile:] = [0] * (len(words) - tile)
    local = 12_345
    prefix, found, mine = _look_back(words, tile, local, spin=4)
    assert found == want_found and prefix == sum(agg[first:tile])
    assert mine == ((prefix + local) << 2) | 2


def test_sidco_device_pools_get_more_capacity_after_one_outgrew_its_buffer():

    s, stage_count, ctx = _sidco("sidco_e", 0.001)
    acc = _laplace(123_457, seed=8)
    state = ctx()
    state.state["pool_capacity"] = 1e-6  # buffers of 4096: the first pool (~6%) overflows
    got = _device(s, acc, stage_count, state, 123)
    assert sidco_pipeline.same_selection(got[0], _host(s, acc, stage_count, ctx(), 123)[0])
    assert state.state["pool_capacity"] == 2e-6
    state.state["pool_capacity"] = sidco_pipeline.POOL_CAPACITY
    _device(s, acc, stage_count, state, 123)
    assert state.state["pool_capacity"] == sidco_pipeline.POOL_CAPACITY  # no overflow: unchanged


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp"])
def test_sidco_device_stages_copy_to_the_host_once(monkeypatch, name):
    # the host-driven path's calls each wait for the device (8 at δ = 0.001: five
    # statistics, two compactions, the selection); the device path's one copy is the board
    from compressors.kernels import cuda_sidco as dev
    from compressors.kernels import ops

    def waits(*args, **kwargs):
        raise AssertionError("a host-driven call (it waits for the device)")

    for fn in ("stats", "select", "count", "pool", "all_finite"):
        monkeypatch.setattr(ops, fn, waits)
        if hasattr(kernels, fn):
            monkeypatch.setattr(kernels, fn, waits)
    reads = []
    real = dev.Stages.read

    def read(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(dev.Stages, "read", read)
    s, stage_count, ctx = _sidco(name, 0.001)
    got = _device(s, _laplace(123_457, seed=3), stage_count, ctx(), 123)
    assert stage_count == 5 and got[0].indices.numel() > 0 and reads == [1]
    # and so does a step whose first read is speculative
    state = ctx()
    taken = [_device(s, g, stage_count, state, 123)[2] for g in _growing(123_457, 3)]
    assert taken == [None, None, True] and reads == [1] * 4


def _growing(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """A gradient that grows 2% a step, plus fresh noise: thresholds a guess can follow."""
    base = _laplace(n, seed=seed)
    return [base * (1 + 0.02 * step) + 0.1 * _laplace(n, seed=seed + 1 + step)
            for step in range(steps)]


def _speculative_step(fits, acc, stage_count, on_device, on_host, k):
    """One step on the device and on the host, each with its own state: the device's
    selection is the reference's and the host path's, at the same threshold; whether the
    device's first read was speculative (None: no history yet)."""
    got, threshold, speculated = _device(fits, acc, stage_count, on_device, k)
    want, host_threshold, _ = _host(fits, acc, stage_count, on_host, k)
    ref, ref_threshold = fits.select_reference(acc, stage_count)
    assert torch.equal(got.indices, ref) and torch.equal(got.values, acc[ref])
    assert sidco_pipeline.same_selection(got, want)
    assert threshold == pytest.approx(host_threshold, rel=1e-12)
    assert threshold == pytest.approx(ref_threshold, rel=1e-12)
    return speculated


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("ratio", [0.001, 0.01])
def test_sidco_device_speculative_read_selects_what_the_host_path_selects(name, ratio):

    s, stage_count, ctx = _sidco(name, ratio)
    on_device, on_host = ctx(), ctx()
    n = 3 * 4096 * 5 + 77  # many tiles of the read, the last one ragged
    k = max(1, int(ratio * n))
    taken = []
    for acc in _growing(n, 5):
        taken.append(_speculative_step(s, acc, stage_count, on_device, on_host, k))
    # no history on the first two steps; the guess held on the others
    assert taken == [None, None, True, True, True]


def _zero_heavy(n: int, zeros: float, seed: int) -> torch.Tensor:
    """Laplace values with round(zeros·n) of them (positions drawn once) exactly zero."""
    x = _laplace(n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x[torch.randperm(n, generator=g)[:round(zeros * n)]] = 0.0
    return x


def _spy_host(monkeypatch) -> list:
    """Records each call of the host-driven path (a step the device path redid)."""

    redone = []
    real = sidco_pipeline.select_host

    def host(*args, **kwargs):
        redone.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(sidco_pipeline, "select_host", host)
    return redone


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("zeros, ratio, stage_count, device_decides", [
    (0.9, 0.001, 5, True),  # stage 1 at δ₁ of the nonzeros, later ratios from the counts
    (0.99, 0.001, 5, True),  # ρ = δ·d/n₀ = 0.1
    (0.97, 0.01, 4, True),  # ρ ≥ δ₁: one stage; the later pools keep their ties
    (0.97, 0.01, 2, True),
    (0.995, 0.01, 4, False),  # ρ ≥ 1: every nonzero kept (the host finds the smallest)
    (0.0, 0.3, 3, True),  # δ ≥ δ₁: one stage whatever M
])
def test_sidco_device_stages_on_zero_heavy_tensors_select_what_the_host_path_selects(
        monkeypatch, name, zeros, ratio, stage_count, device_decides):
    # stage 1 fits the nonzeros the first read counts, its schedule and each later
    # stage's ratio decided on the device: the same selection and thresholds as the
    # host-driven path and the reference, with no redo except where ρ ≥ 1 (SIDCo-P's
    # gamma stage is fitted on the host, which then decides every case)

    s, _, ctx = _sidco(name, ratio)
    n = 60_013
    acc = _zero_heavy(n, zeros, seed=int(zeros * 1000))
    k = max(1, int(ratio * n))
    redone = _spy_host(monkeypatch)
    got, threshold, _ = _device(s, acc, stage_count, ctx(), k)
    assert bool(redone) == (not device_decides and name != "sidco_p")
    want, host_threshold, _ = _host(s, acc, stage_count, ctx(), k)
    ref, ref_threshold = s.select_reference(acc, stage_count)
    assert torch.equal(got.indices.long(), ref) and torch.equal(got.values, acc[ref])
    assert sidco_pipeline.same_selection(got, want)
    assert threshold == pytest.approx(host_threshold, rel=1e-12)
    assert threshold == pytest.approx(ref_threshold, rel=1e-12)
    wanted = min(ratio * n, int(torch.count_nonzero(acc)))
    assert 0.5 * wanted <= got.indices.numel() <= 2 * wanted


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp"])
def test_sidco_device_stages_stop_where_a_pool_holds_no_more_than_k(monkeypatch, name):
    # two clusters of magnitudes above a small bulk: a later stage's pool holds no more
    # than k (the stop word on the board keeps the thresholds after it); the device path
    # selects what the host-driven path and the reference select, at every stage count

    n = 60_013
    acc = torch.rand(n, generator=torch.Generator().manual_seed(4)) * 1e-3
    acc[n - 3000:n - 40] = -1.0
    acc[n - 40:] = 2.0  # fewer than k = 60
    s, _, ctx = _sidco(name, 0.001)
    for stage_count in (2, 3, 5, 7):
        got, threshold, _ = _device(s, acc, stage_count, ctx(), 60)
        ref, ref_threshold = s.select_reference(acc, stage_count)
        assert torch.equal(got.indices.long(), ref) and torch.equal(got.values, acc[ref])
        assert threshold == pytest.approx(ref_threshold, rel=1e-12)
        assert sidco_pipeline.same_selection(got, _host(s, acc, stage_count, ctx(), 60)[0])


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("zeros, ratio, speculates", [(0.9, 0.001, True),
                                                      (0.97, 0.01, False)])
def test_sidco_device_speculative_read_on_zero_heavy_tensors(name, zeros, ratio, speculates):
    # the speculative read counts the nonzeros for stage 1 too; where stage 1 is the only
    # stage no second threshold is guessed

    s, stage_count, ctx = _sidco(name, ratio)
    on_device, on_host = ctx(), ctx()
    n = 3 * 4096 * 5 + 77
    k = max(1, int(ratio * n))
    g = torch.Generator().manual_seed(9)
    zero = torch.randperm(n, generator=g)[:round(zeros * n)]
    taken = []
    for acc in _growing(n, 5, seed=4):
        acc[zero] = 0.0
        taken.append(_speculative_step(s, acc, stage_count, on_device, on_host, k))
    assert taken == ([None, None, True, True, True] if speculates else [None] * 5)


def test_sidco_device_speculation_that_misses_is_redone_without_it():

    s, stage_count, ctx = _sidco("sidco_gp", 0.001)
    state = ctx()
    grads = _growing(123_457, 4, seed=3)
    grads[3] = grads[3] * 3  # thresholds 3× the guess: outside its window
    taken = [_device(s, acc, stage_count, state, 123)[2] for acc in grads[:3]]
    assert taken == [None, None, True]
    got, threshold, speculated = _device(s, grads[3], stage_count, state, 123)
    ref, ref_threshold = s.select_reference(grads[3], stage_count)
    assert speculated is False and torch.equal(got.indices, ref)
    assert threshold == pytest.approx(ref_threshold, rel=1e-12)
    assert not state.state["speculation"]["would_hold"]  # none on the next step
    assert _device(s, grads[3], stage_count, state, 123)[2] is None


def _spec_input(case: str) -> torch.Tensor:
    """Inputs of the speculative read: Laplace values over several tiles with a ragged last
    one (two zeros), with whole tiles and a third of the rest exactly zero, within one
    partial tile, exactly one tile, and all zero."""
    from compressors.kernels import cuda_sidco as dev

    if case == "laplace":
        x = _laplace(7 * dev.SPEC_BLOCK + 1234, seed=21)
        x[100] = x[5000] = 0.0
    elif case == "zero_tiles":
        x = _zero_heavy(7 * dev.SPEC_BLOCK + 1234, 1 / 3, seed=22)
        x[dev.SPEC_BLOCK:3 * dev.SPEC_BLOCK] = 0.0
        x[-700:] = 0.0
    elif case == "partial_tile":
        x = _laplace(13, seed=23)
    elif case == "one_tile":
        x = _laplace(dev.SPEC_BLOCK, seed=24)
    else:
        x = torch.zeros(5000)
    return x


def _spec_bounds(x: torch.Tensor) -> tuple[float, float, float]:
    """(window, upper, pool_above) at the 70%, 80% and 93% points of |x|'s magnitudes (some
    ties across the buffers' edges), and 2^-100 (a float32) where every element is zero."""
    a = x.abs().sort().values
    return tuple(max(float(a[int(q * (a.numel() - 1))]), 2.0**-100) for q in (0.70, 0.80, 0.93))


@pytest.mark.parametrize("case", ["laplace", "zero_tiles", "partial_tile", "one_tile",
                                  "all_zero"])
def test_sidco_device_speculative_read_keeps_the_window_and_the_pool_in_order(case):
    from compressors.kernels import cuda as gpu
    from compressors.kernels import cuda_sidco as dev

    x = _spec_input(case)
    n = x.numel()
    a = x.abs()
    w, u, pa = _spec_bounds(x)
    stages = dev.Stages(x, 3)
    spec = stages.speculate(w, u, pa, pa_slot=2, squares=True, mid_squares=True, logs=True,
                            keep_window=0.1, keep_pool=0.07)
    window = (a >= w) & (a < u)
    pool = torch.nonzero(a > pa).squeeze(1)
    nw, npool = int(window.sum()), pool.numel()
    assert (nw > 0 and npool > 0) == (case != "all_zero")
    assert spec.window.count.tolist() == [nw] and spec.pool.count.tolist() == [npool]
    assert torch.equal(spec.window.values[:nw], a[window])
    assert torch.equal(spec.pool.positions[:npool], pool)
    assert torch.equal(spec.pool.values[:npool], x[pool])  # signed
    # stage 1's partials reduce to gpu.stats' (nonzeros and logs too), and the mid's to
    # the sums of z = |x| − u over |x| ≥ u
    want = gpu.stats(x, squares=True, logs=True)
    got = gpu.reduce_stats(spec.part)
    assert got[0] == want[0] == n and got[5] == want[5] == int((x != 0).sum())
    for i in (1, 2, 6):
        assert got[i] == pytest.approx(want[i], rel=1e-12)
    z = a[a >= u].double() - u
    mid = spec.mid.sum(dim=1)
    assert int(mid[0]) == z.numel()
    assert float(mid[1]) == pytest.approx(float(z.sum()), rel=1e-12)
    assert float(mid[2]) == pytest.approx(float((z * z).sum()), rel=1e-12)
    flags, _, thresholds = stages.read()
    assert flags == 0 and thresholds[2] == pa  # the pool's bound, for the final check
    # buffers too small (when more passes than the 4096 they keep at least): flagged,
    # with the sizes before the caps
    stages = dev.Stages(x, 3, capacity=0.0)
    spec = stages.speculate(w * 0.5, u, pa * 0.5, pa_slot=2, squares=False,
                            mid_squares=False, logs=False, keep_window=0.0, keep_pool=0.0)
    assert spec.window.cap == spec.pool.cap == min(n, 4096)
    counts = (int(((a >= w * 0.5) & (a < u)).sum()), int((a > pa * 0.5).sum()))
    assert (spec.window.count.tolist(), spec.pool.count.tolist()) == ([counts[0]], [counts[1]])
    overflow = max(counts) > min(n, 4096)
    assert overflow == (case in ("laplace", "zero_tiles"))
    assert stages.read()[0] == (dev.FLAG_REDO | dev.FLAG_OVERFLOW if overflow else 0)


def _claims_landed_in(order: torch.Tensor, tiles: torch.Tensor, claimed: tuple):
    """The speculative read's claims (tiles: packed counts and claimed starts, as
    _spec_read_kernel leaves them; claimed: the buffers it wrote) as they would be had the
    tiles claimed their ranges in `order` (on a GPU, the order their atomics land in):
    each tile's entries moved to its new range. Where a buffer was too small, entries
    that the reads in both orders do not both hold are NaN (positions -1): garbage."""
    bits = gpu_sidco._COUNT_BITS
    low = (1 << bits) - 1
    local, start = tiles[0], tiles[1]
    moved = tuple(torch.full_like(b, -1 if b.dtype == torch.int32 else float("nan"))
                  for b in claimed)
    fields = ((local & low, start & low, (claimed[0],), (moved[0],)),
              (local >> bits, start >> bits, claimed[1:], moved[1:]))
    new_starts = []
    for counts, starts, sources, targets in fields:
        new = torch.zeros_like(starts)
        at = 0
        for t in order.tolist():
            c, s0 = int(counts[t]), int(starts[t])
            new[t] = at
            for src, dst in zip(sources, targets):
                m = max(0, min(c, src.numel() - s0, dst.numel() - at))
                dst[at:at + m] = src[s0:s0 + m]
            at += c
        new_starts.append(new)
    packed = (new_starts[1] << bits) | new_starts[0]
    return torch.stack([local, packed]), moved


def _claims_in_reverse(monkeypatch) -> None:
    """Every speculative read's tiles claim their ranges last tile first (the interpreter
    runs the programs in order, so their atomics land in tile order there)."""
    real = gpu_sidco._in_order

    def reversed_claims(tiles, claim, claimed, totals):
        order = torch.arange(tiles.shape[1] - 1, -1, -1)
        moved_tiles, moved = _claims_landed_in(order, tiles, claimed)
        return real(moved_tiles, claim, moved, totals)

    monkeypatch.setattr(gpu_sidco, "_in_order", reversed_claims)


def test_sidco_device_speculative_read_puts_claims_from_any_order_back_in_acc_order():
    # on a GPU the tiles' atomics land in any order, here in the order the programs run:
    # the reordering gives the same buffers, bit for bit, for claims in other orders
    from compressors.kernels import cuda_sidco as dev

    x = _spec_input("zero_tiles")
    a = x.abs()
    w, u, pa = (dev._f32(b) for b in _spec_bounds(x))
    n, progs = x.numel(), -(-x.numel() // dev.SPEC_BLOCK)
    window = a[(a >= w) & (a < u)]
    pool = torch.nonzero(a > pa).squeeze(1)
    stages = dev.Stages(x, 3)
    claim = torch.zeros(1, dtype=torch.int64)
    tiles = torch.empty((2, progs), dtype=torch.int64)
    claimed = (torch.empty(n), torch.empty(n, dtype=torch.int32), torch.empty(n))
    part = torch.empty((7, progs), dtype=torch.float64)
    mid = torch.empty((3, progs), dtype=torch.float64)
    dev._spec_read_kernel[(progs,)](
        x, n, w, u, pa, dev._f64_bits(u), dev._f64_bits(pa), 2, part, mid, claim, tiles,
        claimed[0], n, claimed[1], claimed[2], n, stages.board, stages.t32, SQUARES=False,
        MID_SQUARES=False, LOGS=False, BLOCK=dev.SPEC_BLOCK, num_warps=dev.SPEC_WARPS)
    assert int(stages.board[0]) == 0
    assert int(claim) == (pool.numel() << dev._COUNT_BITS) | window.numel()
    g = torch.Generator().manual_seed(5)
    orders = [torch.arange(progs), torch.arange(progs - 1, -1, -1),
              torch.randperm(progs, generator=g), torch.randperm(progs, generator=g)]
    for order in orders:
        moved_tiles, moved = _claims_landed_in(order, tiles, claimed)
        assert order.tolist() == list(range(progs)) or not torch.equal(moved_tiles, tiles)
        totals = torch.full((2,), -1, dtype=torch.int64)
        win, positions, values = dev._in_order(moved_tiles, claim, moved, totals)
        assert totals.tolist() == [window.numel(), pool.numel()]
        assert torch.equal(win[:window.numel()], window)
        assert positions.dtype == torch.int64 and torch.equal(positions[:pool.numel()], pool)
        assert torch.equal(values[:pool.numel()], x[pool])


@pytest.mark.parametrize("claims", ["in_order", "reversed"])
def test_sidco_device_speculative_read_flags_nan_and_overflow(monkeypatch, claims):
    # also with the read's tiles claiming their ranges last first: the same selections
    # and thresholds, bit for bit, and a window past its buffer (its entries then depend
    # on that order) decides nothing: the host path's selection, more capacity later
    from compressors.kernels.types import NonFinite

    s, stage_count, ctx = _sidco("sidco_e", 0.001)
    grads = _growing(123_457, 4, seed=5)
    state = ctx(check_finite=True)
    in_order = []  # the same steps with the claims in tile order
    if claims == "reversed":
        in_order_state = ctx()
        in_order = [_device(s, g, stage_count, in_order_state, 123) for g in grads[:3]]
        _claims_in_reverse(monkeypatch)
    steps = [_device(s, g, stage_count, state, 123) for g in grads[:3]]
    assert [step[2] for step in steps] == [None, None, True]
    ref, _ = s.select_reference(grads[2], stage_count)
    assert torch.equal(steps[2][0].indices, ref)
    for got, want in zip(steps, in_order):
        assert torch.equal(got[0].indices, want[0].indices)
        assert torch.equal(got[0].values, want[0].values) and got[1] == want[1]
    bad = grads[3].clone()
    bad[4321] = float("inf")
    with pytest.raises(NonFinite):
        _device(s, bad, stage_count, state, 123)
    # the window and the pool past their buffers: the host path's selection, and more
    # capacity for later steps
    state.state["pool_capacity"] = 1e-6
    got = _device(s, grads[3], stage_count, state, 123)
    ref, _ = s.select_reference(grads[3], stage_count)
    assert torch.equal(got[0].indices.long(), ref)
    assert got[2] is True  # the guess held; the buffers were too small
    assert state.state["pool_capacity"] == 2e-6


def test_sidco_device_stage_two_decides_nothing_from_a_window_past_its_buffer():
    # the same read with the pool's bound above stage 2's threshold: with the whole
    # window, stage 2 flags the step MISS (the guess did not hold); with a window past its
    # buffer (which entries it holds depends on the order the tiles' claims land in) it
    # flags nothing: the read's overflow sends the step to the host path
    from compressors.kernels import cuda_sidco as dev

    s, _, _ = _sidco("sidco_e", 0.001)
    x = _laplace(7 * dev.SPEC_BLOCK + 1234, seed=25)
    n = x.numel()
    plain = dev.Stages(x, 3)
    plain.first(gp=False, ratio=s.ratio, first_ratio=s.first_stage_ratio, stages=3)
    t1 = plain.read()[2][0]
    w, u, pa = 0.5 * t1, 1.5 * t1, 0.5 * float(x.abs().max())
    window = int(((x.abs() >= dev._f32(w)) & (x.abs() < dev._f32(u))).sum())
    flags = {}
    for capacity, keep in ((4.0, 0.5), (0.0, 0.0)):
        stages = dev.Stages(x, 3, capacity)
        spec = stages.speculate(w, u, pa, pa_slot=2, squares=False, mid_squares=False,
                                logs=False, keep_window=keep, keep_pool=keep)
        stages.first(gp=False, ratio=s.ratio, first_ratio=s.first_stage_ratio, stages=3,
                     spec=spec)
        stages.second_from(spec, gp=False, wanted=s.ratio * n, left=2)
        assert (window > spec.window.cap) == (capacity == 0.0)
        flags[capacity] = stages.read()[0]
    assert flags == {4.0: dev.FLAG_MISS, 0.0: dev.FLAG_REDO | dev.FLAG_OVERFLOW}


def test_sidco_device_stages_check_passes_and_catches_a_wrong_selection(monkeypatch):
    from compressors import sidco

    for variant in (sidco.SIDCoExponential, sidco.SIDCoGeneralizedPareto):
        assert sidco_pipeline.check_device_stages(torch.device("cpu"), variant)
    real = sidco_pipeline.select_device

    def off_by_one(*args, **kwargs):
        chosen, threshold, spec = real(*args, **kwargs)
        return Selected(chosen.indices[1:], chosen.values[1:]), threshold, spec

    monkeypatch.setattr(sidco_pipeline, "select_device", off_by_one)
    with pytest.warns(RuntimeWarning, match="device-side stages are unusable.*differs"):
        assert not sidco_pipeline.check_device_stages(torch.device("cpu"),
                                                      sidco.SIDCoExponential)
