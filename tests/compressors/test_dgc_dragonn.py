"""DGC (sampled threshold + re-top-k) and DRAGONN (hashing sparsifier, batched sparse
decoding): estimation quality, the re-top-k contract, the hash's memory coverage against
the paper's Lemma A.10, exact batched decoding, fixed payload, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

import compressors
from compressors import Session, SimulatedGroup, drive
from compressors.dgc import DGC, sample_size
from compressors.dragonn import (
    Dragonn,
    draw_hash_seeds,
    empirical_empty_fraction,
    empty_fraction_tail_bound,
    expected_empty_fraction,
    sparse_decode,
)
from compressors.kernels.reference import flat_nonzero, hash32, hash_slots, write_slots
from repro.distributed import run
from repro.sources import synthetic
from repro.testing import run_ranks


def _dense_sum_in_rank_order(outcomes, numel):
    """Dense decoding: densify each worker's contribution, add them rank by rank."""
    total = torch.zeros(numel, dtype=outcomes[0].aggregate.dtype)
    for o in outcomes:
        total += o.sent.dense(numel).to(total.dtype)
    return total / len(outcomes)


def _spikes(numel, positions, value=1.0, dtype=torch.float32):
    g = torch.zeros(numel, dtype=dtype)
    g[positions] = value
    return g


# ---------------------------------------------------------------- DGC


@pytest.mark.parametrize("kind", ["laplace", "normal"])
@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_dgc_estimation_quality_and_overselect_cap(kind, ratio):
    numel, steps = 200_000, 10
    group = SimulatedGroup(DGC(ratio=ratio), 1, feedback="none", seed=3)
    quality = []
    for step in range(steps):
        (o,) = group.step(synthetic(kind, numel, 1, seed=5, step=step), step=step)
        k = o.target
        assert o.selected <= math.ceil(4 * k / 3)
        if o.extra["retopk"]:
            assert o.selected == k and o.extra["candidates"] > 4 * k / 3
        else:
            assert o.selected == o.extra["candidates"]
        quality.append(o.selected / k)
    mean = sum(quality) / steps
    assert 0.7 <= mean <= 1.34, f"{kind} δ={ratio}: mean k̂/k = {mean:.3f}"


def test_dgc_retopk_selects_exact_topk_among_candidates():
    numel, ratio = 100_000, 0.01
    group = SimulatedGroup(DGC(ratio=ratio, max_overselect=1.0), 1, feedback="none", seed=1)
    retopk_seen = 0
    for step in range(16):
        g = torch.randn(numel, generator=torch.Generator().manual_seed(step))
        (o,) = group.step([g], step=step)
        mag = g.abs()
        chosen = o.sent.indices.long()
        if o.extra["retopk"]:
            retopk_seen += 1
            assert o.extra["candidates"] > o.target
            # Candidates (|g| >= threshold) contain the global top-k: re-top-k among them
            # must return exactly the global top-k set.
            exact = torch.topk(mag, o.target).indices
            assert torch.equal(torch.sort(chosen).values, torch.sort(exact).values)
        else:
            threshold = o.extra["threshold"]
            assert torch.equal(chosen.sort().values, flat_nonzero(mag >= threshold))
    # With max_overselect = 1 about half the steps overselect (0.47 over 300 steps).
    assert 2 <= retopk_seen <= 14


def test_dgc_selection_is_threshold_set_and_dominates_the_rest():
    numel = 50_000
    g = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    (o,) = SimulatedGroup(DGC(ratio=0.01), 1, feedback="none", seed=2).step([g])
    chosen = o.sent.indices.long()
    rest = torch.ones(numel, dtype=torch.bool)
    rest[chosen] = False
    assert g.abs()[chosen].min() >= g.abs()[rest].max()
    assert torch.equal(o.sent.values, g[chosen])


