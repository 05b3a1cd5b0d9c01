"""Are the ranks' models identical? `check_replicas` compares every parameter across the
ranks of a process group, bit for bit (repro.replicacheck runs it after training through
the DDP hook; the trainer every cluster.replica_check_every steps).
"""

from typing import Any

import torch
import torch.distributed as dist


class ReplicasDiffer(RuntimeError):
    """The ranks' parameters are not bit-identical (check_replicas)."""


def check_replicas(model: torch.nn.Module, process_group: Any = None,
                   step: int | None = None) -> None:
    """Compare every parameter across ranks, bit for bit, and raise ReplicasDiffer on
    every rank, naming the first parameter that differs and the ranks that differ from
    rank 0, if any does. Each rank sends two 64-bit checksums per parameter (the sum of
    its bits read as integers, and that sum weighted by position): exact integer sums,
    the same whatever the order or the thread count."""
    named = [(n.removeprefix("module."), p.detach()) for n, p in model.named_parameters()]
    if not named:
        return
    sums = torch.stack([_fingerprint(p) for _, p in named])  # [params, 2] int64
    world = dist.get_world_size(process_group)
    device = named[0][1].device
    local = sums.to(device)
    every = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(every, local, group=process_group)
    table = torch.stack(every).cpu()  # [rank, params, 2]
    differ = (table != table[0]).any(dim=2)  # [rank, params]
    if not bool(differ.any()):
        return
    first = int(differ.any(dim=0).nonzero()[0])
    ranks = differ[:, first].nonzero().flatten().tolist()
    when = "" if step is None else f" after step {step}"
    raise ReplicasDiffer(
        f"replicas differ{when}: parameter {named[first][0]!r} on rank(s) "
        f"{', '.join(map(str, ranks))} differs from rank 0's (the first of "
        f"{int(differ.any(dim=0).sum())} differing parameters, in model order). Every rank "
        "must apply the same update: a decode that depends on arrival order, a per-rank "
        "decision, or a rank-local change to the model breaks that")


_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """(Σ bits, Σ bits·(position mod 65521 + 1)) of a tensor, as int64 (wrapping)."""
    flat = p.reshape(-1)
    view = _INT_VIEW.get(flat.dtype)
    bits = flat.view(view).to(torch.int64) if view is not None else flat.to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()]).cpu()
