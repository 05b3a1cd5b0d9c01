"""The reference points: no compression, fp16 casting, Top-k and Random-k."""

from __future__ import annotations

import torch

from compressors.kernels import ops
from compressors.base import (
    Compressor,
    Context,
    DecodedSent,
    Exchange,
    Outcome,
    Overwritten,
    Pattern,
    Selected,
    Sent,
    Sparsifier,
    SparseSent,
    allreduce_mean,
    check_ratio,
    dense_allreduce,
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

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        total, sent = yield from dense_allreduce(acc, ctx)
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

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        wire_dtype = getattr(torch, self.dtype)
        # The wire, kept between steps on the CPU (never acc itself: it is not ours)
        half = ctx.workspace("wire", acc.numel(), wire_dtype, acc.device).copy_(acc.reshape(-1))
        if ctx.out_is_acc:  # acc is about to hold the aggregate, and no feedback reads it
            sent: Sent = Overwritten()
        else:
            # acc itself stays as it is until error feedback (the only reader) has asked
            # for the contribution: decoded then, without a full-size copy per step.
            sent = DecodedSent(lambda: acc.to(wire_dtype).to(acc.dtype))
        if ctx.world_size > 1:
            half.div_(ctx.world_size)
        total = yield AllReduce(half)
        low, high = torch.aminmax(total)  # (a reduction: no full-size temporary; NaN and
        # ±Inf show in the extremes) every worker holds the same total: all refuse together
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            limit = torch.finfo(wire_dtype).max
            raise ValueError(
                f"gradient {ctx.name!r} has values beyond {self.dtype}'s range (±{limit:.5g}) "
                f"once averaged over {ctx.world_size} worker(s): its {self.dtype} wire "
                "overflowed to Inf. Use fp16 with dtype=bfloat16 (float32's range), scale "
                "the loss down, or clip gradients")
        out = ctx.destination(acc.numel(), acc.dtype, acc.device)
        # (a copy even where acc is 16-bit: total is the wire, which the next step rewrites)
        aggregate = total.to(acc.dtype, copy=True) if out is None else out.copy_(total)
        return Outcome(aggregate=aggregate, sent=sent)

    def sent_elements(self, numel: int) -> int:
        return numel


@register("topk")
class TopK(Sparsifier):
    """Exact Top-k of |acc| (torch.topk): k̂ = k by construction, and the slow reference
    that the threshold estimators are measured against."""

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        return Selected.gather(acc, torch.topk(ops.abs_into_workspace(acc), k,
                                               sorted=False).indices)

    def sent_elements(self, numel: int) -> int:
        return target_k(numel, self.ratio)


# random_subset draws with replacement while k ≤ d / _PERMUTE_ABOVE (then at most about
# 1.15·k draws are expected); above that a full permutation is cheaper than the repeats.
_PERMUTE_ABOVE = 4


def random_subset(numel: int, k: int, generator: torch.Generator,
                  device: torch.device | str) -> torch.Tensor:
    """k distinct indices of [0, numel), a uniformly random k-subset, as int64 in draw
    order: a function of the generator's state only, so ranks seeded alike draw the same.
    O(k log k): indices are drawn with replacement and repeats are dropped, keeping first
    occurrences in draw order (sequential sampling without replacement; taking the
    smallest distinct ones instead would favour small indices), drawing again until k are
    found. torch.randperm(numel)[:k] costs O(numel) (1.7 s at 26M on this 2-core CPU);
    it is used only when k > numel / _PERMUTE_ABOVE."""
    if k * _PERMUTE_ABOVE > numel:
        return torch.randperm(numel, generator=generator, device=device)[:k]
    picked = torch.empty(0, dtype=torch.int64, device=device)
    while picked.numel() < k:
        need = k - picked.numel()
        draws = torch.randint(numel, (need + need // 4 + 16,), generator=generator,
                              device=device)
        cand = torch.cat([picked, draws])
        uniq, inverse = torch.unique(cand, sorted=True, return_inverse=True)
        first = torch.full((uniq.numel(),), cand.numel(), dtype=torch.int64, device=device)
        first.scatter_reduce_(0, inverse, torch.arange(cand.numel(), device=device), "amin")
        picked = cand[first.sort().values]  # each value once, in the order first drawn
    return picked[:k]


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

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        k = target_k(numel, self.ratio)
        g = torch.Generator(device=acc.device)
        g.manual_seed(ctx.shared_seed)
        indices = random_subset(numel, k, g, acc.device).to(index_dtype(numel))
        wire = acc.index_select(0, indices)
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
