"""Run many per-tensor protocols of ONE worker as one protocol with batched collectives.

Layer-wise compression (the papers' setting) runs one protocol per parameter tensor. A DDP
bucket holds many parameters; one collective per parameter per round would make a bucket
cost dozens of small collectives. `multiplex` advances all of a worker's per-tensor
generators together and merges each round's requests: every AllReduce with the same op
and dtype becomes one AllReduce of the concatenation, every AllGather of one dtype one
AllGather (plus one tiny AllGather of the per-tensor lengths, so each rank's
concatenation can be split back, a header the driver may carry in its own size
exchange), every Broadcast with the same source and dtype one
Broadcast. Answers are split and handed back with the usual in-place semantics.

Generators may have different numbers of rounds (PowerSGD sends vectors in one round,
matrices in two): finished ones simply drop out. Every rank runs the same compressor on
the same tensors, so the merged round structure is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from compressors.requests import AllGather, AllReduce, Broadcast, Request, as_round

# This module is infrastructure, not an algorithm: the package loader skips it.


def multiplex(generators: Sequence[Generator[Any, Any, Any]]) -> Generator[Any, Any, list[Any]]:
    """A single protocol whose result is the list of the generators' results, in order."""
    n = len(generators)
    results: list[Any] = [None] * n
    pending: dict[int, tuple[tuple[Request, ...], bool]] = {}
    answers: dict[int, Any] = {i: None for i in range(n)}
    live = list(range(n))
    while True:
        still = []
        for i in live:
            try:
                item = generators[i].send(answers[i])
            except StopIteration as stop:
                results[i] = stop.value
                continue
            pending[i] = as_round(item)
            still.append(i)
        live = still
        if not live:
            return results
        merged_answers = yield from _merged_round([pending[i][0] for i in live])
        answers = {}
        for i, reqs_answers in zip(live, merged_answers):
            is_tuple = pending[i][1]
            answers[i] = tuple(reqs_answers) if is_tuple else reqs_answers[0]


def _merged_round(rounds: list[tuple[Request, ...]]) -> Generator[Any, Any, list[list[Any]]]:
    """Merge the requests of one round of several protocols; per-protocol answer lists."""
    groups: dict[tuple, list[tuple[int, int, Request]]] = {}
    for p, reqs in enumerate(rounds):
        for j, r in enumerate(reqs):
            t = r.tensor
            if isinstance(r, AllReduce):
                key = ("allreduce", r.op, t.dtype, t.device)
            elif isinstance(r, AllGather):
                key = ("allgather", t.dtype, t.device)
            else:
                key = ("broadcast", r.src, t.dtype, t.device)
            groups.setdefault(key, []).append((p, j, r))

    keys = list(groups)
    merged: list[Request] = []
    gather_keys = [k for k in keys if k[0] == "allgather"]
    for key in keys:
        members = groups[key]
        flat = torch.cat([r.tensor.reshape(-1) for _, _, r in members]) if len(members) > 1 \
            else members[0][2].tensor.reshape(-1)
        if key[0] == "allreduce":
            merged.append(AllReduce(flat if len(members) > 1 else members[0][2].tensor, key[1]))
        elif key[0] == "allgather":
            merged.append(AllGather(flat))
        else:
            merged.append(Broadcast(flat if len(members) > 1 else members[0][2].tensor, key[1]))
    if gather_keys:
        device = groups[gather_keys[0]][0][2].tensor.device
        lengths = torch.tensor(
            [r.tensor.numel() for k in gather_keys for _, _, r in groups[k]],
            dtype=torch.int64, device=device,
        )
        merged.append(AllGather(lengths, header=True))

    got = yield tuple(merged)

    per_protocol: list[dict[int, Any]] = [dict() for _ in rounds]
    if gather_keys:
        # lengths_by_rank[rank] lists, in group order, each member's payload length.
        lengths_by_rank = [g.tolist() for g in got[-1]]
    gather_pos = 0
    for key, answer in zip(keys, got):
        members = groups[key]
        if key[0] in ("allreduce", "broadcast"):
            if len(members) == 1:
                p, j, r = members[0]
                per_protocol[p][j] = r.tensor
                continue
            offset = 0
            for p, j, r in members:
                m = r.tensor.numel()
                r.tensor.copy_(answer[offset : offset + m].view_as(r.tensor))
                offset += m
                per_protocol[p][j] = r.tensor
        else:
            count = len(members)
            per_rank_parts = []
            for rank, payload in enumerate(answer):
                lens = lengths_by_rank[rank][gather_pos : gather_pos + count]
                per_rank_parts.append(torch.split(payload, lens))
            for m_idx, (p, j, _r) in enumerate(members):
                per_protocol[p][j] = [parts[m_idx] for parts in per_rank_parts]
            gather_pos += count
    return [[per_protocol[p][j] for j in range(len(reqs))] for p, reqs in enumerate(rounds)]
