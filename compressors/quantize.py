"""Quantizers: SignSGD with majority vote, EF-SignSGD, QSGD and TernGrad.

Every element is sent, at fewer bits: signs packed 8 to a byte, QSGD's signed levels
and TernGrad's ternaries as the smallest integer type that holds them, plus float32
scales. All four quantize layer-wise: each tensor of `ctx.layout` gets its own scale
(QSGD: its own buckets), so a tensor is quantized the same whether it travels alone or
inside a DDP bucket. Statistics are computed in float32 for 16-bit inputs.

Payloads that differ per worker (signs, levels, per-worker scales) cannot be summed by
an allreduce, so they are allgathered and every worker decodes all of them; TernGrad
with scaler sharing (its paper's default) makes the ternaries summable and allreduces
them as integers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from compressors.base import (
    Compressor,
    Context,
    DecodedSent,
    Exchange,
    Outcome,
    Pattern,
    Segment,
    Sent,
)
from compressors.kernels.counter_stream import draw_seed

# The 1-bit packing (signs 8 to a byte, most significant first), one rank's signs or
# levels added into a total (weights per group of `Groups`), and QSGD's and TernGrad's
# signed stochastic rounding with the counter stream's noise (reference.py defines them):
# one fused pass each where the C++ kernels take the tensor, the same bits either way.
from compressors.kernels.ops import (
    add_levels_,
    add_signs_,
    pack_signs,
    stochastic_levels,
    unpack_signs,
)
from compressors.registry import register
from compressors.requests import AllGather, AllReduce

# The payloads below cover every element (packed) and are allgathered.
ALLGATHER = Pattern.DENSE_ALLGATHER


# ---------------------------------------------------------------------------------------
# Shared pieces: 1-bit packing, per-tensor (or per-bucket) reductions, lazy local decode.
# ---------------------------------------------------------------------------------------


def level_dtype(max_abs: int, summed: bool = False) -> torch.dtype:
    """The smallest signed integer type holding values in [-max_abs, max_abs]. Gloo and
    NCCL have no int16 reductions, so a tensor to be summed skips int16."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if summed and dtype == torch.int16:
            continue
        if max_abs <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def as_bytes(wire: torch.Tensor) -> torch.Tensor:
    """An int16 payload travels as its bytes (no int16 collectives in gloo or NCCL)."""
    return wire.view(torch.uint8) if wire.dtype == torch.int16 else wire


