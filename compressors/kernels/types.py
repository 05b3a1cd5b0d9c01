"""What the kernels return, whichever implementation ran: Stats, Selected, NonFinite."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch


class NonFinite(FloatingPointError):
    """A pass asked to check (select(check_finite=True), ...) found a NaN or an Inf. The
    Session turns it into its own error for the gradient (compressors.session)."""


@dataclass(frozen=True)
class Stats:
    """Over the elements counted (all, or |x| > above): count, Σy, Σy² with y = |x| − shift,
    max and min of |x| among them; over all elements: max, nonzeros (#{x ≠ 0}) and
    Σ ln|x| (x ≠ 0)."""

    count: int
    sum: float
    sumsq: float
    max: float
    min: float
    nonzero: int
    log_sum: float

    @classmethod
    def of(cls, out) -> Stats:
        """From a kernel's seven doubles: count, Σy, Σy², max, min, nonzeros, Σ ln|x|."""
        return cls(int(out[0]), out[1], out[2], out[3], out[4], int(out[5]), out[6])


class Selected(NamedTuple):
    """A selection: the indices (1-D, int64 or int32, unique), acc's values at them (the
    same bits as acc.index_select(0, indices), read by the selection pass itself where a
    kernel makes it, so they are not gathered from acc again: scattered reads of lines the
    pass has just pushed out of the cache) and what the selection found out (a threshold,
    a stage count: Outcome.extra, when a sparsifier returns it; empty from the kernels)."""

    indices: torch.Tensor
    values: torch.Tensor
    extra: Mapping[str, Any] = MappingProxyType({})

    @classmethod
    def gather(cls, acc: torch.Tensor, indices: torch.Tensor, **extra: Any) -> Selected:
        """`indices` with acc's values at them, read by one index_select (acc[indices]
        was twice as slow on lines out of the cache)."""
        return cls(indices, acc.index_select(0, indices), extra)
