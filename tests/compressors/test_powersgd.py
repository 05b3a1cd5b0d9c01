"""PowerSGD: the same approximation quality as PyTorch's powerSGD_hook on the same
gradients, exact vectors, correct averaging, warm start, and the edge cases."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist
from torch import nn

import compressors
from compressors import Segment, Session, SimulatedGroup
from repro.distributed import run
from repro.testing import run_ranks

STEPS = 22
START = 2  # PyTorch's hook needs ≥ 2 dense steps with error feedback (DDP bucket rebuild)
RANKS = (1, 2, 4)  # Gram-Schmidt (1, 2) and QR (4) orthonormalisation


def layout_of(shapes: list[tuple[int, ...]]) -> tuple[Segment, ...]:
    out, offset = [], 0
    for i, shape in enumerate(shapes):
        numel = 1
        for k in shape:
            numel *= k
        out.append(Segment(f"t{i}", offset, numel, tuple(shape)))
        offset += numel
    return tuple(out)


def is_compressed(shape: tuple[int, ...], rank: int, rate: float = 2.0) -> bool:
    """PyTorch's rule: a matrix (n, m) is compressed when (n + m)·r·rate < n·m."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = 1
    for k in shape[1:]:
        m *= k
    return (n + m) * min(n, m, rank) * rate < n * m


def compressed_mask(layout: tuple[Segment, ...], rank: int) -> torch.Tensor:
    mask = torch.zeros(sum(s.numel for s in layout), dtype=torch.bool)
    for s in layout:
        mask[s.offset : s.offset + s.numel] = is_compressed(s.shape, rank)
    return mask


