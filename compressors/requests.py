"""Collective requests a compressor's protocol yields to its driver.

A protocol never calls torch.distributed itself. It yields one request, or a tuple of
requests that form one round (the driver may run them concurrently), and receives the
answer: a tensor for AllReduce/Broadcast, a list of per-rank tensors for AllGather (a
tuple of answers for a tuple of requests). The same protocol therefore runs over real
ranks (repro.distributed) and over simulated workers (compressors.simulated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch

ReduceOp = Literal["sum", "max", "min"]


@dataclass(frozen=True)
class AllReduce:
    """Element-wise reduction of one same-shaped tensor from every rank."""

    tensor: torch.Tensor
    op: ReduceOp = "sum"


@dataclass(frozen=True)
class AllGather:
    """Every rank's 1-D tensor, in rank order. Lengths may differ between ranks.

    header: a small int64 table of the same length on every rank (a round's metadata,
    such as the lengths of the payloads batched into its other gathers): a driver that
    learns the round's payload sizes in a collective of its own first (padding unequal
    lengths) may carry it in that collective instead of a collective of its own."""

    tensor: torch.Tensor
    header: bool = False


@dataclass(frozen=True)
class Broadcast:
    """The tensor of rank `src`, sent to all. Non-src ranks pass a buffer of the same
    shape and dtype (its content is ignored)."""

    tensor: torch.Tensor
    src: int


Request = Union[AllReduce, AllGather, Broadcast]


def wire_bytes(request: Request, answer) -> int:
    """Bytes per rank the collective carries for a request, from the request and its
    answer: an AllGather of unequal lengths is padded to the longest (NCCL's and gloo's
    all_gather take equal sizes; repro.distributed pads), so every rank sends the
    longest payload; an AllReduce or a Broadcast carries the tensor."""
    t = request.tensor
    if isinstance(request, AllGather):
        longest = max((a.numel() for a in answer), default=0)
        return longest * t.element_size()
    return t.numel() * t.element_size()


def sent_bytes(request: Request, answer, rank: int) -> int:
    """Bytes this rank sends for a request: wire_bytes, except that only the source of a
    broadcast sends. Counted from what was exchanged, so metrics never estimate it
    separately from the wire."""
    if isinstance(request, Broadcast) and rank != request.src:
        return 0
    return wire_bytes(request, answer)


def kind_of(request: Request) -> str:
    """'allreduce', 'allgather' or 'broadcast' (what the cost model charges)."""
    if isinstance(request, AllReduce):
        return "allreduce"
    if isinstance(request, AllGather):
        return "allgather"
    return "broadcast"


def as_round(item: Request | tuple[Request, ...]) -> tuple[tuple[Request, ...], bool]:
    """Normalise a yielded item into a tuple of requests, and whether it was a tuple."""
    if isinstance(item, tuple):
        if not item:
            raise ValueError("a protocol yielded an empty round of requests")
        for r in item:
            _check_request(r)
        return item, True
    _check_request(item)
    return (item,), False


def _check_request(r: object) -> None:
    if not isinstance(r, (AllReduce, AllGather, Broadcast)):
        raise TypeError(f"a protocol yielded {type(r).__name__}; expected AllReduce, AllGather or Broadcast")
    if isinstance(r, AllGather) and r.tensor.dim() != 1:
        raise ValueError(f"AllGather takes 1-D tensors, got shape {tuple(r.tensor.shape)}")
