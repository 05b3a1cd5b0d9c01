"""Uniform THC, Tensor Homomorphic Compression (Li et al.), Algorithm 1: compressed values
that sum.

Every worker quantises stochastically onto the SAME 2^b uniform levels between the
global min and max (the preliminary round, lines 6-10: one tiny allreduce of the
extremes), so the integer levels of all workers can be summed without decompressing them
(Homomorphic USQ, Definition 4.1, lines 15-19; compressors/integer_sum.py forms the sum);
one decompression of the sum, divided by n, is the unbiased mean estimate (line 21).
Unbiased, so no error feedback by default (Algorithm 1 has none). The non-uniform
version with THC's pre-processing is compressors/thc.py.
"""

from __future__ import annotations

import math

import torch

from compressors.base import Context, DecodedSent, Exchange, Outcome
from compressors.integer_sum import IntegerSum, affine_mean, check_bits, dtype_name, per_chunk_
from compressors.kernels import thc_pipeline
from compressors.kernels.counter_stream import draw_seed
from compressors.kernels.ops import stream_noise
from compressors.registry import register
from compressors.requests import AllReduce


def uniform_encode(
    x: torch.Tensor, lo: float, hi: float, bits: int, generator: torch.Generator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Homomorphic USQ (Definition 4.1): stochastic rounding of x onto the 2^b uniform
    levels of [lo, hi] shared by all workers; the level indices (uint8, in x's shape;
    written into `out`, a contiguous uint8 tensor of x's numel on x's device, if given).
    The noise is the counter-hash stream (over x's flattened positions) of one seed drawn
    from `generator`; contiguous CPU float32 takes one fused native pass, the same bits."""
    levels = 2**bits - 1
    step = (hi - lo) / levels
    x = x.to(torch.float32)
    if not float(torch.tensor(step, dtype=torch.float32)) > 0:  # constant: all at lo
        if out is not None:
            return out.zero_().view(x.shape)
        return torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    seed = draw_seed(generator)
    fused = thc_pipeline.uniform_encode(x, lo, step, levels, seed, out)
    if fused is not None:
        return fused
    u = torch.sub(x, lo).div_(step).clamp_(0, levels)
    noise = stream_noise(x.numel(), seed, x.device).view(x.shape)
    u.add_(noise).floor_().clamp_(max=levels)
    return u.to(torch.uint8) if out is None else out.view(x.shape).copy_(u)


def uniform_decode(
    level_sum: torch.Tensor, lo: float, hi: float, bits: int, workers: int
) -> torch.Tensor:
    """lo + (Σ levels / n)·(hi − lo)/(2^b − 1): one decompression of the summed levels."""
    step = (hi - lo) / (2**bits - 1)
    return affine_mean(level_sum, step, lo, workers, workers)


@register("thc_uniform")
class UniformTHC(IntegerSum):
    """Uniform THC (Algorithm 1): global min/max, homomorphic USQ onto 2^b levels,
    integer sum, one decompression. Unbiased, so no error feedback by default (the
    paper's Algorithm 1 has none). `sum_dtype="auto"` picks the smallest integer type
    that holds n·(2^b − 1)."""

    default_feedback = "none"

    def __init__(
        self,
        bits: int = 4,
        sum_dtype: str = "auto",
        aggregation: str = "allreduce",
        loss_rate: float = 0.0,
        loss_direction: str = "both",
        chunk_size: int = 256,
        stragglers: int = 0,
    ):
        self.bits = check_bits(bits)
        self._init_aggregation(
            sum_dtype, aggregation, loss_rate, loss_direction, chunk_size, stragglers
        )

    def _max_value(self) -> int:
        return 2**self.bits - 1

    def _overflow_message(self, workers: int, dtype: torch.dtype) -> str:
        top = torch.iinfo(dtype).max
        fits = int(math.floor(math.log2(top // workers + 1))) if top // workers >= 1 else 0
        return (
            f"thc_uniform: {workers} workers summing {self.bits}-bit levels reach "
            f"{workers * self._max_value()}, which overflows {dtype_name(dtype)} (max {top}); "
            f"the largest bit budget that fits {workers} workers is bits={min(fits, 8)}; "
            "or set sum_dtype='auto'"
        )

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        dtype = self._check_workers(ctx.world_size)
        x = acc.to(torch.float32)
        # the preliminary round, lines 6-10: the global max and min
        extremes = torch.stack([x.max(), x.min().neg()]).to(torch.float64)
        extremes = yield AllReduce(extremes, op="max")
        hi, lo = float(extremes[0]), -float(extremes[1])
        # lines 15-16; the levels go into a workspace kept per tensor (error feedback reads
        # them at the end of the step, Context.workspace)
        levels = uniform_encode(x, lo, hi, self.bits, ctx.generator,
                                out=ctx.workspace("levels", x.numel(), torch.uint8, x.device))
        got = yield from self._aggregate(levels, levels, None, dtype, ctx)
        step = (hi - lo) / (2**self.bits - 1)
        # line 21: the estimate of the average from the sum
        mean = affine_mean(got.total, step, lo, got.count, got.divisor, self.chunk_size,
                           out=ctx.destination(acc.numel(), torch.float32, acc.device))
        if got.lost_down is not None:
            per_chunk_(mean, self.chunk_size, (~got.lost_down).to(mean.dtype), "mul")
        # the contribution is decoded from the levels only if asked (error feedback asks
        # within the step; the levels' workspace is rewritten by the next one)
        sent = DecodedSent(lambda: affine_mean(levels, step, lo, 1, 1).to(acc.dtype))
        extra = self._extra(got, dtype, acc.numel())
        return Outcome(aggregate=mean.to(acc.dtype), sent=sent, extra=extra)

    def sent_elements(self, numel: int) -> int:
        return numel
