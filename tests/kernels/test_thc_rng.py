"""THC's counter-based random stream (compressors/kernels/counter_stream.py): the native
fused passes (compressors/kernels/thc_pipeline.py) and the pure-torch fallback give the same bits (signs, noise, rotated input,
indices, table values, clamped count, decode, uniform THC levels), the stream is the
documented function, and it is statistically adequate for what THC asks of it:
stochastic-rounding noise uniform on [0, 1) and independent between coordinates, RHT
signs balanced and uncorrelated (between neighbours, between seeds, between the sign and
the noise streams). The statistical checks are shown to have power: the same checks
reject deliberately weak streams.

The reference path is forced with GRADCOMP_NATIVE=0 (read at every call)."""

from __future__ import annotations

import math

import pytest
import torch

import compressors
from compressors import SimulatedGroup, thc
from compressors.kernels import cpu_thc as thc_native
from compressors.kernels import ops
from compressors.kernels.counter_stream import counter_hash, draw_seed, seed_words
from compressors.kernels.ops import l2_norm, stream_noise, stream_signs
from compressors.thc import RotatedGrid, interval_lut
from compressors.thc_table import get_table
from compressors.thc_uniform import uniform_encode

needs_native = pytest.mark.skipif(not ops.available(),
                                  reason=f"native kernels unavailable: {ops.error()}")

SEEDS = [0, 1, 7, 2**32 - 1, 2**32, 0xDEADBEEFCAFEBABE, 2**64 - 1]
SIZES = [1, 7, 8, 9, 1000, 2**15 + 3, 2**17 + 5]


