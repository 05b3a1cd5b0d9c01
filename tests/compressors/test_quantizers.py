"""SignSGD, EF-SignSGD, QSGD and TernGrad: unbiasedness against the exact per-coordinate
variance, majority vote, wire sizes, the levels/bucket trade-off, layer-wise scales,
bad parameters, 16-bit inputs and zeros."""

from __future__ import annotations

import math

import pytest
import torch

import compressors
from compressors import Segment, Session, SimulatedGroup
from compressors.kernels import ops
from compressors.quantize import pack_signs, unpack_signs
from repro.distributed import run
from repro.testing import run_ranks, with_threads

DRAWS = 2000
# max |z| over a few hundred coordinates of N(0, 1): 5.5 is exceeded with probability
# ~1e-5, while a rounding bias of one quantization step gives z ≈ √DRAWS ≈ 45.
Z_MAX = 5.5


def layout_of(*numels: int) -> tuple[Segment, ...]:
    out, offset = [], 0
    for i, n in enumerate(numels):
        out.append(Segment(f"t{i}", offset, n, (n,)))
        offset += n
    return tuple(out)


def draws(name: str, inputs: list[torch.Tensor], n: int = DRAWS, layout=None, **params):
    """n independent aggregates (fresh random rounding each step), as float64 rows."""
    group = SimulatedGroup(compressors.build(name, **params), len(inputs), seed=0)
    rows = [group.step(inputs, layout=layout)[0].aggregate for _ in range(n)]
    return torch.stack(rows).double()


def assert_unbiased(samples: torch.Tensor, expected: torch.Tensor, variance: torch.Tensor) -> float:
    """Per coordinate, |mean − expected| within Z_MAX standard errors of the exact
    variance; and the z-scores have unit mean square (the variance formula is right).
    Returns the largest |z|."""
    n = samples.shape[0]
    stderr = (variance / n).sqrt()
    floor = 1e-6 * expected.abs().max()  # float32 rounding where the variance is 0
    z = (samples.mean(0) - expected) / stderr.clamp_min(floor)
    assert z.abs().max() < Z_MAX, f"biased: max |z| = {z.abs().max():.2f}"
    random_coords = variance > (floor**2) * n
    mean_square = float((z[random_coords] ** 2).mean())
    k = int(random_coords.sum())
    assert abs(mean_square - 1) < 4 * math.sqrt(2 / k), f"variance off: E[z²] = {mean_square:.3f}"
    return float(z.abs().max())