def test_dgc_constant_tensor_overselects_then_keeps_exactly_k():
    numel = 20_000
    (o,) = SimulatedGroup(DGC(ratio=0.01), 1, feedback="none").step([torch.full((numel,), -0.5)])
    assert o.extra["retopk"] and o.extra["candidates"] == numel
    assert o.selected == o.target == 200
    assert torch.all(o.sent.values == -0.5)


def test_dgc_under_selection_is_accepted_and_zeros_are_never_sent():
    # Small tensor: the "sample" is the whole tensor, so the threshold is the exact k-th
    # largest |g| = 0; only the k − 1 non-zeros pass, and nothing pads them.
    numel, ratio = 1000, 0.01
    g = _spikes(numel, [3, 50, 999, 7, 400, 600, 800, 900, 0], value=2.0)
    (o,) = SimulatedGroup(DGC(ratio=ratio), 1, feedback="none").step([g])
    assert o.target == 10 and o.selected == 9
    assert torch.equal(o.aggregate, g)


def test_sample_size_floor():
    # 1% of 10⁵ at δ = 0.001 would leave one sampled element above the threshold.
    assert sample_size(100_000, 0.001, 0.01, 10) == 10_000
    assert sample_size(10**8, 0.001, 0.01, 10) == 10**6
    assert sample_size(5_000, 0.001, 0.01, 10) == 5_000


# ---------------------------------------------------------------- DRAGONN: the hash


def test_lemma_a10_quantities():
    p = expected_empty_fraction(1024, 1024)
    assert abs(p - math.exp(-1)) < 2e-4 and abs(p - 0.3677) < 1e-4
    # n = 2m balls: about e^-2 of the slots stay empty (the Poisson limit, independently).
    assert abs(expected_empty_fraction(1024, 512) - math.exp(-2)) < 5e-4
    assert empty_fraction_tail_bound(1024, 1024, 0.1) < empty_fraction_tail_bound(1024, 1024, 0.02)
    with pytest.raises(ValueError, match="m >= 1"):
        expected_empty_fraction(10, 0)


@pytest.mark.parametrize("n, m", [(1024, 1024), (1024, 512), (1024, 4096)])
def test_hash_empty_slot_fraction_matches_balls_in_bins(n, m):
    p = expected_empty_fraction(n, m)
    consecutive = [empirical_empty_fraction(n, m, seed=s) for s in range(10)]
    scattered = [
        empirical_empty_fraction(
            n, m, seed=100 + s,
            keys=torch.randperm(10**6, generator=torch.Generator().manual_seed(s))[:n],
        )
        for s in range(10)
    ]
    for fractions in (consecutive, scattered):
        assert abs(sum(fractions) / len(fractions) - p) <= 0.02


def test_write_slots_matches_reference_loop():
    numel, m = 5000, 64
    keys = torch.randperm(numel, generator=torch.Generator().manual_seed(4))[:200]
    seeds = draw_hash_seeds(torch.Generator().manual_seed(9))
    slots = write_slots(keys, m, seeds, numel)
    h = hash32(keys, seeds)
    where = hash_slots(h, m)
    expected = [-1] * m
    best = [-1] * m
    for key, hv, s in zip(keys.tolist(), h.tolist(), where.tolist()):
        if hv > best[s]:  # the colliding key with the largest hash survives
            best[s], expected[s] = hv, key
    assert slots.tolist() == expected
    # Distinct keys keep distinct 32-bit hashes (the finaliser is a bijection).
    assert torch.unique(h).numel() == keys.numel()