def _reference(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        assert not ops.supports(torch.zeros(3)) and not ops.available()
        return fn()


def _py_hash(i: int, seed: int) -> int:
    """The documented function in plain Python integers (the specification)."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x735A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)

    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return mix(mix((i & 0xFFFFFFFF) ^ k0) ^ k1 ^ (i >> 32))


# ------------------------------------------------------------------ the function itself


def test_torch_hash_is_the_documented_function():
    idx = [0, 1, 2, 3, 1000, 2**20 + 17, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**33 + 9]
    for seed in SEEDS:
        got = counter_hash(torch.tensor(idx), seed).tolist()
        assert got == [_py_hash(i, seed) for i in idx], seed
    assert seed_words(0xDEADBEEFCAFEBABE) == (0xCAFEBABE, 0xDEADBEEF)


def test_noise_and_signs_derive_from_the_hash(monkeypatch):
    seed = 0x1234_5678_9ABC_DEF0
    n = 100
    h = [_py_hash(i, seed) for i in range(n)]
    for run in (lambda f: f(), lambda f: _reference(monkeypatch, f)):
        noise = run(lambda: stream_noise(n, seed))
        signs = run(lambda: stream_signs(n, seed, "cpu"))
        assert noise.tolist() == [(v >> 8) * 2.0**-24 for v in h]
        # one hash per 32 signs: s_i = −1 where bit i mod 32 of h(i // 32) is set
        assert signs.tolist() == [-1.0 if h[i // 32] >> (i % 32) & 1 else 1.0
                                  for i in range(n)]


def test_draw_seed_takes_64_bits_from_the_generator():
    g = torch.Generator().manual_seed(5)
    seeds = {draw_seed(g) for _ in range(200)}
    assert len(seeds) == 200
    assert max(seeds) >= 2**62 and all(0 <= s < 2**64 for s in seeds)
    assert len({s >> 32 for s in seeds}) > 190 and len({s & 0xFFFFFFFF for s in seeds}) > 190


# ------------------------------------------------------------------ native == torch


@needs_native
@pytest.mark.parametrize("n", SIZES)
def test_native_stream_equals_torch(monkeypatch, n):
    for seed in SEEDS:
        for make in (lambda: stream_noise(n, seed), lambda: stream_signs(n, seed, "cpu")):
            expected = _reference(monkeypatch, make)
            assert torch.equal(make(), expected), (n, seed)


@needs_native
def test_native_stream_beyond_2_to_the_32():
    """Indices ≥ 2^32 fold their high word in (kernel vs torch, at an offset)."""
    start, n = 2**32 - 12, 40
    for seed in SEEDS[:4]:
        h = counter_hash(torch.arange(start, start + n), seed)
        for aligned in (start, start + 4):  # the kernel's 8-lane and scalar paths
            got = thc_native.rng_fill(n - (aligned - start), seed, thc_native.NOISE,
                                      start=aligned)
            want = (h[aligned - start:] >> 8).float() * 2.0**-24
            assert torch.equal(got, want)
        # signs: word index i // 32 crosses 2^32 at i = 2^37
        sstart = 2**37 - 64
        words = counter_hash(torch.arange(sstart // 32, sstart // 32 + 4), seed)
        want = 1 - 2 * ((words[:, None] >> torch.arange(32)) & 1).flatten().float()
        assert torch.equal(thc_native.rng_fill(128, seed, thc_native.SIGNS, start=sstart), want)


def _laplace(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs())).to(torch.float32)


@needs_native
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits, granularity", [(4, 30), (2, 36), (8, 255)])
def test_native_encoding_equals_torch_bit_for_bit(monkeypatch, n, bits, granularity):
    """Rotated input (signs), indices, table values of every sum dtype and the clamped
    count: the same bits on both paths. b ≤ 4 takes the kernel's 8-lane comparison
    search, b = 8 its lookup-table path; n = 1, 7, 9 exercise the scalar tails."""
    x = _laplace(n, n) * 40  # a spread that clamps some coordinates
    if n > 3:
        x[:3] = 0.0  # signed zeros through the sign flip
    table = torch.tensor(get_table(bits, granularity, 1 / 32), dtype=torch.float32)
    lut = interval_lut(table)
    grid = RotatedGrid.make(n, float(x.norm()), 1 / 32, granularity, seed=0xABCDEF0123)

    def run():
        out = {"rotated": grid.rotate(x)}
        for dtype in (torch.uint8, torch.int32, torch.int64):
            if granularity > torch.iinfo(dtype).max:
                continue
            gen = torch.Generator().manual_seed(3)
            out[dtype] = grid.encode_values(x, table, gen, table_values=table.to(dtype),
                                            count_clamped=True, lut=lut)
        gen = torch.Generator().manual_seed(3)
        out["values_only"] = grid.encode_values(x, table, gen, table_values=table.to(
            torch.int32), indices=False)
        return out

    expected = _reference(monkeypatch, run)
    got = run()
    assert torch.equal(got["rotated"], expected["rotated"])
    assert torch.equal(got["rotated"].signbit(), expected["rotated"].signbit())
    for key in got.keys() - {"rotated"}:
        (z, values, clamped), (ez, ev, ec) = got[key], expected[key]
        assert clamped == ec
        assert (z is None) == (ez is None) and (z is None or torch.equal(z, ez)), key
        assert values.dtype == ev.dtype and torch.equal(values, ev), key
        if z is not None:
            assert z.dtype == torch.int32 and torch.equal(values, table.to(values.dtype)[z])
    assert got["values_only"][0] is None
    if n > 100:
        assert 0 < got[torch.int32][2] < n  # the clamp is exercised


@needs_native
@pytest.mark.parametrize("n", [1, 9, 2**15 + 3, 2**17 + 5])
def test_fused_rotation_and_encoding_equal_the_separate_kernels(n):
    """rotate_encode (input written in the FWHT's first pass, encoding in its last) equals
    rotate() then the standalone encoding kernel, on the single-block and the strip
    paths."""
    x = _laplace(n, 5 * n) * 30
    table = torch.tensor(get_table(4, 30, 1 / 32), dtype=torch.float32)
    lut, gaps = interval_lut(table), (table[1:] - table[:-1]).contiguous()
    padded = thc.next_power_of_two(n)
    rotated = thc_native.rotate(x, padded, float(x.norm()), 11)
    separate = thc_native.encode(rotated, thc.threshold(1 / 32), 30, table, gaps, lut, 12,
                                 value_dtype=torch.uint8)
    fused = thc_native.rotate_encode(x, padded, float(x.norm()), 11, thc.threshold(1 / 32),
                                     30, table, gaps, lut, 12, value_dtype=torch.uint8)
    assert torch.equal(fused[0], separate[0]) and torch.equal(fused[1], separate[1])
    assert fused[2] == separate[2]


@needs_native
@pytest.mark.parametrize("n", [1, 9, 1000, 2**16, 2**17 + 5])
def test_native_decode_equals_torch(monkeypatch, n):
    """The fused decompression (affine map in the FWHT's first pass, signs in its last)
    and the unfused one (per-chunk counts, lost chunks) against torch, every sum dtype."""
    grid = RotatedGrid.make(n, 3.5, 1 / 32, 30, seed=99)
    g = torch.Generator().manual_seed(n)
    for dtype in (torch.uint8, torch.int32, torch.int64):
        total = torch.randint(0, 90, (grid.padded,), dtype=dtype, generator=g)
        chunks = -(-grid.padded // 64)
        count = torch.randint(1, 4, (chunks,), generator=g)
        lost = torch.rand(chunks, generator=g) < 0.2

        def run():
            return (grid.decode(total, 3, 3), grid.decode(total, 2.0, 3),
                    grid.decode(total, count, 3, 64, lost))

        expected = _reference(monkeypatch, run)
        for got, want in zip(run(), expected):
            assert got.shape == (n,) and got.dtype == torch.float32
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@needs_native
@pytest.mark.parametrize("n", [1, 9, 1000, 2**17 + 5])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_native_uniform_encoding_equals_torch(monkeypatch, n, bits):
    x = _laplace(n, 2 * n)
    lo, hi = float(x.min()) - 0.1, float(x.max())

    def run():
        return uniform_encode(x, lo, hi, bits, torch.Generator().manual_seed(4))

    expected = _reference(monkeypatch, run)
    got = run()
    assert got.dtype == torch.uint8 and torch.equal(got, expected)
    assert int(got.max()) <= 2**bits - 1


@needs_native
@pytest.mark.parametrize("name, params", [
    ("thc", {}), ("thc", {"aggregation": "ps", "loss_rate": 0.05}), ("thc", {"bits": 8,
    "granularity": 255, "sum_dtype": "int32"}), ("thc_uniform", {})])
def test_native_protocol_equals_torch(monkeypatch, name, params):
    """Whole steps (3 workers, error feedback): the same aggregates and sent vectors.
    (The native norm sums in another order than torch's: the double ℓ may differ in its
    last bits; it is rounded to float32 where it scales, so the results agree.)"""
    grads = [_laplace(5000, r) * 1e-3 for r in range(3)]

    def run():
        group = SimulatedGroup(compressors.build(name, **params), 3, seed=5)
        return [group.step(grads) for _ in range(2)]

    expected = _reference(monkeypatch, run)
    for step_got, step_exp in zip(run(), expected):
        for o, e in zip(step_got, step_exp):
            assert torch.equal(o.aggregate, e.aggregate)
            assert torch.equal(o.sent.dense(5000), e.sent.dense(5000))


@needs_native
def test_native_norm_agrees_with_torch(monkeypatch):
    x = _laplace(300_001, 8) * 1e3
    expected = _reference(monkeypatch, lambda: l2_norm(x))
    assert float(l2_norm(x)) == pytest.approx(float(expected), rel=1e-12)


@needs_native
def test_native_passes_do_not_depend_on_the_thread_count():
    n = 3 * 2**17 + 11
    x = _laplace(n, 1)
    table = torch.tensor(get_table(4, 30, 1 / 32), dtype=torch.float32)
    grid = RotatedGrid.make(n, float(x.norm()), 1 / 32, 30, seed=17)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(grid.encode_values(x, table, torch.Generator().manual_seed(1),
                                           table_values=table.to(torch.uint8),
                                           count_clamped=True))
    finally:
        torch.set_num_threads(old)
    for z, v, c in outs[1:]:
        assert torch.equal(z, outs[0][0]) and torch.equal(v, outs[0][1]) and c == outs[0][2]


def test_signs_are_shared_and_noise_is_private():
    """Every rank rotates with the same signs (the step's shared seed), and each rank's
    rounding noise comes from its own generator: two workers with the same gradient send
    different indices, the same worker re-run sends the same."""
    x = _laplace(4096, 3)
    group = SimulatedGroup(compressors.build("thc"), 2, feedback="none", seed=1)
    outs = group.step([x, x])
    assert not torch.equal(outs[0].sent.dense(4096), outs[1].sent.dense(4096))
    again = SimulatedGroup(compressors.build("thc"), 2, feedback="none", seed=1).step([x, x])
    assert torch.equal(again[0].sent.dense(4096), outs[0].sent.dense(4096))


# ------------------------------------------------------------------ statistical quality

N = 2**20


def _uniformity(u: torch.Tensor) -> dict[str, float]:
    """z-score of the mean, normalised chi-square over 256 equal bins ((χ² − df)/√(2df)),
    KS distance × √n, and the max |z| of lag-1, 2, 3, 8 and 1024 correlations."""
    n = u.numel()
    u = u.double()
    mean_z = (float(u.mean()) - 0.5) / math.sqrt(1 / 12 / n)
    counts = torch.bincount((u * 256).long().clamp_(0, 255), minlength=256).double()
    expected = n / 256
    chi = float(((counts - expected) ** 2 / expected).sum())
    chi_z = (chi - 255) / math.sqrt(2 * 255)
    s = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = float(torch.maximum((grid - s).abs(), (s - (grid - 1 / n)).abs()).max()) * math.sqrt(n)
    c = u - 0.5
    lag_z = max(abs(float((c[:-k] * c[k:]).mean()) / (1 / 12)) * math.sqrt(n - k)
                for k in (1, 2, 3, 8, 1024))
    return {"mean_z": mean_z, "chi_z": chi_z, "ks": ks, "lag_z": lag_z}


def _pairs_chi_z(u: torch.Tensor, bins: int = 16) -> float:
    """(u_2i, u_2i+1) on a bins × bins grid: normalised chi-square (joint uniformity)."""
    a = (u[0::2] * bins).long().clamp_(0, bins - 1)
    b = (u[1::2] * bins).long().clamp_(0, bins - 1)
    counts = torch.bincount(a * bins + b, minlength=bins * bins).double()
    expected = a.numel() / bins**2
    df = bins * bins - 1
    return (float(((counts - expected) ** 2 / expected).sum()) - df) / math.sqrt(2 * df)


def _adequate(u: torch.Tensor) -> bool:
    # Thresholds at ~5 sigma (KS: 1.95 is the 0.1% point): a good stream fails with
    # probability ~1e-6 per check; the seeds are fixed, so the outcome is deterministic.
    st = _uniformity(u)
    return (abs(st["mean_z"]) < 5 and abs(st["chi_z"]) < 5 and st["ks"] < 1.95
            and st["lag_z"] < 5 and abs(_pairs_chi_z(u)) < 5)


@pytest.mark.parametrize("seed", [0, 1, 2**32, 0xDEADBEEFCAFEBABE])
def test_noise_is_uniform_and_independent(seed):
    u = stream_noise(N, seed)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    st = _uniformity(u)
    assert abs(st["mean_z"]) < 5 and abs(st["chi_z"]) < 5, st
    assert st["ks"] < 1.95 and st["lag_z"] < 5, st
    assert abs(_pairs_chi_z(u)) < 5
    # the low 8 of the 24 noise bits are uniform too (not just the leading ones)
    low = ((u * 2**24).long() & 255).double().add_(0.5).div_(256)
    assert abs(_uniformity(low)["chi_z"]) < 5
    # stochastic rounding's only requirement: P(u < f) = f
    for f in (2**-10, 0.1, 1 / 3, 0.5, 0.9):
        p = float((u < f).double().mean())
        assert abs(p - f) < 5 * math.sqrt(f * (1 - f) / N), f


def test_uniformity_checks_reject_weak_streams():
    """The checks above have power: the unmixed counter (i ^ k0), a Weyl sequence
    (i·golden + k0, equidistributed but serially dependent) and a single multiply
    without the finaliser's shifts each fail them, while the stream passes."""
    i = torch.arange(N, dtype=torch.int64)
    to_u = lambda h: (h >> 8).to(torch.float32) * 2.0**-24  # noqa: E731
    unmixed = to_u((i ^ 0x1234_5678) & 0xFFFFFFFF)
    weyl = to_u((i * 0x9E3779B9 + 0x1234_5678) & 0xFFFFFFFF)
    one_mul = to_u(((i ^ 0x1234_5678) * 0x21F0AAAD) & 0xFFFFFFFF)
    assert _adequate(stream_noise(N, 0x1234_5678))
    for weak in (unmixed, weyl, one_mul):
        assert not _adequate(weak)


def _corr_z(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    r = float((a * b).sum() / (a.norm() * b.norm()))
    return abs(r) * math.sqrt(a.numel())


@pytest.mark.parametrize("seed", [0, 5, 0xDEADBEEFCAFEBABE])
def test_signs_are_balanced_and_uncorrelated(seed):
    s = stream_signs(N, seed, "cpu")
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(s.sum())) < 5 * math.sqrt(N)  # balanced
    for lag in (1, 2, 3, 8, 1024):
        assert _corr_z(s[:-lag], s[lag:]) < 5, lag  # neighbours independent
    # streams of seeds one bit apart (in either word), and sign vs noise streams
    for other in (seed ^ 1, seed ^ (1 << 32), seed ^ (1 << 63), seed + 1):
        assert _corr_z(s, stream_signs(N, other, "cpu")) < 5, other
        assert _corr_z(s, stream_noise(N, other)) < 5, other
    assert _corr_z(s, stream_noise(N, seed)) < 5
    # bits at the same position of consecutive hash words (signs 32 apart) and the
    # first vs last bit of each word
    w = s.view(-1, 32)
    for b in (0, 7, 31):
        assert _corr_z(w[:-1, b], w[1:, b]) < 5, b
    assert _corr_z(w[:, 0], w[:, 31]) < 5
    # runs of equal signs: expected N/2 + 1 for independent fair signs
    runs = int((s[1:] != s[:-1]).sum()) + 1
    assert abs(runs - (N / 2 + 1)) < 5 * math.sqrt(N) / 2


def test_sign_checks_reject_weak_signs():
    """Power of the sign checks: alternating signs and the top bit of a Weyl sequence
    (long runs) fail them."""
    i = torch.arange(N, dtype=torch.int64)
    alternating = 1 - 2 * (i & 1).float()
    weyl = 1 - 2 * (((i * 0x9E3779B9 + 7) & 0xFFFFFFFF) >> 31).float()
    blocks = 1 - 2 * ((i >> 4) & 1).float()  # balanced, but in runs of 16
    for s in (alternating, weyl, blocks):
        runs = int((s[1:] != s[:-1]).sum()) + 1
        bad = (_corr_z(s[:-1], s[1:]) >= 5 or abs(runs - (N / 2 + 1)) >= 5 * math.sqrt(N) / 2
               or abs(float(s.sum())) >= 5 * math.sqrt(N))
        assert bad