def bucket_sizes(numel: int, bucket: int) -> list[int]:
    return [bucket] * (numel // bucket) + ([numel % bucket] if numel % bucket else [])


def qsgd_variance(v: torch.Tensor, levels: int, buckets: list[int]) -> torch.Tensor:
    """Var of QSGD's decoded element: (‖b‖/s)²·p(1 − p), p the fractional part of s|v|/‖b‖."""
    v = v.double()
    ids = torch.repeat_interleave(torch.arange(len(buckets)), torch.tensor(buckets))
    norm = torch.zeros(len(buckets), dtype=torch.float64).index_add_(0, ids, v * v).sqrt()[ids]
    r = torch.where(norm > 0, levels * v.abs() / norm, 0.0)
    frac = r - r.floor()
    return (norm / levels) ** 2 * frac * (1 - frac)


def test_qsgd_is_unbiased_with_the_exact_variance():
    g = torch.Generator().manual_seed(0)
    # Two tensors of different scale; buckets of 128 inside each (tails of 72 and 28).
    v = torch.cat([torch.randn(200, generator=g), 1e-3 * torch.randn(156, generator=g)])
    layout = layout_of(200, 156)
    for levels, bucket in [(127, 128), (3, 64)]:
        samples = draws("qsgd", [v], layout=layout, levels=levels, bucket_size=bucket)
        sizes = bucket_sizes(200, bucket) + bucket_sizes(156, bucket)
        assert_unbiased(samples, v.double(), qsgd_variance(v, levels, sizes))


def terngrad_expectation_and_variance(gs: list[torch.Tensor], clip: float | None):
    """Per worker: clip to ±c·rms, s = max over workers of max|clipped| (scaler sharing);
    the mean of the workers' s·sign·Bernoulli(|g|/s) has mean mean(clipped) and variance
    Σ_w (s|g_w| − g_w²) / W²."""
    clipped = []
    for g in gs:
        g = g.double()
        if clip is not None:
            bound = clip * g.pow(2).mean().sqrt()
            g = g.clamp(-bound, bound)
        clipped.append(g)
    s = max(float(c.abs().max()) for c in clipped)
    w = len(gs)
    mean = sum(clipped) / w
    variance = sum(s * c.abs() - c**2 for c in clipped) / w**2
    return mean, variance


@pytest.mark.parametrize("clip", [None, 2.5])
def test_terngrad_is_unbiased_for_the_clipped_gradient(clip):
    g = torch.Generator().manual_seed(1)
    # Student-t (ν = 3) tails: 2.5·rms clipping binds on a few elements.
    v = torch.randn(300, generator=g) / torch.randn(3, 300, generator=g).pow(2).mean(0).sqrt()
    mean, variance = terngrad_expectation_and_variance([v], clip)
    if clip is not None:
        assert (mean != v.double()).sum() >= 3, "the test vector must exercise clipping"
    assert_unbiased(draws("terngrad", [v], clip=clip), mean, variance)


@pytest.mark.parametrize("sharing", [True, False])
def test_terngrad_two_workers_of_different_scale(sharing):
    g = torch.Generator().manual_seed(2)
    gs = [torch.randn(256, generator=g), 4 * torch.randn(256, generator=g)]
    samples = draws("terngrad", gs, n=1500, scaler_sharing=sharing)
    if sharing:
        mean, variance = terngrad_expectation_and_variance(gs, 2.5)
    else:  # each worker its own scaler
        parts = [terngrad_expectation_and_variance([x], 2.5) for x in gs]
        mean = (parts[0][0] + parts[1][0]) / 2
        variance = (parts[0][1] + parts[1][1]) / 4
    assert_unbiased(samples, mean, variance)


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_no_magnitude_bias_on_a_large_vector(name):
    """One draw on 1e6 elements: Σ (Q(g)_i − g_i)·sign(g_i), the total error along the
    gradient's own signs, is within 5 standard errors of 0 (a 1% shrink or stretch of
    the magnitudes would sit at z ≈ 8 for TernGrad and far beyond for QSGD)."""
    g = torch.randn(1_000_000, generator=torch.Generator().manual_seed(9))
    out = SimulatedGroup(compressors.build(name), 1, seed=4).step([g])[0].aggregate.double()
    if name == "qsgd":
        variance = qsgd_variance(g, 127, bucket_sizes(g.numel(), 128))
        target = g.double()
    else:
        target, variance = terngrad_expectation_and_variance([g], 2.5)
    z = float(((out - target) * target.sign()).sum() / variance.sum().sqrt())
    assert abs(z) < 5, z


def test_qsgd_error_matches_its_variance_and_moves_with_levels_and_bucket_size():
    """Single draws on 1e5 elements: the squared error equals the exact expected variance
    within 5%, falls as levels grow and rises as buckets grow."""
    v = torch.randn(100_000, generator=torch.Generator().manual_seed(3))

    def squared_error(levels, bucket):
        qsgd = compressors.build("qsgd", levels=levels, bucket_size=bucket)
        out = SimulatedGroup(qsgd, 1).step([v])[0]
        measured = float((out.aggregate.double() - v.double()).pow(2).sum())
        expected = float(qsgd_variance(v, levels, bucket_sizes(v.numel(), bucket)).sum())
        assert abs(measured / expected - 1) < 0.05, (levels, bucket, measured, expected)
        return measured

    by_levels = [squared_error(s, 128) for s in (1, 4, 16, 127)]
    assert all(b < a / 2 for a, b in zip(by_levels, by_levels[1:])), by_levels
    by_bucket = [squared_error(4, b) for b in (16, 128, 1024)]
    assert all(b > a for a, b in zip(by_bucket, by_bucket[1:])), by_bucket


def test_qsgd_buckets_stay_inside_each_tensor():
    """A tensor 1e6 times smaller than its neighbour keeps its own norms: its relative
    error is as small as the big one's (shared buckets would quantize it to ±0)."""
    g = torch.Generator().manual_seed(4)
    v = torch.cat([1e3 * torch.randn(100, generator=g), 1e-3 * torch.randn(156, generator=g)])
    out = SimulatedGroup(compressors.build("qsgd"), 1).step([v], layout=layout_of(100, 156))[0]
    small = out.aggregate[100:]
    assert float((small - v[100:]).norm() / v[100:].norm()) < 0.05
    assert out.bytes_sent == 256 + 4 * (1 + 2)  # int8 levels + one float32 norm per bucket


def test_signsgd_majority_vote_is_the_sign_of_the_sum_of_signs():
    g0 = torch.tensor([1.0, -1.0, 2.0, -3.0, 0.5, 1e-9, -4.0])
    g1 = torch.tensor([1.0, 1.0, -2.0, -1.0, -0.5, -1.0, 4.0])
    g2 = torch.tensor([-1.0, -1.0, 1.0, 2.0, 0.5, -1.0, 4.0])
    outs = SimulatedGroup(compressors.build("signsgd"), 3).step([g0, g1, g2])
    vote = torch.sign(g0.sign() + g1.sign() + g2.sign())
    assert vote.tolist() == [1, -1, 1, -1, 1, -1, 1]
    # Every worker applies the same vote, having sent one bit per element (7 → 1 byte).
    for o in outs:
        assert torch.equal(o.aggregate, vote)
        assert [kind for kind, _ in o.collectives] == ["allgather"] * len(o.collectives)
        assert o.collectives[0][1] == 1

    mean = SimulatedGroup(compressors.build("signsgd", aggregation="mean"), 3).step([g0, g1, g2])
    torch.testing.assert_close(mean[0].aggregate, (g0.sign() + g1.sign() + g2.sign()) / 3)
    tie = SimulatedGroup(compressors.build("signsgd"), 2).step([g0, -g0])
    assert torch.equal(tie[0].aggregate, torch.zeros(7))


def test_signsgd_zero_tensor_abstains_and_bytes_are_one_bit_per_element():
    layout = layout_of(1001, 30)
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(1031, generator=g) for _ in range(3))
    a[:1001] = 0  # worker 0's first tensor is exactly zero: it does not vote there
    outs = SimulatedGroup(compressors.build("signsgd"), 3).step([a, b, c], layout=layout)
    agg = outs[0].aggregate
    assert torch.equal(agg[:1001], torch.sign(b[:1001].sign() + c[:1001].sign()))
    assert torch.equal(agg[1001:], torch.sign(a[1001:].sign() + b[1001:].sign() + c[1001:].sign()))
    # ceil(1031/8) packed bytes + one vote flag byte per tensor
    assert outs[0].bytes_sent == math.ceil(1031 / 8) + 2
    assert outs[0].rounds == 1


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000, 1003])
def test_sign_packing_round_trip(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8)
    assert torch.equal(unpack_signs(packed, numel, torch.float32), torch.where(x >= 0, 1.0, -1.0))


