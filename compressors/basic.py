"""The reference points: no compression, fp16 casting, Top-k and Random-k."""

from __future__ import annotations

import torch

from compressors.base import (
    Compressor,
    Context,
    DenseSent,
    Outcome,
    Pattern,
    Protocol,
    Sparsifier,
    SparseSent,
    allreduce_mean,
    check_ratio,
    index_dtype,
    target_k,
)
from compressors.registry import register
from compressors.requests import AllReduce


@register("none")
class NoCompression(Compressor):
    """Dense allreduce of the gradient: the baseline every speed-up is measured against."""

    pattern = Pattern.DENSE_ALLREDUCE
    default_feedback = "none"
    exact = True

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        if ctx.acc_writable:
            # Only possible without error feedback: the bucket buffer is reduced in place
            # and nothing reads `sent` afterwards.
            buf, sent = acc, DenseSent(acc)
        else:
            sent = DenseSent(acc.clone())  # acc may be a feedback buffer updated later
            buf = acc.clone()
        total = yield from allreduce_mean(buf, ctx.world_size)
        return Outcome(aggregate=total, sent=sent)

    def sent_elements(self, numel: int) -> int:
        return numel


@register("fp16")
class HalfPrecision(Compressor):
    """Cast to 16 bits, pre-divide by the world size (so the sum cannot overflow where the
    mean would not), allreduce, cast back. `dtype` picks float16 or bfloat16."""

    pattern = Pattern.DENSE_ALLREDUCE
    default_feedback = "none"

    def __init__(self, dtype: str = "float16"):
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"fp16 dtype={dtype!r}: choose 'float16' or 'bfloat16'")
        self.dtype = dtype

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        wire_dtype = getattr(torch, self.dtype)
        half = acc.to(wire_dtype)
        if half is acc:  # already 16-bit: do not modify the caller's tensor
            half = acc.clone()
        sent = DenseSent(half.to(acc.dtype))
        if ctx.world_size > 1:
            half.div_(ctx.world_size)
        total = yield AllReduce(half)
        return Outcome(aggregate=total.to(acc.dtype), sent=sent)

    def sent_elements(self, numel: int) -> int:
        return numel


@register("topk")
class TopK(Sparsifier):
    """Exact Top-k of |acc| (torch.topk): k̂ = k by construction, and the slow reference
    that the threshold estimators are measured against."""

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> torch.Tensor:
        return torch.topk(acc.abs(), k, sorted=False).indices

    def sent_elements(self, numel: int) -> int:
        return target_k(numel, self.ratio)


@register("randomk")
class RandomK(Compressor):
    """k coordinates drawn uniformly without replacement from a seed shared by all ranks
    (tensor name + step), so every rank picks the same indices and the values can be
    allreduced densely. `unbiased=True` scales by d/k (unbiased, higher variance); the
    default sends raw values and relies on error feedback, as GRACE does."""

    pattern = Pattern.DENSE_ALLREDUCE
    sparse = True

    def __init__(self, ratio: float = 0.01, unbiased: bool = False):
        self.ratio = check_ratio(ratio)
        self.unbiased = bool(unbiased)

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        numel = acc.numel()
        k = target_k(numel, self.ratio)
        g = torch.Generator(device=acc.device)
        g.manual_seed(ctx.shared_seed)
        indices = torch.randperm(numel, generator=g, device=acc.device)[:k].to(index_dtype(numel))
        wire = acc[indices]
        if self.unbiased:
            wire.mul_(numel / k)
        # The allreduce overwrites `wire` in place: keep this worker's own copy.
        sent = SparseSent(indices, wire.clone())
        total = yield from allreduce_mean(wire, ctx.world_size)
        aggregate = ctx.aggregate_buffer(numel, acc.dtype, acc.device)
        aggregate.index_copy_(0, indices.long(), total)
        return Outcome(aggregate=aggregate, sent=sent, selected=k, target=k, union=k)

    def sent_elements(self, numel: int) -> int:
        return target_k(numel, self.ratio)
