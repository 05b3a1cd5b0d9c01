"""Every rank holds the same model after every step: the aggregate does not depend on the
order in which payloads are added, ranks agree on per-tensor decisions, faults are
decided once for all ranks, and a replica check names the first tensor that differs."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import SimulatedGroup, _native
from repro.sources import synthetic


def _params(name: str) -> dict:
    return {"ratio": 0.05} if "ratio" in compressors.default_params(name) else {}


def _overlapping(workers: int, step: int) -> list[torch.Tensor]:
    """Gradients that share most of their large coordinates across workers (so sparse
    payloads collide on many indices) with values of mixed magnitudes (so the rounding
    of a sum depends on the order of its terms)."""
    base = synthetic("laplace", 20_000, workers, seed=step, step=step, shared=0.8)
    scale = torch.logspace(-3, 3, 20_000)[torch.randperm(20_000, generator=torch.Generator()
                                                           .manual_seed(step))]
    return [g * scale for g in base]


def _aggregates(name: str, workers: int) -> list[torch.Tensor]:
    group = SimulatedGroup(compressors.build(name, **_params(name)), workers, seed=3)
    out = []
    for step in range(2):
        outs = group.step(_overlapping(workers, step), step=step)
        for o in outs[1:]:
            assert torch.equal(o.aggregate, outs[0].aggregate)
        out.append(outs[0].aggregate.clone())
    return out


@pytest.mark.parametrize("workers", [3, 4, 8])
def test_aggregate_is_independent_of_the_order_payloads_are_added(monkeypatch, workers):
    """CUDA's index_add_ adds colliding pairs in arrival order (atomics). Modelled on the
    CPU: every index_add_ applies its pairs in a random order. Every registered
    compressor's aggregate must come out bit for bit the same under any such order, and
    the same as the native CPU decode's, with 3, 4 and 8 workers whose payloads overlap."""
    names = compressors.list_compressors()
    native = {name: _aggregates(name, workers) for name in names}
    real_index_add = torch.Tensor.index_add_
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)

        def arrival_order(self, dim, index, source, *, alpha=1):
            perm = torch.randperm(index.numel(), generator=g)
            return real_index_add(self, dim, index[perm], source[perm], alpha=alpha)

        with monkeypatch.context() as m:
            m.setattr(_native, "supports_cpu", lambda t: False)  # the torch decode
            m.setattr(torch.Tensor, "index_add_", arrival_order)
            for name in names:
                got = _aggregates(name, workers)
                for step, (a, b) in enumerate(zip(got, native[name])):
                    assert torch.equal(a, b), f"{name}, {workers} workers, step {step}"