@pytest.mark.skipif(not ops.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 13, 1000, 2 * 2**17 + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_sign_packing_native_equals_torch(monkeypatch, numel, dtype, threads):
    """The native pack (one pass) writes the torch expression's bytes: bit order, the
    padded last byte, −0.0 (sets its bit), NaN (does not), ±Inf."""

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=dtype)
    special = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -float("inf")], dtype=dtype)
    x[: min(numel, 5)] = special[: min(numel, 5)]
    native = with_threads(threads, lambda: pack_signs(x))
    monkeypatch.setattr(ops, "supports_cpu", lambda t: False)
    assert torch.equal(native, pack_signs(x))


def test_efsignsgd_scaled_sign_per_tensor_bytes_and_error_feedback():
    layout = layout_of(100, 37)
    g = torch.Generator().manual_seed(6)
    group = SimulatedGroup(compressors.build("efsignsgd"), 2, seed=0)
    for step in range(3):
        scale = torch.tensor([1.0] * 100 + [10.0] * 37)
        grads = [torch.randn(137, generator=g) * scale for _ in range(2)]
        accs = []
        for sess, grad in zip(group.sessions, grads):
            prev = sess.residual("grad")
            accs.append(grad.clone() if prev is None else prev.clone().add_(grad))
        outs = group.step(grads, layout=layout)
        expected = []
        for acc, sess, out in zip(accs, group.sessions, outs):
            parts = acc.split([100, 37])
            sent = torch.cat([p.abs().mean() * torch.where(p >= 0, 1.0, -1.0) for p in parts])
            torch.testing.assert_close(out.sent.dense(137), sent)
            assert torch.equal(sess.residual("grad"), acc - out.sent.dense(137))
            expected.append(sent)
        torch.testing.assert_close(outs[0].aggregate, (expected[0] + expected[1]) / 2)
        assert outs[0].bytes_sent == math.ceil(137 / 8) + 4 * 2


