"""The same protocol over real gloo ranks and over simulated workers gives identical
results: one implementation of each algorithm serves both."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import AllGather, AllReduce, Broadcast, Session, SimulatedGroup, drive
from repro.distributed import run, run_async
from repro.testing import run_ranks

pytestmark = pytest.mark.distributed
STEPS = 3
NUMEL = 3000


def _params(name):
    return {"ratio": 0.05} if "ratio" in compressors.default_params(name) else {}


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    # Two named tensors, so layout-aware compressors (DEFT, PowerSGD) see boundaries.
    return torch.randn(NUMEL, generator=g)


def _layout():
    return (
        compressors.Segment("w", 0, 2000, (40, 50)),
        compressors.Segment("b", 2000, 1000, (1000,)),
    )


def _run_all_compressors(rank: int, world: int, names: list[str], use_async: bool):
    results = {}
    for name in names:
        sess = Session(compressors.build(name, **_params(name)), rank=rank, world_size=world, seed=11)
        outs = []
        for step in range(STEPS):
            gen = sess.exchange("bucket0", _grad(rank, step), step, layout=_layout())
            o = run_async(gen).wait() if use_async else run(gen)
            outs.append((o.aggregate, o.bytes_sent, o.selected))
        results[name] = outs
    return results


@pytest.mark.parametrize("use_async", [False, True], ids=["blocking", "comm-thread"])
def test_every_compressor_identical_over_gloo_and_simulated(use_async):
    names = compressors.list_compressors()
    real = run_ranks(_run_all_compressors, 2, names, use_async)
    for name in names:
        group = SimulatedGroup(compressors.build(name, **_params(name)), 2, seed=11)
        for step in range(STEPS):
            sim = group.step([_grad(r, step) for r in range(2)], name="bucket0", step=step,
                             layout=_layout())
            for r in range(2):
                agg, nbytes, selected = real[r][name][step]
                assert torch.equal(agg, sim[r].aggregate), f"{name} step {step} rank {r}"
                assert nbytes == sim[r].bytes_sent, name
                assert selected == sim[r].selected, name


def _mixed_protocol(rank: int, world: int):
    """Every request kind, unequal and empty AllGather lengths, a tuple round."""
    a = yield AllReduce(torch.tensor([float(rank + 1), 10.0 * rank]), op="max")
    lengths = [3, 0, 5][: world]
    mine = torch.arange(lengths[rank], dtype=torch.int32) + 100 * rank
    gathered, total = yield (AllGather(mine), AllReduce(torch.tensor([rank + 1.0])))
    b = yield Broadcast(torch.full((2,), float(rank)), src=world - 1)
    return a, gathered, total, b


def _mixed_worker(rank, world):
    return run(_mixed_protocol(rank, world))


def test_driver_semantics_match_simulation():
    real = run_ranks(_mixed_worker, 2)
    sim = drive([_mixed_protocol(r, 2) for r in range(2)])
    for r in range(2):
        a, gathered, total, b = real[r]
        sa, sg, st, sb = sim[r]
        assert torch.equal(a, sa) and torch.equal(a, torch.tensor([2.0, 10.0]))
        assert [g.tolist() for g in gathered] == [g.tolist() for g in sg] == [[0, 1, 2], []]
        assert torch.equal(total, st) and total.item() == 3.0
        assert torch.equal(b, sb) and b.tolist() == [1.0, 1.0]


def test_simulated_driver_detects_diverging_workers():
    def proto(rank):
        if rank == 0:
            yield AllReduce(torch.ones(2))
        else:
            yield AllGather(torch.ones(2))
        return None

    with pytest.raises(RuntimeError, match="disagree"):
        drive([proto(0), proto(1)])