def relative_error(approx: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    return float((approx[mask] - target[mask]).norm() / target[mask].norm())


def _torch_vs_ours(rank: int, world: int) -> dict:
    """On each gloo rank: a small MLP in DDP with PyTorch's powerSGD_hook (wrapped to
    record the bucket gradient, the error-compensated mean M̄ and the hook's output),
    then our compressor over the same process group on the recorded gradients."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
    from torch.nn.parallel import DistributedDataParallel

    results = {}
    teacher = torch.randn(32, 2, generator=torch.Generator().manual_seed(5)) @ torch.randn(
        2, 16, generator=torch.Generator().manual_seed(6)
    )
    for r in RANKS:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 16)
        )
        ddp = DistributedDataParallel(model)
        state = ph.PowerSGDState(
            process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=START,
            min_compression_rate=2, random_seed=0,
        )
        records = []

        def hook(st, bucket):
            grad = bucket.buffer().clone()
            shapes = [tuple(t.shape) for t in bucket.gradients()]
            error = st.error_dict.get(bucket.index()) if st.iter >= st.start_powerSGD_iter else None
            mean = grad.clone() if error is None else grad + error
            dist.all_reduce(mean)
            mean /= world

            def done(fut):
                out = fut.value()
                records.append((grad, mean, out.clone(), shapes))
                return out

            return ph.powerSGD_hook(st, bucket).then(done)

        ddp.register_comm_hook(state, hook)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(64, 32, generator=g)
            y = x @ teacher + 0.1 * torch.randn(64, 16, generator=g)
            ddp.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()

        ours_c = compressors.build("powersgd", rank=r, start_iter=START)
        session = Session(ours_c, rank, world, seed=0)
        theirs, ours, grads, layouts, aggregates = [], [], [], [], []
        for step, (grad, torch_mean, torch_out, shapes) in enumerate(records):
            layout = layout_of(shapes)
            mask = compressed_mask(layout, r)
            prev = session.residual("bucket0")
            mean = grad.clone() if prev is None else prev.clone().add_(grad)
            dist.all_reduce(mean)
            mean /= world
            out = run(session.exchange("bucket0", grad, step, layout=layout))
            if step >= START:
                theirs.append(relative_error(torch_out, torch_mean, mask))
                ours.append(relative_error(out.aggregate, mean, mask))
            grads.append(grad)
            layouts.append(layout)
            aggregates.append(out.aggregate)
        results[r] = dict(
            theirs=theirs, ours=ours, grads=grads, layouts=layouts, aggregates=aggregates
        )
    return results


@pytest.fixture(scope="module")
def torch_vs_ours():
    return run_ranks(_torch_vs_ours, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("r", RANKS)
def test_error_matches_pytorch_powersgd_hook(torch_vs_ours, r):
    """Mean relative error ‖P̂Qᵀ − M̄‖/‖M̄‖ over 20 compressed steps within 10% of PyTorch's
    hook at the same rank (different random Q, so per-step values differ a little)."""
    res = torch_vs_ours[0][r]
    assert len(res["ours"]) == STEPS - START
    theirs, ours = statistics.mean(res["theirs"]), statistics.mean(res["ours"])
    assert 0 < theirs < 1 and 0 < ours < 1
    assert abs(ours - theirs) <= 0.1 * theirs, (r, ours, theirs, res["ours"], res["theirs"])
    # Both ranks measured the same global quantity.
    assert res["ours"] == torch_vs_ours[1][r]["ours"]


@pytest.mark.distributed
def test_simulated_workers_match_real_ranks(torch_vs_ours):
    for r in RANKS:
        real = [torch_vs_ours[rank][r] for rank in range(2)]
        group = SimulatedGroup(compressors.build("powersgd", rank=r, start_iter=START), 2, seed=0)
        for step in range(STEPS):
            outs = group.step(
                [real[0]["grads"][step], real[1]["grads"][step]],
                name="bucket0", step=step, layout=real[0]["layouts"][step],
            )
            for rank in range(2):
                agg = real[rank]["aggregates"][step]
                assert torch.equal(outs[rank].aggregate, agg), (r, step, rank)


# ---- single process -------------------------------------------------------------------

# Same-shaped matrices at irregular offsets (gathered), at a constant stride (one
# strided view), a lone matrix, vectors, a scalar and a matrix too small to compress.
MIXED = [(40, 30), (64,), (40, 30), (16, 8, 3, 3), (3, 4), (40, 30), (), (20, 50), (20, 50), (7,)]


def mixed_grads(seed: int, workers: int = 3, dtype=torch.float32):
    layout = layout_of(MIXED)
    numel = sum(s.numel for s in layout)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g).to(dtype) for _ in range(workers)], layout


def test_uncompressed_tensors_are_averaged_exactly_and_keep_no_residual():
    grads, layout = mixed_grads(0)
    group = SimulatedGroup(compressors.build("powersgd", rank=2), 3, seed=0)
    outs = group.step(grads, layout=layout)
    mask = compressed_mask(layout, 2)
    assert mask.any() and not mask.all()
    exact = (grads[0] + grads[1] + grads[2]) / 3
    assert torch.equal(outs[0].aggregate[~mask], exact[~mask])
    for sess, g, o in zip(group.sessions, grads, outs):
        residual = sess.residual("grad")
        assert torch.equal(residual[~mask], torch.zeros_like(residual[~mask]))
        assert torch.equal(residual[mask], g[mask] - o.aggregate[mask])


def test_each_matrix_is_the_mean_projected_on_an_agreed_rank_r_subspace():
    """P̂Qᵀ/W = P̂P̂ᵀM̄: rank ≤ r and M̄ − M̃ orthogonal to M̃. Dividing Q by W wrongly (or
    not at all, GRACE's bug) breaks the orthogonality; grouping bugs break the shapes."""
    r = 2
    grads, layout = mixed_grads(1)
    group = SimulatedGroup(compressors.build("powersgd", rank=r), 3, feedback="none")
    outs = group.step(grads, layout=layout)
    mean = sum(grads) / 3
    checked = 0
    for s in layout:
        if not is_compressed(s.shape, r):
            continue
        rows = s.shape[0]
        approx = outs[0].aggregate[s.offset : s.offset + s.numel].view(rows, -1).double()
        target = mean[s.offset : s.offset + s.numel].view(rows, -1).double()
        sv = torch.linalg.svdvals(approx)
        assert sv[r:].max() <= 1e-5 * sv[0], s
        cross = approx.T @ (target - approx)
        assert cross.abs().max() <= 1e-4 * target.norm() ** 2, s
        # Rank-r projection of the mean: never better than the truncated SVD.
        best = torch.linalg.svdvals(target)[r:].norm()
        assert (approx - target).norm() >= best * (1 - 1e-6)
        checked += 1
    assert checked == 6


def _fixed_matrix(n=80, m=60):
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    spectrum = torch.tensor([10.0, 6.0] + [3 * 0.8**i for i in range(m - 2)])
    noise = 0.3 * torch.randn(n, m, generator=g)
    return (u[:, :m] * spectrum) @ v.T, noise, float(spectrum[2:].norm() / spectrum.norm())


@pytest.mark.parametrize("warm", [True, False])
def test_warm_start_converges_to_the_best_rank_r_error(warm):
    """Fixed gradients, no error feedback: warm-started PowerSGD is subspace iteration and
    reaches the truncated-SVD error; a fresh Q every step stays well above it."""
    mean, noise, best = _fixed_matrix()
    c = compressors.build("powersgd", rank=2, warm_start=warm)
    group = SimulatedGroup(c, 2, feedback="none")
    errors = []
    for _ in range(10):
        out = group.step([mean + noise, mean - noise])[0]
        errors.append(float((out.aggregate.view(mean.shape) - mean).norm() / mean.norm()))
    assert min(errors) >= best * (1 - 1e-5)
    if warm:
        assert errors[-1] <= best * 1.001
        assert errors[0] >= 1.5 * errors[-1]
        assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:])), errors
    else:
        assert min(errors[1:]) >= 1.2 * best, errors