@pytest.mark.parametrize(
    "name, params, param",
    [
        ("qsgd", {"levels": 0}, "levels"),
        ("qsgd", {"levels": 1.5}, "levels"),
        ("qsgd", {"levels": True}, "levels"),
        ("qsgd", {"bucket_size": 0}, "bucket_size"),
        ("qsgd", {"bucket_size": -128}, "bucket_size"),
        ("terngrad", {"clip": 0.0}, "clip"),
        ("terngrad", {"clip": -2.5}, "clip"),
        ("terngrad", {"clip": float("nan")}, "clip"),
        ("terngrad", {"clip": float("inf")}, "clip"),
        ("terngrad", {"scaler_sharing": "yes"}, "scaler_sharing"),
        ("signsgd", {"aggregation": "median"}, "aggregation"),
    ],
)
def test_bad_parameters_are_refused_by_name(name, params, param):
    with pytest.raises(ValueError, match=param):
        compressors.build(name, **params)


CASES = [
    ("signsgd", {}),
    ("signsgd", {"aggregation": "mean"}),
    ("efsignsgd", {}),
    ("qsgd", {}),
    ("qsgd", {"levels": 300, "bucket_size": 50}),  # int16 levels
    ("terngrad", {}),
    ("terngrad", {"scaler_sharing": False}),
]


@pytest.mark.parametrize("name, params", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_quantizes_exactly_like_float32(name, params, dtype):
    """Statistics run in float32, so a 16-bit gradient is quantized exactly as its float32
    copy (same random draws); only the final cast differs."""
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(3000, generator=g).to(dtype) for _ in range(3)]
    layout = layout_of(1000, 2000)
    half = SimulatedGroup(compressors.build(name, **params), 3, seed=1)
    half = half.step(grads, layout=layout)[0]
    full = SimulatedGroup(compressors.build(name, **params), 3, seed=1).step(
        [x.float() for x in grads], layout=layout
    )[0]
    assert half.aggregate.dtype == dtype
    assert torch.equal(half.aggregate, full.aggregate.to(dtype))


@pytest.mark.parametrize("name, params", CASES)
def test_a_zero_tensor_next_to_others_gives_zeros_and_no_nan(name, params):
    g = torch.Generator().manual_seed(8)
    grads = [torch.cat([torch.zeros(500), torch.randn(700, generator=g)]) for _ in range(2)]
    out = SimulatedGroup(compressors.build(name, **params), 2, seed=2).step(
        grads, layout=layout_of(500, 700)
    )[0]
    assert torch.isfinite(out.aggregate).all()
    assert torch.equal(out.aggregate[:500], torch.zeros(500))
    assert out.aggregate[500:].abs().sum() > 0


def test_wire_types_follow_levels_and_workers():
    v = torch.randn(1000)
    int16 = SimulatedGroup(compressors.build("qsgd", levels=300, bucket_size=1000), 1).step([v])[0]
    assert int16.bytes_sent == 2 * 1000 + 4
    tern = SimulatedGroup(compressors.build("terngrad"), 2).step([v, v])[0]
    assert tern.bytes_sent == 1000 + 4 and tern.rounds == 2  # max of scalers, int8 sum
    # 200 workers' ternaries cannot be summed in int8; collectives have no int16 sum.
    many = SimulatedGroup(compressors.build("terngrad"), 200).step([v] * 200)[0]
    assert many.bytes_sent == 4 * 1000 + 4
    assert torch.isfinite(many.aggregate).all()


def _grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3000, generator=torch.Generator().manual_seed(10 * step + rank))


def _real_ranks(rank: int, world: int) -> list:
    out = []
    for name, params in CASES:
        sess = Session(compressors.build(name, **params), rank, world, seed=3)
        for step in range(2):
            grad = _grad(rank, step)
            o = run(sess.exchange("g", grad, step, layout=layout_of(1000, 2000)))
            out.append((o.aggregate, o.bytes_sent))
    return out