def test_collision_survivors_are_not_biased_by_position():
    # "Largest index wins" would make the low half lose ~37% of its keys and the high
    # half almost none; a random priority loses both halves alike.
    n = m = 1024
    keys = torch.arange(n)
    lost_low = lost_high = 0
    seeds_gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        slots = write_slots(keys, m, draw_hash_seeds(seeds_gen), n)
        kept = torch.zeros(n, dtype=torch.bool)
        kept[slots[slots >= 0]] = True
        lost_low += int((~kept[: n // 2]).sum())
        lost_high += int((~kept[n // 2 :]).sum())
    total = 20 * n // 2
    assert abs(lost_low / total - lost_high / total) < 0.03
    assert 0.3 < (lost_low + lost_high) / (2 * total) < 0.45  # ≈ 1 − (1 − p)·m/n = 0.368


def test_empty_slot_fraction_through_the_compressor():
    # 1024 candidates (the only non-zeros) into m = 1024 slots: ratio 0.01 of 102400
    # gives k = 1024, memory_factor = 1 gives m = k.
    numel = 102_400
    positions = torch.randperm(numel, generator=torch.Generator().manual_seed(1))[:1024]
    g = _spikes(numel, positions, value=3.0)
    group = SimulatedGroup(Dragonn(ratio=0.01, memory_factor=1), 1, feedback="none", seed=7)
    fractions = []
    for step in range(10):
        (o,) = group.step([g], step=step)
        assert o.extra["candidates"] == 1024
        assert o.selected == round((1 - o.extra["empty_slot_fraction"]) * 1024)
        fractions.append(o.extra["empty_slot_fraction"])
    assert abs(sum(fractions) / len(fractions) - expected_empty_fraction(1024, 1024)) <= 0.02


# ---------------------------------------------------------------- DRAGONN: decoding


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_sparse_decoding_equals_dense_decoding(workers, dtype):
    numel = 40_000
    grads = [g.to(dtype) for g in synthetic("normal", numel, workers, seed=3, step=0)]
    group = SimulatedGroup(Dragonn(ratio=0.01), workers, feedback="none", seed=5)
    for step in range(2):
        outs = group.step(grads, step=step)
        dense = _dense_sum_in_rank_order(outs, numel)
        for o in outs:
            # Per coordinate, the batched index_add adds the same terms in the same (rank)
            # order as the dense sum, so the results agree bit for bit.
            assert torch.equal(o.aggregate, dense)
            assert o.aggregate.dtype == dtype
        # Workers share half their coordinates: some indices are sent by several ranks.
        all_sent = torch.cat([o.sent.indices for o in outs])
        assert torch.unique(all_sent).numel() < all_sent.numel()


def test_sparse_decode_sums_duplicates_and_drops_empty_slots():
    numel = 10
    idx = [torch.tensor([0, 3, -1, 9], dtype=torch.int32), torch.tensor([3, -1, 0, 5], dtype=torch.int32)]
    # The empty slots carry garbage values on purpose: they must not land anywhere.
    val = [torch.tensor([1.0, 2.0, 100.0, 4.0]), torch.tensor([0.5, 100.0, 3.0, 6.0])]
    out = sparse_decode(idx, val, numel, 2, torch.float32)
    expected = torch.zeros(numel)
    expected[0], expected[3], expected[5], expected[9] = 4.0 / 2, 2.5 / 2, 6.0 / 2, 4.0 / 2
    assert torch.equal(out, expected)
    assert out.numel() == numel


def test_identical_spikes_on_every_worker_are_summed_and_index_zero_is_sent():
    numel, workers = 10_000, 4
    g = _spikes(numel, [0, 17, numel - 1], value=-1.5)
    group = SimulatedGroup(Dragonn(ratio=0.01), workers, seed=0)
    outs = group.step([g.clone() for _ in range(workers)])
    for o in outs:
        assert sorted(o.sent.indices.tolist()) == [0, 17, numel - 1]
        assert torch.equal(o.aggregate, g)  # (4 × −1.5) / 4, index 0 included
    # Momentum-corrected residual at the sent coordinates is exactly zero.
    assert float(group.sessions[0].residual("grad").abs().sum()) == 0.0


def test_all_zero_input_gives_zero_aggregate():
    group = SimulatedGroup(Dragonn(ratio=0.01), 2, seed=0)
    outs = group.step([torch.zeros(5000), torch.zeros(5000)])
    for o in outs:
        assert torch.equal(o.aggregate, torch.zeros(5000))
        assert o.selected == 0 and o.extra["empty_slot_fraction"] == 1.0
        assert math.isfinite(o.extra["threshold"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])
def test_a_zero_sample_threshold_is_the_smallest_positive_value(dtype):
    # an all-zero sample would select everything at threshold 0: the threshold is raised
    # to the dtype's smallest subnormal, so exactly the non-zeros pass
    from compressors.dgc import sample_threshold

    acc = torch.zeros(200_000, dtype=dtype)
    acc[[5, 77_777]] = torch.tensor([-1.0, 2.0], dtype=dtype)
    t = sample_threshold(acc, 0.001, 200, 0.01, 10, torch.Generator().manual_seed(0))
    tiny = torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype))
    assert t.dtype == dtype and t.item() == tiny.item() > 0
    assert torch.equal(flat_nonzero(acc.abs() >= t), torch.tensor([5, 77_777]))


# ---------------------------------------------------------------- DRAGONN: payload, EF


@pytest.mark.parametrize(
    "data", ["normal", "zeros", "constant", "spike", "float16", "bfloat16", "float64", "strided"]
)
def test_payload_is_exactly_m_slots_whatever_the_data(data):
    numel = 12_345
    c = Dragonn(ratio=0.01)
    m = c.sent_elements(numel)
    assert m == 4 * 123
    g = torch.randn(2 * numel, generator=torch.Generator().manual_seed(0))
    grad = {
        "normal": g[:numel],
        "zeros": torch.zeros(numel),
        "constant": torch.full((numel,), 0.25),
        "spike": _spikes(numel, [5]),
        "float16": g[:numel].half(),
        "bfloat16": g[:numel].bfloat16(),
        "float64": g[:numel].double(),
        "strided": g[::2],
    }[data]
    outs = SimulatedGroup(c, 2, seed=1).step([grad, grad.clone()])
    for o in outs:
        assert o.bytes_sent == m * (4 + grad.element_size())  # int32 slots + values
        assert o.rounds == 1
        assert o.aggregate.dtype == grad.dtype and bool(torch.isfinite(o.aggregate).all())
        assert o.selected <= min(m, o.extra["candidates"])
        assert torch.equal(o.sent.values, grad.reshape(-1)[o.sent.indices.long()])


@pytest.mark.parametrize("feedback", ["residual", "momentum"])
def test_error_feedback_keeps_everything_not_sent(feedback):
    numel = 30_000
    # memory_factor = 1: many collisions, so some candidates are lost and must stay.
    sess = Session(Dragonn(ratio=0.01, memory_factor=1), feedback=feedback, seed=4)
    expected_acc = None
    momentum = None
    lost_total = 0
    for step in range(3):
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(step))
        if feedback == "residual":
            expected_acc = grad.clone() if expected_acc is None else expected_acc.add_(grad)
        else:  # u ← 0.9·u + g; v ← v + u (same float operations as the feedback)
            momentum = grad.clone() if momentum is None else momentum.mul_(0.9).add_(grad)
            expected_acc = momentum.clone() if expected_acc is None else expected_acc.add_(momentum)
        (o,) = drive([sess.exchange("w", grad, step)])
        residual = sess.residual("w")
        sent = o.sent.dense(numel)
        assert torch.equal(residual + sent, expected_acc)
        candidates = flat_nonzero(expected_acc.abs() >= o.extra["threshold"])
        assert candidates.numel() == o.extra["candidates"]
        was_sent = torch.zeros(numel, dtype=torch.bool)
        was_sent[o.sent.indices.long()] = True
        lost = candidates[~was_sent[candidates]]
        lost_total += lost.numel()
        assert torch.equal(residual[lost], expected_acc[lost])
        assert torch.all(residual[o.sent.indices.long()] == 0)
        expected_acc = residual.clone()
        if momentum is not None:
            momentum[o.sent.indices.long()] = 0
    assert lost_total > 0


def test_deterministic_under_seed_and_seed_changes_the_hash():
    numel = 20_000
    grads = synthetic("laplace", numel, 3, seed=1, step=0)

    def layout(seed):
        outs = SimulatedGroup(Dragonn(ratio=0.01), 3, seed=seed).step(grads)
        return [o.sent.indices for o in outs], outs[0].aggregate

    (a_idx, a_agg), (b_idx, b_agg), (c_idx, _) = layout(7), layout(7), layout(8)
    assert torch.equal(a_agg, b_agg)
    assert all(torch.equal(x, y) for x, y in zip(a_idx, b_idx))
    assert not all(torch.equal(x, y) for x, y in zip(a_idx, c_idx))
    # Private per-worker seeds: on identical data, ranks still hash differently (a shared
    # seed would drop the same colliding coordinates on every rank).
    spikes = _spikes(numel, torch.arange(0, numel, 61))  # the same 328 candidates on both
    same = SimulatedGroup(Dragonn(ratio=0.01), 2, seed=7).step([spikes, spikes.clone()])
    assert same[0].extra["candidates"] == same[1].extra["candidates"] == 328
    assert not torch.equal(same[0].sent.indices, same[1].sent.indices)


def test_one_element_tensor():
    for value in (0.0, -2.0):
        outs = SimulatedGroup(Dragonn(), 2, seed=0).step([torch.tensor([value])] * 2)
        assert outs[0].aggregate.tolist() == [value]
        # m = min(4·k, d) = 1 slot: (index, value) of 4 + 4 bytes
        assert outs[0].bytes_sent == 1 * (4 + 4)


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("dgc", {"sample_ratio": 0.0}, "sample_ratio"),
        ("dgc", {"max_overselect": 0.5}, "max_overselect"),
        ("dgc", {"min_sample_top": 0}, "min_sample_top"),
        ("dragonn", {"memory_factor": 0}, "memory_factor"),
        ("dragonn", {"memory_factor": float("inf")}, "memory_factor"),
        ("dragonn", {"sample_ratio": 1.5}, "sample_ratio"),
    ],
)
def test_bad_parameters_are_refused(name, params, match):
    with pytest.raises(ValueError, match=match):
        compressors.build(name, **params)


def test_defaults_are_the_papers():
    assert compressors.default_params("dgc") == {
        "ratio": 0.01, "sample_ratio": 0.01, "max_overselect": 4 / 3, "min_sample_top": 10,
    }
    assert compressors.default_params("dragonn") == {
        "ratio": 0.01, "memory_factor": 4, "sample_ratio": 0.01, "min_sample_top": 10,
    }
    assert compressors.get_class("dragonn").default_feedback == "momentum"
    assert compressors.get_class("dgc").default_feedback == "momentum"


# ---------------------------------------------------------------- over real ranks


def _dragonn_over_gloo(rank: int, world: int, numel: int):
    grads = synthetic("normal", numel, world, seed=2, step=0)
    sess = Session(Dragonn(ratio=0.01), rank=rank, world_size=world, seed=9)
    o = run(sess.exchange("w", grads[rank], 0))
    return o.aggregate, o.sent.indices, o.bytes_sent


@pytest.mark.distributed
def test_dragonn_over_gloo_matches_simulated():
    numel = 20_000
    real = run_ranks(_dragonn_over_gloo, 2, numel)
    sim = SimulatedGroup(Dragonn(ratio=0.01), 2, seed=9).step(
        synthetic("normal", numel, 2, seed=2, step=0), name="w"
    )
    for r in range(2):
        assert torch.equal(real[r][0], sim[r].aggregate)
        assert torch.equal(real[r][1], sim[r].sent.indices)
        assert real[r][2] == sim[r].bytes_sent
