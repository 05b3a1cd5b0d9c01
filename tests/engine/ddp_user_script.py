"""A user's own DDP training script with a compressor, as README's "Use a compressor in
your own DDP training" shows it, run under torchrun by tests/engine/test_hook_contract.py:

    torchrun --standalone --nproc-per-node 3 tests/engine/ddp_user_script.py OUT_DIR

A model with a branch that is unused on some steps (every rank's on some, one rank's on
others), so DDP needs find_unused_parameters=True; 20 steps with each of topk, deft and
sidco_e, the replicas checked bit for bit after every step; then a NaN on one rank's
loss, caught as NonFiniteGradient around backward on every rank, and training goes on.
Each rank writes what it saw to OUT_DIR/<rank>.json.
"""

import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import repro.hooks
from repro.hooks import NonFiniteGradient

STEPS = 20
COMPRESSORS = {"topk": {"ratio": 0.05}, "deft": {"ratio": 0.05}, "sidco_e": {"ratio": 0.05}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 64)
        self.branch = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.stem(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)


def train(name: str, rank: int, steps: int, nan_at: int | None = None) -> dict:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, find_unused_parameters=True)
    state, hook = repro.hooks.make(name, model=ddp, **COMPRESSORS[name])
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, caught = [], []
    for step in range(steps):
        x, y = batch(rank, step)
        # Unused by every rank at steps 1, 5, 9, ...; by rank 1 alone at steps 2, 6, ...
        use_branch = step % 4 != 1 and not (step % 4 == 2 and rank == 1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x, use_branch), y)
        if step == nan_at and rank == 1:
            loss = loss * float("nan")
        try:
            loss.backward()
        except NonFiniteGradient as exc:  # raised on every rank, the step not taken
            caught.append({"step": step, "message": str(exc)})
            continue
        opt.step()
        losses.append(loss.item())
        repro.hooks.check_replicas(ddp, step=step)  # ReplicasDiffer if any rank differs
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return {"losses": losses, "caught": caught, "params": digest.hexdigest(),
            "steps": state.step}


def main(out_dir: str) -> None:
    # A collective that waits longer than this is a fault: fail, not hang.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    report = {name: train(name, rank, STEPS) for name in COMPRESSORS}
    report["nan"] = train("topk", rank, 4, nan_at=1)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