@pytest.mark.distributed
def test_real_ranks_match_simulated_workers():
    """Packed uint8 signs, int8/int16 levels, int8 sums and max-reduced scalers behave
    the same over gloo as in simulation, bit for bit."""
    real = run_ranks(_real_ranks, 2)
    i = 0
    for name, params in CASES:
        group = SimulatedGroup(compressors.build(name, **params), 2, seed=3)
        for step in range(2):
            grads = [_grad(r, step) for r in range(2)]
            sim = group.step(grads, name="g", step=step, layout=layout_of(1000, 2000))
            for r in range(2):
                assert torch.equal(real[r][i][0], sim[r].aggregate), (name, params, step, r)
                assert real[r][i][1] == sim[r].bytes_sent
            i += 1


@pytest.mark.skipif(not ops.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("lengths, bucket", [([1000], None), ([13, 1, 2 * 2**17 + 37, 200], None),
                                             ([5000, 333], 128), ([2 * 2**17 + 37], 128)])
@pytest.mark.parametrize("levels, dtype", [(1, torch.int8), (127, torch.int8),
                                           (300, torch.int16), (40_000, torch.int32)])
@pytest.mark.parametrize("clip", [None, 0.8])
@pytest.mark.parametrize("threads", [1, 2])
def test_stochastic_levels_native_equals_torch(monkeypatch, lengths, bucket, levels, dtype,
                                               clip, threads):
    """The fused pass (thc_native.stochastic_levels) and the torch twin give the same
    levels bit for bit: groups that start off the 8-lane grid, ragged buckets, a bound
    that clips, exact zeros."""
    from compressors.base import Segment
    from compressors.quantize import Groups, stochastic_levels

    numel = sum(lengths)
    layout, at = [], 0
    for i, n in enumerate(lengths):
        layout.append(Segment(f"t{i}", at, n, (n,)))
        at += n
    groups = Groups.of_layout(tuple(layout), numel, torch.device("cpu"), bucket)
    g = torch.Generator().manual_seed(numel + levels)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    x[::97] = 0.0
    norms = groups.reduce(x * x, "sum").sqrt_()
    inv = torch.where(norms > 0, levels / norms, 0.0)
    bound = None if clip is None else norms * clip / 50
    native = with_threads(threads, lambda: stochastic_levels(x, groups, inv, bound, levels,
                                                             12345, dtype))
    monkeypatch.setattr(ops, "supports_cpu", lambda t: False)
    reference = stochastic_levels(x, groups, inv, bound, levels, 12345, dtype)
    assert native.dtype == reference.dtype == dtype
    assert torch.equal(native, reference)
    assert int(native.abs().max()) <= levels and bool((native != 0).any())




@pytest.mark.parametrize("native", [True, False])
def test_stochastic_levels_round_down_on_a_tie_with_the_noise(monkeypatch, native):
    """a − ⌊a⌋ equal to u_i is not rounded up (P(up) = frac exactly, no 2^-24 bias): with
    x_i = ±u_i themselves (inv = 1) every level is 0; with x_i = ±(u_i + 2^-24) all are 1."""
    from compressors.base import Segment
    from compressors.quantize import Groups, stochastic_levels
    from compressors.kernels.ops import stream_noise as hash_noise

    if native and not ops.available():
        pytest.skip("native kernels unavailable")
    if not native:
        monkeypatch.setattr(ops, "supports_cpu", lambda t: False)
    n, seed = 4099, 77
    groups = Groups.of_layout((Segment("t", 0, n, (n,)),), n, torch.device("cpu"))
    u = hash_noise(n, seed)
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    ones = torch.ones(1)
    at_tie = stochastic_levels(u * sign, groups, ones, None, 1, seed, torch.int8)
    assert int(at_tie.abs().max()) == 0
    above = stochastic_levels((u + 2.0**-24) * sign, groups, ones, None, 1, seed, torch.int8)
    assert torch.equal(above, sign.to(torch.int8))


@pytest.mark.parametrize("lengths", [[1000], [13, 1, 200], [128, 128, 5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_group_abs_max_equals_the_max_of_abs(lengths, dtype):
    """Groups.abs_max (aminmax for one group) is reduce(x.abs(), "max") bit for bit, +0.0
    for a group of −0.0 (where the max of the aminmax pair is −0.0)."""
    from compressors.quantize import Groups

    groups = Groups(lengths, torch.device("cpu"))
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(len(lengths)))
    x = x.to(dtype)
    x[: lengths[0]] *= -1 if len(lengths) > 1 else 1
    assert torch.equal(groups.abs_max(x), groups.reduce(x.abs(), "max"))
    zeros = torch.full((sum(lengths),), -0.0, dtype=dtype)
    got = groups.abs_max(zeros)
    assert torch.equal(got, torch.zeros(len(lengths), dtype=dtype))
    assert not torch.signbit(got).any()


@pytest.mark.skipif(not ops.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("lengths", [[1000], [13, 1, 2 * 2**17 + 37, 200], [8, 8, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.int16, torch.int32])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_signs_native_equals_torch(monkeypatch, lengths, dtype, threads):
    """One rank's decoded signs added natively (no unpacked tensor) give the torch form's
    bits: groups off the byte grid, a zero weight (a tensor that abstains), every type."""
    from compressors.quantize import Groups, add_signs_

    groups = Groups(lengths, torch.device("cpu"))
    n = sum(lengths)
    g = torch.Generator().manual_seed(n)
    packed = pack_signs(torch.randn(n, generator=g))
    if dtype == torch.float32:
        weights = torch.rand(len(lengths), generator=g) * 3
        start = torch.randn(n, generator=g)
    else:
        weights = torch.ones(len(lengths), dtype=dtype)
        start = torch.randint(-5, 5, (n,), generator=g).to(dtype)
    if len(lengths) > 1:
        weights[-1] = 0
    native = with_threads(threads, lambda: add_signs_(start.clone(), packed, groups, weights))
    monkeypatch.setattr(ops, "available", lambda: False)
    reference = add_signs_(start.clone(), packed, groups, weights)
    assert torch.equal(native, reference)
    assert not torch.equal(native, start)


@pytest.mark.skipif(not ops.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("lengths", [[1000], [13, 1, 2 * 2**17 + 37, 200], [128, 128, 5]])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_levels_native_equals_torch(monkeypatch, lengths, dtype, threads):
    """One rank's levels added natively (no converted float32 tensor) give the torch
    form's bits (the product rounded, then the sum: no FMA): ragged groups, a zero
    weight, negative weights (error feedback's subtraction), every level type."""
    from compressors.quantize import Groups, add_levels_

    groups = Groups(lengths, torch.device("cpu"))
    n = sum(lengths)
    g = torch.Generator().manual_seed(n + dtype.itemsize)
    top = {torch.int8: 127, torch.int16: 30_000, torch.int32: 2**24}[dtype]
    levels = torch.randint(-top, top + 1, (n,), generator=g).to(dtype)
    weights = (torch.rand(len(lengths), generator=g) - 0.5) * 1e-3
    if len(lengths) > 1:
        weights[-1] = 0
    start = torch.randn(n, generator=g)
    native = with_threads(threads, lambda: add_levels_(start.clone(), levels, groups, weights))
    monkeypatch.setattr(ops, "available", lambda: False)
    reference = add_levels_(start.clone(), levels, groups, weights)
    assert torch.equal(native, reference)
    assert not torch.equal(native, start)


@pytest.mark.parametrize("lengths", [[1000], [128, 128, 5], [13, 1, 200]])
@pytest.mark.parametrize("order", [1, 2])
def test_group_norm_is_the_norm_of_each_group(lengths, order):
    """Groups.norm (the reduction kernel, no |x| or x² tensor for one group and equal
    widths) gives each group's ‖x‖₁ or ‖x‖₂."""
    from compressors.quantize import Groups

    groups = Groups(lengths, torch.device("cpu"))
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(order)) * 3
    expected = torch.stack([torch.linalg.vector_norm(part.double(), order)
                            for part in x.split(lengths)]).float()
    got = groups.norm(x, order, torch.float32)
    assert got.shape == (len(lengths),)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name, params", [("efsignsgd", {}), ("qsgd", {}),
                                          ("terngrad", {"scaler_sharing": False})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_contribution_subtracted_in_place_equals_its_dense_form(name, params, dtype):
    """EF-SignSGD's, QSGD's and TernGrad's Sent subtracts its contribution straight from
    the payload (no decoded full-size tensor) with the bits of buffer − dense()."""
    from compressors import Session, drive

    numel = 3000
    sess = Session(compressors.build(name, **params), rank=0, world_size=1,
                   feedback="none", seed=4)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(9), dtype=dtype)
    sent = drive([sess.exchange("g", grad, 0)])[0].sent
    dense = sent.dense(numel)
    assert dense.dtype == dtype and bool((dense != 0).any())
    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(10), dtype=dtype)
    expected = buffer - dense
    sent.subtract_from(buffer)
    assert torch.equal(buffer, expected)