def from_bytes(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return payload.view(dtype) if payload.dtype != dtype else payload


def _positive_int(value: object, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: {what}, a positive integer")
    return value


class Groups:
    """Consecutive groups of elements that tile a flat tensor: the tensors of a layout,
    or QSGD's buckets inside them. Per-group reductions and per-group scaling are
    vectorised: one group, equal-width groups (a view), or torch.segment_reduce."""

    def __init__(self, lengths: list[int], device: torch.device):
        if not lengths or min(lengths) < 1:
            raise ValueError("groups must be non-empty")
        self.count = len(lengths)
        self.numel = sum(lengths)
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self.sizes = self.lengths.to(torch.float32)
        width = lengths[0]
        self.ids: torch.Tensor | None = None
        # Equal widths except a shorter last group: reshape instead of segment_reduce.
        if self.count > 1 and all(n == width for n in lengths[:-1]) and lengths[-1] <= width:
            self.width: int | None = width
            self.full = self.count if lengths[-1] == width else self.count - 1
        else:
            self.width = None
            self.full = 0
            if self.count > 1:
                # The group of every element (4 bytes each), for broadcasting per-group
                # values by one gather: repeat_interleave is several times slower.
                ids = torch.arange(self.count, dtype=torch.int32, device=device)
                self.ids = torch.repeat_interleave(ids, self.lengths)

    @staticmethod
    def of_layout(layout: tuple[Segment, ...], numel: int, device: torch.device,
                  bucket_size: int | None = None) -> Groups:
        """One group per tensor of the layout, or buckets of `bucket_size` inside each."""
        ordered = sorted((s for s in layout if s.numel > 0), key=lambda s: s.offset)
        position = 0
        for s in ordered:
            if s.offset != position:
                raise ValueError(
                    f"layout does not tile the flat gradient: tensor {s.name!r} starts at "
                    f"{s.offset}, expected {position} (segments must be contiguous, in order)"
                )
            position += s.numel
        if position != numel:
            raise ValueError(f"layout covers {position} elements, the gradient has {numel}")
        if bucket_size is None:
            return Groups([s.numel for s in ordered], device)
        lengths: list[int] = []
        for s in ordered:
            full, rest = divmod(s.numel, bucket_size)
            lengths.extend([bucket_size] * full)
            if rest:
                lengths.append(rest)
        return Groups(lengths, device)

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """Where each group starts, and the end: count + 1 int64 on the CPU."""
        return torch.cat([torch.zeros(1, dtype=torch.int64),
                          self.lengths.cpu().cumsum(0)])

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cut = self.full * self.width
        return x[:cut].view(self.full, self.width), x[cut:]

    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """Per-group "sum" or "max" of a flat tensor, shape (count,)."""
        if self.count == 1:
            return (x.sum() if op == "sum" else x.amax()).reshape(1)
        if self.width is not None:
            head, tail = self._split(x)
            parts = [head.sum(1) if op == "sum" else head.amax(1)]
            if tail.numel():
                parts.append((tail.sum() if op == "sum" else tail.amax()).reshape(1))
            return torch.cat(parts)
        return torch.segment_reduce(x, op, lengths=self.lengths)

    def norm(self, x: torch.Tensor, order: int, dtype: torch.dtype) -> torch.Tensor:
        """Per-group ‖x‖₁ or ‖x‖₂ (`order` 1 or 2) in `dtype`, shape (count,): the
        reduction kernel reads x once, with no |x| or x² tensor, for one group and for
        equal widths; ragged groups reduce a full-size |x| or x² by segment_reduce."""
        out = self._norm(x, order, dtype)
        if dtype == torch.float32 and not bool(torch.isfinite(out).all()):
            # Σ|x| or Σx² of finite values overflowed float32 (values near its range):
            # float64 holds them; the caller scales or casts the result back.
            return self._norm(x, order, torch.float64)
        return out

    def _norm(self, x: torch.Tensor, order: int, dtype: torch.dtype) -> torch.Tensor:
        if self.count == 1:
            return torch.linalg.vector_norm(x, order, dtype=dtype).reshape(1)
        if self.width is not None:
            head, tail = self._split(x)
            parts = [torch.linalg.vector_norm(head, order, dim=1, dtype=dtype)]
            if tail.numel():
                parts.append(torch.linalg.vector_norm(tail, order, dtype=dtype).reshape(1))
            return torch.cat(parts)
        x = x.to(dtype)
        total = self.reduce(x.abs() if order == 1 else x * x, "sum")
        return total if order == 1 else total.sqrt_()

    def abs_max(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group max |x|, shape (count,): reduce(x.abs(), "max"), the same values. One
        group (a layer-wise tensor) takes torch.aminmax, with no |x| tensor (26M float32:
        ~6 ms against ~42 here)."""
        if self.count == 1:
            low, high = torch.aminmax(x)
            return torch.maximum(high, low.neg()).abs_().reshape(1)  # abs_: +0.0, as |x|
        return self.reduce(x.abs(), "max")

    def per_element(self, values: torch.Tensor) -> torch.Tensor:
        """values[group of i] for every element i (a broadcast view for one group)."""
        if self.count == 1:
            return values.expand(self.numel)
        if self.ids is None:  # equal widths
            head = values[: self.full, None].expand(self.full, self.width).reshape(-1)
            tail = values[self.full :].expand(self.numel - head.numel())
            return torch.cat([head, tail])
        return values.index_select(0, self.ids)

    def scale_(self, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x *= values[group], in place."""
        if self.count == 1:
            return x.mul_(values)
        if self.width is not None:
            head, tail = self._split(x)
            head.mul_(values[: self.full, None])
            if tail.numel():
                tail.mul_(values[self.full :])
            return x
        return x.mul_(self.per_element(values))


def _groups(ctx: Context, acc: torch.Tensor, bucket_size: int | None = None) -> Groups:
    """The layout's groups, built once per (layout, bucket size) and kept in ctx.state.
    Without a layout the flat tensor is one tensor."""
    layout = ctx.layout or (Segment(ctx.name, 0, acc.numel(), (acc.numel(),)),)
    key = (layout, acc.numel(), bucket_size, str(acc.device))
    cached = ctx.state.get("groups")
    if cached is None or cached[0] != key:
        groups = Groups.of_layout(layout, acc.numel(), acc.device, bucket_size)
        cached = ctx.state["groups"] = (key, groups)
    return cached[1]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics of 16-bit inputs are computed in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------------------------------
# SignSGD with majority vote and EF-SignSGD
# ---------------------------------------------------------------------------------------


@register("signsgd")
class SignSGD(Compressor):
    """signSGD with majority vote (Bernstein et al., ICML 2018 / ICLR 2019).

    Each worker sends sign(g) at 1 bit per element (8 signs per byte, allgathered). The
    aggregate is the vote sign(Σ_w sign(g_w)) ∈ {−1, 0, +1} (0 on a tie), so a plain
    SGD step x ← x − lr·aggregate (no momentum, no gradient scaling) is exactly the
    paper's update: the magnitude of every coordinate's step is the optimizer's lr.
    aggregation="mean" returns the mean of the signs instead (the other common variant).

    A 1-bit wire cannot say "zero": an element equal to 0 votes +1. A tensor that is
    exactly zero on a worker (frozen or unused parameters) abstains from the vote, with a
    one-byte flag per tensor, so it is not moved by ±lr every step. No error feedback by
    default, as in the paper; `sent` is this worker's ±1 vote.
    """

    pattern = ALLGATHER
    default_feedback = "none"

    def __init__(self, aggregation: str = "majority"):
        if aggregation not in ("majority", "mean"):
            raise ValueError(
                f"aggregation={aggregation!r} is invalid: choose 'majority' (the vote "
                "sign(Σ signs), the paper's) or 'mean' (the mean of the signs)"
            )
        self.aggregation = aggregation

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        groups = _groups(ctx, acc)
        packed = pack_signs(acc)
        # 1 where the tensor has a non-zero element: it takes part in the vote.
        voting = (groups.abs_max(acc) > 0).to(torch.int8)
        all_signs, all_voting = yield (AllGather(packed), AllGather(voting))

        votes = ctx.workspace("votes", numel, level_dtype(ctx.world_size), acc.device).zero_()
        for signs, flags in zip(all_signs, all_voting):
            add_signs_(votes, signs, groups, flags)
        if self.aggregation == "majority":
            votes.sign_()
        else:
            votes = votes.to(torch.float32).div_(ctx.world_size)
        # Cast into the caller's gradient where it fits (no full-size float tensor).
        out = ctx.destination(numel, acc.dtype, acc.device)
        aggregate = votes.to(acc.dtype) if out is None else out.copy_(votes)

        def decode() -> torch.Tensor:
            own = unpack_signs(packed, numel, _work_dtype(acc.dtype))
            return groups.scale_(own, voting.to(own.dtype)).to(acc.dtype)

        return Outcome(aggregate=aggregate, sent=DecodedSent(decode))

    def sent_elements(self, numel: int) -> int:
        return numel


@register("efsignsgd")
class EFSignSGD(Compressor):
    """EF-SignSGD (Karimireddy et al., ICML 2019, Algorithm 1): each worker sends the
    scaled sign (‖acc‖₁/d)·sign(acc) of its error-compensated gradient, 1 bit per
    element plus one float32 scale per tensor (d: that tensor's size); the aggregate is
    the mean of the decoded contributions, and residual error feedback keeps the rest.

    The paper puts the learning rate inside the compensation (p = γg + e); the scaled
    sign is positively homogeneous, so with a constant lr keeping it outside (acc = g + e,
    then x ← x − γ·aggregate) is the same algorithm. Elements equal to 0 are sent as +scale
    (a 1-bit wire has no zero); an all-zero tensor has scale 0 and sends zeros.
    """

    pattern = ALLGATHER
    default_feedback = "residual"

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        work = _work_dtype(acc.dtype)
        groups = _groups(ctx, acc)
        norms = groups.norm(acc, 1, work)  # (float64 where float32 would overflow)
        scales = (norms / groups.sizes.to(norms.dtype)).float()
        packed = pack_signs(acc)
        all_signs, all_scales = yield (AllGather(packed), AllGather(scales))

        total = ctx.aggregate_buffer(numel, torch.float32, acc.device)
        for signs, scale in zip(all_signs, all_scales):
            add_signs_(total, signs, groups, scale)
        aggregate = total.div_(ctx.world_size).to(acc.dtype)
        return Outcome(aggregate=aggregate, sent=ScaledSignSent(packed, groups, scales, acc.dtype))

    def sent_elements(self, numel: int) -> int:
        return numel


@dataclass
class ScaledSignSent(Sent):
    """EF-SignSGD's contribution scale[group]·sign(acc): error feedback subtracts it
    straight from the packed bytes (add_signs_ with −scale: a − s·w and a + (−s)·w are
    the same float), with no decoded full-size tensor."""

    packed: torch.Tensor
    groups: Groups
    scales: torch.Tensor
    dtype: torch.dtype

    def subtract_from(self, buffer: torch.Tensor) -> None:
        add_signs_(buffer, self.packed, self.groups, self.scales.neg())

    def dense(self, numel: int) -> torch.Tensor:
        signs = unpack_signs(self.packed, numel, torch.float32)
        return self.groups.scale_(signs, self.scales).to(self.dtype)


@dataclass
class LevelsSent(Sent):
    """QSGD's and TernGrad's contribution weight[group]·level: error feedback subtracts
    it straight from the levels (add_levels_ with −weight: the same floats), with no
    decoded full-size tensor."""

    levels: torch.Tensor
    groups: Groups
    weights: torch.Tensor
    dtype: torch.dtype

    def subtract_from(self, buffer: torch.Tensor) -> None:
        if buffer.dtype == torch.float32:
            add_levels_(buffer, self.levels, self.groups, self.weights.neg())
        else:
            buffer.sub_(self.dense(buffer.numel()).to(buffer.dtype))

    def dense(self, numel: int) -> torch.Tensor:
        decoded = self.levels.to(torch.float32)
        return self.groups.scale_(decoded, self.weights.to(torch.float32)).to(self.dtype)


# ---------------------------------------------------------------------------------------
# QSGD
# ---------------------------------------------------------------------------------------


@register("qsgd")
class QSGD(Compressor):
    """QSGD (Alistarh et al., NeurIPS 2017): per bucket v of `bucket_size` consecutive
    elements of a tensor, send ‖v‖₂ and, per element, sign(v_i)·ξ_i where ξ_i stochastically
    rounds s·|v_i|/‖v‖₂ to one of the integers 0..s (s = `levels`), up with probability
    equal to the fractional part. The decoded ‖v‖₂·sign(v_i)·ξ_i/s is unbiased, with
    variance at most min(B/s², √B/s)·‖v‖² per bucket (Lemma 3.1), so more levels or
    smaller buckets mean less noise.

    Defaults are GRACE's (levels=127, bucket_size=128). The wire is one float32 norm per
    bucket plus the signed levels in the smallest integer type that holds ±s (int8 for
    s ≤ 127): the paper's Elias coding of the levels is not modelled. Randomness comes
    from the worker's private generator. No error feedback by default: the paper runs
    QSGD as an unbiased estimator without it.
    """

    pattern = ALLGATHER
    default_feedback = "none"

    def __init__(self, levels: int = 127, bucket_size: int = 128):
        self.levels = _positive_int(levels, "levels", "the number of quantization levels s")
        if self.levels > torch.iinfo(torch.int32).max:
            raise ValueError(f"levels={levels!r} is too large: at most {2**31 - 1}")
        self.bucket_size = _positive_int(
            bucket_size, "bucket_size", "the number of elements sharing one norm"
        )

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        work = _work_dtype(acc.dtype)
        x = acc.to(work)
        groups = _groups(ctx, acc, self.bucket_size)
        norms = groups.norm(x, 2, work)
        # s/‖v‖ per bucket; an all-zero bucket quantizes to zeros instead of 0/0.
        inv = torch.where(norms > 0, self.levels / norms.clamp_min(torch.finfo(work).tiny),
                          0.0).to(work)
        # s·|v_i|/‖v‖ ∈ [0, s], rounded stochastically to an integer level, signed
        # the levels in a workspace kept per tensor (the wire, and error feedback's at the
        # end of the step: Context.workspace)
        wire_dtype = level_dtype(self.levels)
        wire = stochastic_levels(x, groups, inv, None, self.levels, draw_seed(ctx.generator),
                                 wire_dtype, out=ctx.workspace("levels", numel, wire_dtype, x.device))
        norms = norms.float()
        all_levels, all_norms = yield (AllGather(as_bytes(wire)), AllGather(norms))

        total = ctx.aggregate_buffer(numel, torch.float32, acc.device)
        for levels, norm in zip(all_levels, all_norms):
            add_levels_(total, from_bytes(levels, wire.dtype), groups, norm / self.levels)
        aggregate = total.div_(ctx.world_size).to(acc.dtype)
        sent = LevelsSent(wire, groups, norms / self.levels, acc.dtype)
        return Outcome(aggregate=aggregate, sent=sent)

    def sent_elements(self, numel: int) -> int:
        return numel


# ---------------------------------------------------------------------------------------
# TernGrad
# ---------------------------------------------------------------------------------------


@register("terngrad")
class TernGrad(Compressor):
    """TernGrad (Wen et al., NeurIPS 2017), layer-wise: per tensor, clip g to [−cσ, cσ]
    (c = `clip`, 2.5 in the paper; clip=None disables), take the scaler s = max|g|, and
    send s·sign(g_i)·b_i with b_i ~ Bernoulli(|g_i|/s): unbiased for the clipped g.

    scaler_sharing=True (the paper's scheme, Section 3.1) first takes s as the maximum of
    the workers' scalers (an AllReduce(max) of one float32 per tensor), so the ternaries
    of all workers share a scale and are summed by an integer AllReduce (int8 up to 127
    workers, int32 above). scaler_sharing=False allgathers each worker's ternaries and scalers.

    σ here is the root mean square of the tensor (its spread about zero, which is what
    the symmetric clip bounds). The authors' code uses the standard deviation about the
    mean; the two agree for zero-mean gradients, and this one does not clip a constant or
    offset tensor to zero. No error feedback by default, as in the paper.
    """

    pattern = Pattern.INTEGER_SUM
    default_feedback = "none"

    def __init__(self, clip: float | None = 2.5, scaler_sharing: bool = True):
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (
                math.isfinite(clip) and clip > 0
            ):
                raise ValueError(
                    f"clip={clip!r} is invalid: the clipping factor c (|g| ≤ c·σ) must be a "
                    "positive finite number, or None to disable clipping"
                )
            clip = float(clip)
        if not isinstance(scaler_sharing, bool):
            raise ValueError(f"scaler_sharing={scaler_sharing!r} is invalid: use True or False")
        self.clip = clip
        self.scaler_sharing = scaler_sharing
        if not scaler_sharing:
            # Per-worker scales: the ternaries cannot be summed, they are allgathered.
            self.pattern = ALLGATHER

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        work = _work_dtype(acc.dtype)
        x = acc.to(work)
        groups = _groups(ctx, acc)
        bound = None  # per tensor: |g| is clipped to cσ
        if self.clip is not None:
            norms = groups.norm(x, 2, work)  # (float64 where float32 would overflow)
            rms = (norms / groups.sizes.to(norms.dtype).sqrt()).to(work)
            bound = rms * self.clip
        # The scaler max_i min(|g_i|, cσ) is min(max_i |g_i|, cσ): no clipped copy of g.
        scaler = groups.abs_max(x)
        if bound is not None:
            scaler = torch.minimum(scaler, bound)
        scaler = scaler.float()
        if self.scaler_sharing:
            scaler = yield AllReduce(scaler, op="max")
        # b_i ~ Bernoulli(min(|g_i|, cσ)/s), sent as sign(g_i)·b_i (the levels of s = 1);
        # an all-zero tensor (s = 0) gives zeros, not 0/0.
        inv = torch.where(scaler > 0, 1.0 / scaler.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        # the levels, and the allreduce's copy of them, in workspaces kept per tensor
        # (Context.workspace)
        ternary = stochastic_levels(x.to(torch.float32), groups, inv,
                                    None if bound is None else bound.float(), 1,
                                    draw_seed(ctx.generator), torch.int8,
                                    out=ctx.workspace("levels", numel, torch.int8, x.device))

        if self.scaler_sharing:
            wire = ctx.workspace("wire", numel, level_dtype(ctx.world_size, summed=True),
                            x.device).copy_(ternary)
            summed = yield AllReduce(wire)
            total = ctx.aggregate_buffer(numel, torch.float32, acc.device, zero=False)
            aggregate = groups.scale_(total.copy_(summed), scaler / ctx.world_size).to(acc.dtype)
        else:
            all_ternary, all_scalers = yield (AllGather(ternary), AllGather(scaler))
            total = ctx.aggregate_buffer(numel, torch.float32, acc.device)
            for tern, s in zip(all_ternary, all_scalers):
                add_levels_(total, tern, groups, s)
            aggregate = total.div_(ctx.world_size).to(acc.dtype)
        return Outcome(aggregate=aggregate, sent=LevelsSent(ternary, groups, scaler, acc.dtype))

    def sent_elements(self, numel: int) -> int:
        return numel