def test_a_zero_step_does_not_kill_the_warm_start():
    """An all-zero matrix gives zeros (no NaN, unlike the hook at epsilon 0); the next
    non-zero step still gets a good approximation (dead Q columns are redrawn)."""
    mean, noise, best = _fixed_matrix()
    group = SimulatedGroup(compressors.build("powersgd", rank=2), 2, feedback="none")
    zero = torch.zeros_like(mean)
    out = group.step([zero, zero])[0]
    assert torch.equal(out.aggregate, torch.zeros(mean.numel()))
    errors = []
    for _ in range(5):
        out = group.step([mean + noise, mean - noise])[0]
        assert torch.isfinite(out.aggregate).all()
        errors.append(float((out.aggregate.view(mean.shape) - mean).norm() / mean.norm()))
    assert errors[0] < 0.9 and errors[-1] <= best * 1.01, errors


def test_bytes_rounds_and_start_iter():
    grads, layout = mixed_grads(2)
    c = compressors.build("powersgd", rank=2, start_iter=1)
    group = SimulatedGroup(c, 3)
    dense = group.step(grads, layout=layout, step=0)
    assert dense[0].rounds == 1 and dense[0].bytes_sent == grads[0].numel() * 4
    assert torch.equal(dense[0].aggregate, (grads[0] + grads[1] + grads[2]) / 3)
    assert torch.equal(group.sessions[0].residual("grad"), torch.zeros_like(grads[0]))

    compressed = group.step(grads, layout=layout, step=1)[0]
    p = q = 0
    for s in layout:
        if is_compressed(s.shape, 2):
            rows, cols = s.shape[0], s.numel // s.shape[0]
            p, q = p + rows * 2, q + cols * 2
    uncompressed = int((~compressed_mask(layout, 2)).sum())
    assert compressed.rounds == 2
    assert compressed.bytes_sent == 4 * (p + q + uncompressed)
    assert compressed.bytes_sent < grads[0].numel() * 4 / 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_float32(dtype):
    grads, layout = mixed_grads(3, dtype=dtype)
    half = SimulatedGroup(compressors.build("powersgd"), 3, seed=4).step(grads, layout=layout)[0]
    full = SimulatedGroup(compressors.build("powersgd"), 3, seed=4).step(
        [g.float() for g in grads], layout=layout
    )[0]
    assert half.aggregate.dtype == dtype
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert (half.aggregate.float() - full.aggregate).norm() <= tolerance * full.aggregate.norm()


@pytest.mark.parametrize(
    "params, name",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 1.5}, "rank"),
        ({"warm_start": 1}, "warm_start"),
        ({"start_iter": -1}, "start_iter"),
        ({"min_compression_rate": -1.0}, "min_compression_rate"),
        ({"min_compression_rate": float("inf")}, "min_compression_rate"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, name):
    with pytest.raises(ValueError, match=name):
        compressors.build("powersgd", **params)


def test_layout_that_does_not_tile_is_refused():
    bad = (Segment("a", 0, 600, (20, 30)), Segment("b", 700, 100, (100,)))
    with pytest.raises(ValueError, match="tile"):
        SimulatedGroup(compressors.build("powersgd"), 2).step(
            [torch.randn(700), torch.randn(700)], layout=bad
        )
