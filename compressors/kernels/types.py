"""What the kernels return, whichever implementation ran: Stats, Selected, NonFinite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    """What a selection pass may return instead of bare indices: the indices and acc's
    values at them (the same bits as acc.index_select(0, indices)), read by the pass
    itself, so the protocol does not gather them from acc again (scattered reads of lines
    the pass has just pushed out of the cache)."""

    indices: torch.Tensor
    values: torch.Tensor
