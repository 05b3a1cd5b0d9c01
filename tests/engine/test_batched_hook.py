"""The DDP hook on 3 gloo ranks with a bucket's sparsifier exchanges batched (the
default) and one exchange per tensor (batch=False): the same parameters, bit for bit,
after every step, and the same error feedback, on a model with an embedding (rows
untouched: zero), ReLU zeros and a branch that goes unused on some steps, with DDP's
buckets rebuilt after the first step."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from repro.testing import run_ranks

pytestmark = pytest.mark.distributed

WORKERS = 3
STEPS = 5
RUNS = {"topk": {"ratio": 0.02}, "dgc": {"ratio": 0.02}, "sidco_e": {"ratio": 0.02},
        "gaussianksgd": {"ratio": 0.02}, "topk/unused": {"ratio": 0.02}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(300, 16)
        self.hidden = nn.Linear(16, 64)
        self.branch = nn.Linear(64, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, tokens: torch.Tensor, branch: bool) -> torch.Tensor:
        h = torch.relu(self.hidden(self.embedding(tokens).mean(1)))
        if branch:
            h = h + torch.relu(self.branch(h))
        return self.head(h)


def _train(rank: int, name: str, batch: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.compression
    import repro.hooks

    calls = []
    real = repro.compression.sparse_batch

    def counted(sessions, names, *args, **kwargs):
        calls.append(len(names))
        return real(sessions, names, *args, **kwargs)

    repro.compression.sparse_batch = counted
    try:
        compressor, _, variant = name.partition("/")
        unused = variant == "unused"
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.02, find_unused_parameters=unused)
        state, hook = repro.hooks.make(compressor, model=ddp, batch=batch, **RUNS[name])
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        params = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            tokens = torch.randint(0, 300, (8, 4), generator=g)
            y = torch.randn(8, 5, generator=g)
            branch = not unused or (step % 2 == 0 and not (step == 2 and rank == 1))
            opt.zero_grad()
            ((ddp(tokens, branch) - y) ** 2).mean().backward()
            opt.step()
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        residuals = {n: r.clone() for n, r in state.parameter_residuals().items()}
    finally:
        repro.compression.sparse_batch = real
    return {"params": params, "residuals": residuals, "calls": calls}


def _all(rank: int, world: int) -> dict:
    return {(name, batch): _train(rank, name, batch) for name in RUNS for batch in (False, True)}


@functools.cache
def _results() -> list[dict]:
    return run_ranks(_all, WORKERS, timeout=240)


@pytest.mark.parametrize("name", list(RUNS))
def test_batched_hook_trains_bit_for_bit_as_one_exchange_per_tensor(name):
    by_rank = _results()
    for rank, got in enumerate(by_rank):
        alone, together = got[(name, False)], got[(name, True)]
        assert not alone["calls"]
        assert together["calls"] and max(together["calls"]) > 1, "nothing was batched"
        for step, (a, b) in enumerate(zip(alone["params"], together["params"])):
            bad = [n for n in a if not torch.equal(a[n], b[n])]
            assert not bad, f"{name}, rank {rank}, step {step}: {bad} differ"
        assert alone["residuals"].keys() == together["residuals"].keys()
        assert all(torch.equal(alone["residuals"][n], together["residuals"][n])
                   for n in alone["residuals"])
    for got in by_rank[1:]:  # the replicas agree
        assert all(torch.equal(got[(name, True)]["params"][-1][n], t)
                   for n, t in by_rank[0][(name, True)]["params"][-1].items())
