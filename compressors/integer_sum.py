"""Homomorphic aggregation of small non-negative integers, shared by THC and Uniform THC
(Li et al., THC, Sections 4 and 6): the integer type of the sums and its overflow check,
and the two ways the sums are formed.

`aggregation="allreduce"` sums the table values with one integer allreduce: an allreduce
sums what it carries, so the wire carries the values at the sum's width (8 bits by
default, as in the paper's prototype; Section 10 makes the same remark), and
`extra["index_bytes"]` reports the b-bit payload a parameter server receives.
`aggregation="ps"` models the paper's parameter server (Section 6): workers send the
packed b-bit indices (allgather; rank 0 plays the PS), rank 0 looks them up and sums, and
broadcasts the sum. It can simulate, as in Fig. 9:
- packet loss: each chunk of `chunk_size` coordinates is lost independently with
  probability `loss_rate`, on the way to the PS (that worker's chunk counts as a zero
  gradient) and/or on the way back (that worker uses a zero aggregate for the chunk, so
  workers' aggregates differ: the divergence the paper's per-epoch model synchronisation
  repairs; see `loss_direction`);
- stragglers: the PS drops `stragglers` randomly chosen workers each round and divides by
  the number it received (Section 8.3's "wait for the top n% of the workers").
All randomness of the simulation comes from the step's shared seed, so every rank knows
what the PS received (a real PS sends its count in the packet header).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.base import Compressor, Context, Exchange, Pattern
from compressors.requests import AllGather, AllReduce, Broadcast
from compressors.session import mix_seed

# Integer types a collective can sum. int16 is missing on purpose: neither gloo nor
# NCCL reduces it ("Invalid scalar type" from gloo).
SUM_DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
AGGREGATIONS = ("allreduce", "ps")
LOSS_DIRECTIONS = ("up", "down", "both")


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the last dimension of a uint8 tensor of b-bit values (< 2^bits) into bytes,
    least significant first: ceil(m·bits/8) bytes per row."""
    values = values.to(torch.uint8)
    if bits == 8:
        return values.clone()
    m = values.shape[-1]
    lead = values.shape[:-1]
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-m) % per
        if pad:
            values = torch.cat([values, values.new_zeros(*lead, pad)], dim=-1)
        groups = values.unflatten(-1, (-1, per))
        out = groups[..., 0].clone()
        for k in range(1, per):
            out.bitwise_or_(groups[..., k] << (k * bits))
        return out
    planes = torch.stack([(values >> j) & 1 for j in range(bits)], dim=-1).flatten(-2)
    pad = (-planes.shape[-1]) % 8
    if pad:
        planes = torch.cat([planes, planes.new_zeros(*lead, pad)], dim=-1)
    planes = planes.unflatten(-1, (-1, 8))
    out = planes[..., 0].clone()
    for k in range(1, 8):
        out.bitwise_or_(planes[..., k] << k)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` b-bit values of each row (uint8)."""
    if bits == 8:
        return packed[..., :numel]
    if 8 % bits == 0:
        per = 8 // bits
        mask = (1 << bits) - 1
        parts = torch.stack([(packed >> (k * bits)) & mask for k in range(per)], dim=-1)
        return parts.flatten(-2)[..., :numel]
    planes = torch.stack([(packed >> k) & 1 for k in range(8)], dim=-1).flatten(-2)
    planes = planes[..., : numel * bits].unflatten(-1, (numel, bits))
    out = planes[..., 0].clone()
    for j in range(1, bits):
        out.bitwise_or_(planes[..., j] << j)
    return out


def affine_mean(
    total: torch.Tensor,
    scale: float,
    offset: float,
    count: float | torch.Tensor,
    divisor: float,
    chunk_size: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(scale·Σ_i y_i + count·offset)/divisor in float32: the mean of `divisor` workers'
    decompressed values y·scale + offset, `count` of whom contributed (the others a zero
    gradient). `count` may be a tensor with one entry per chunk of `chunk_size`. `out`:
    a float32 tensor of total's size to write it into (else a new one)."""
    if out is None or out.numel() != total.numel():
        out = total.to(torch.float32, copy=True)
    else:
        out = out.view(total.shape).copy_(total)
    out.mul_(scale / divisor)
    if isinstance(count, torch.Tensor):
        per_chunk_(out, chunk_size, count.to(out.dtype).mul_(offset / divisor), "add")
    else:
        out.add_(offset * count / divisor)
    return out


def per_chunk_(t: torch.Tensor, chunk: int, per_chunk: torch.Tensor, op: str) -> None:
    """t[..., c·chunk:(c+1)·chunk] (op)= per_chunk[..., c], in place, by views."""
    m = t.shape[-1]
    full = m // chunk
    if full:
        body = t[..., : full * chunk].unflatten(-1, (full, chunk))
        getattr(body, f"{op}_")(per_chunk[..., :full, None])
    if m % chunk:
        getattr(t[..., full * chunk :], f"{op}_")(per_chunk[..., full : full + 1])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Received:
    total: torch.Tensor  # the integer sum
    count: float | torch.Tensor  # contributions per coordinate (scalar or per chunk)
    divisor: int  # workers the mean is over
    lost_down: torch.Tensor | None  # chunks whose aggregate this worker lost
    received: int  # workers the PS heard from
    lost_up_chunks: int = 0  # chunks lost on the way to the PS (all workers)


class IntegerSum(Compressor):
    """Homomorphic aggregation of small non-negative integers: the sum's dtype, the
    overflow check, the allreduce and the simulated parameter server."""

    pattern = Pattern.INTEGER_SUM
    bits: int

    def _init_aggregation(
        self,
        sum_dtype: str,
        aggregation: str,
        loss_rate: float,
        loss_direction: str,
        chunk_size: int,
        stragglers: int,
    ) -> None:
        if sum_dtype != "auto" and sum_dtype not in SUM_DTYPES:
            raise ValueError(
                f"sum_dtype={sum_dtype!r}: choose 'auto' or one of {', '.join(SUM_DTYPES)} "
                "(int16 is not offered: gloo and NCCL cannot reduce it)"
            )
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation={aggregation!r}: choose 'allreduce' or 'ps' (parameter server)"
            )
        if (
            isinstance(loss_rate, bool)
            or not isinstance(loss_rate, (int, float))
            or not 0.0 <= loss_rate < 1.0
        ):
            raise ValueError(f"loss_rate={loss_rate!r} must be a probability in [0, 1)")
        if loss_direction not in LOSS_DIRECTIONS:
            raise ValueError(f"loss_direction={loss_direction!r}: choose 'up', 'down' or 'both'")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(
                f"chunk_size={chunk_size!r} must be a positive integer (coordinates per packet)"
            )
        if isinstance(stragglers, bool) or not isinstance(stragglers, int) or stragglers < 0:
            raise ValueError(
                f"stragglers={stragglers!r} must be a non-negative integer "
                "(workers dropped per round)"
            )
        if aggregation == "allreduce" and (loss_rate > 0 or stragglers > 0):
            raise ValueError(
                "packet loss and stragglers are simulated at the parameter server: "
                "set aggregation='ps' to use loss_rate or stragglers"
            )
        self.sum_dtype = sum_dtype
        self.aggregation = aggregation
        self.loss_rate = float(loss_rate)
        self.loss_direction = loss_direction
        self.chunk_size = chunk_size
        self.stragglers = stragglers
        if sum_dtype != "auto" and self._max_value() > torch.iinfo(SUM_DTYPES[sum_dtype]).max:
            raise ValueError(self._overflow_message(1, SUM_DTYPES[sum_dtype]))

    def _max_value(self) -> int:
        """The largest integer one worker contributes."""
        raise NotImplementedError

    def _overflow_message(self, workers: int, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def _sum_dtype(self, workers: int) -> torch.dtype:
        """The integer type of the sums; refuses (before any communication) a
        configuration whose sum of `workers` contributions overflows it."""
        biggest = workers * self._max_value()
        if self.sum_dtype == "auto":
            for dtype in SUM_DTYPES.values():
                if biggest <= torch.iinfo(dtype).max:
                    return dtype
            raise ValueError(self._overflow_message(workers, torch.int64))
        dtype = SUM_DTYPES[self.sum_dtype]
        if biggest > torch.iinfo(dtype).max:
            raise ValueError(self._overflow_message(workers, dtype))
        return dtype

    def _check_workers(self, workers: int) -> torch.dtype:
        if self.stragglers >= workers:
            raise ValueError(
                f"stragglers={self.stragglers} would drop every one of the {workers} workers; "
                f"use at most {workers - 1}"
            )
        return self._sum_dtype(workers)

    def _aggregate(
        self,
        indices: torch.Tensor | None,
        mine: torch.Tensor,
        values: torch.Tensor | None,
        dtype: torch.dtype,
        ctx: Context,
    ) -> Exchange[Received]:
        """Sum every worker's table values T[z] (identity table when `values` is None).
        `indices`: this worker's b-bit indices z (1-D; needed by the parameter server
        only); `mine`: its values T[z] (any integer dtype whose values fit `dtype`: they
        are cast to it on the wire)."""
        n = ctx.world_size
        numel = mine.numel()
        if self.aggregation == "allreduce":
            # A copy, in the sum's dtype: the allreduce overwrites its tensor, and `mine`
            # decodes `sent`.
            total = yield AllReduce(ctx.workspace("wire", numel, dtype, mine.device).copy_(mine))
            return Received(total, n, n, None, n)

        chunks = -(-numel // self.chunk_size)
        gen = torch.Generator().manual_seed(mix_seed(ctx.shared_seed, "thc-ps"))
        dropped = torch.randperm(n, generator=gen)[: self.stragglers]
        lost = torch.rand(2, n, chunks, generator=gen) < self.loss_rate
        keep = torch.ones(n, chunks, dtype=torch.bool)
        keep[dropped] = False
        lossy_up = self.loss_rate > 0 and self.loss_direction in ("up", "both")
        lossy_down = self.loss_rate > 0 and self.loss_direction in ("down", "both")
        lost_up_chunks = 0
        if lossy_up:
            lost_up_chunks = int((keep & lost[0]).sum())  # of the workers not dropped
            keep &= ~lost[0]
        received = n - self.stragglers

        gathered = yield AllGather(pack_bits(indices.to(torch.uint8), self.bits))
        if ctx.rank == 0:  # the parameter server: look up, (lose), sum
            every = unpack_bits(torch.stack(gathered), self.bits, numel)
            if values is not None:
                contributions = values.index_select(0, every.flatten().int()).view(n, numel)
            else:
                contributions = every.to(dtype)
            if lossy_up or self.stragglers:
                mask = keep.to(device=contributions.device, dtype=dtype)
                per_chunk_(contributions, self.chunk_size, mask, "mul")
            total = contributions.sum(0, dtype=dtype)
        else:
            total = torch.empty(numel, dtype=dtype, device=mine.device)
        total = yield Broadcast(total, src=0)
        count: float | torch.Tensor = float(received)
        if lossy_up:
            count = keep.sum(0).to(mine.device)
        lost_down = lost[1, ctx.rank].to(mine.device) if lossy_down else None
        return Received(total, count, received, lost_down, received, lost_up_chunks)

    def _extra(self, got: Received, dtype: torch.dtype, payload: int) -> dict:
        """What metrics want beyond the request bytes: the b-bit upload a PS receives
        (`index_bytes`) and, over a PS, what arrived."""
        extra = {
            "sum_dtype": dtype_name(dtype),
            "index_bytes": -(-payload * self.bits // 8),
            "aggregation": self.aggregation,
        }
        if self.aggregation == "ps":
            extra["received"] = got.received
            extra["lost_up_chunks"] = got.lost_up_chunks
            extra["lost_down_chunks"] = 0 if got.lost_down is None else int(got.lost_down.sum())
        return extra


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(
            f"bits={bits!r}: the bit budget per coordinate must be an integer in [1, 8]"
        )
    return bits
