"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): rank-r gradient compression by
one step of subspace (power) iteration per SGD step, warm-started from the previous Q.

Per matrix-shaped tensor M (n×m; a tensor of ≥ 2 dims is viewed as (shape[0], -1)):

    P ← M·Q;  P ← Σ_w P_w;  P̂ ← orthonormalise(P);  Q ← Mᵀ·P̂;  Q ← (Σ_w Q_w)/W;  M̃ = P̂·Qᵀ

so M̃ = P̂·P̂ᵀ·mean_w(M_w): the mean of the workers' matrices projected on a subspace all
workers agree on. P needs no division by W (it is orthonormalised); Q is divided once,
which is where GRACE's distributed version goes wrong. Error feedback keeps
M_w − M̃ on each worker, as Algorithm 2 of the paper and PyTorch's powerSGD_hook do.

Communication: all P's of a flat gradient (a DDP bucket) in ONE AllReduce, together
with the tensors sent uncompressed (vectors, and matrices too small for compression to
pay, as PyTorch decides with min_compression_rate) in the same round; then all Q's in
ONE AllReduce. Same-shaped matrices are multiplied in one batched matmul.

Numerics follow PyTorch's hook where it matters for comparing the two: Q is
orthonormalised at the start of every step (mathematically a no-op for the result, it
keeps the warm-started Q well scaled), Gram-Schmidt for rank ≤ 2 and torch.linalg.qr
above. Unlike the hook, a zero column (an all-zero matrix) stays zero instead of
becoming NaN, and a warm-started Q whose column died is redrawn, so a layer whose
gradient was zero once is not stuck at a zero approximation afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compressors.base import (
    Compressor,
    Context,
    Exchange,
    Outcome,
    Pattern,
    Segment,
    Sent,
    dense_allreduce,
)
from compressors.requests import AllReduce
from compressors.registry import register


@dataclass
class _Group:
    """Same-shaped matrices compressed by one batched matmul."""

    rows: int
    cols: int
    rank: int
    offsets: list[int]
    p_start: int
    q_start: int
    # Constant distance between consecutive matrices (they are one strided view of the
    # flat gradient); None: gathered by `index` from a sliding-window view instead.
    stride: int | None = None
    index: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return self.count * self.rows * self.cols

    def p(self, p_flat: torch.Tensor) -> torch.Tensor:
        n = self.count * self.rows * self.rank
        return p_flat[self.p_start : self.p_start + n].view(self.count, self.rows, self.rank)

    def q(self, q_flat: torch.Tensor) -> torch.Tensor:
        n = self.count * self.cols * self.rank
        return q_flat[self.q_start : self.q_start + n].view(self.count, self.cols, self.rank)

    def _view(self, flat: torch.Tensor) -> torch.Tensor:
        size = self.rows * self.cols
        return flat[self.offsets[0] :].as_strided(
            (self.count, self.rows, self.cols), (self.stride or size, self.cols, 1)
        )

    def _windows(self, flat: torch.Tensor) -> torch.Tensor:
        size = self.rows * self.cols
        return flat.as_strided((flat.numel() - size + 1, size), (1, 1))

    def matrices(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(count, rows, cols): a view of `flat` where possible, else a gathered copy."""
        if self.index is None:
            return self._view(flat).to(dtype)
        gathered = self._windows(flat).index_select(0, self.index)
        return gathered.view(self.count, self.rows, self.cols).to(dtype)

    def write(self, out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """out[matrices] = P·Qᵀ, straight into `out` when it is a strided view of it."""
        if self.index is None:
            view = self._view(out)
            if view.dtype == p.dtype:
                torch.bmm(p, q.transpose(1, 2), out=view)
            else:
                view.copy_(torch.bmm(p, q.transpose(1, 2)))
            return
        approx = torch.bmm(p, q.transpose(1, 2)).view(self.count, -1).to(out.dtype)
        self._windows(out).index_copy_(0, self.index, approx)


@dataclass
class _Plan:
    """Which tensors are compressed and where their P's and Q's live; built once per
    layout and kept in ctx.state."""

    key: tuple
    groups: list[_Group]
    p_numel: int
    q_numel: int
    uncompressed: torch.Tensor | None  # int64 positions sent as they are

    @property
    def compressed_numel(self) -> int:
        return sum(g.numel for g in self.groups)


@dataclass
class LowRankSent(Sent):
    """acc − residual for PowerSGD: the agreed approximation P̂Qᵀ on compressed tensors
    (error feedback keeps M_w − P̂Qᵀ), this worker's own values on the tensors sent
    uncompressed (nothing is left over there). `approximation` is the Outcome's
    aggregate itself, not a copy: it is read before the caller gets the aggregate."""

    approximation: torch.Tensor
    uncompressed: torch.Tensor | None = None
    local: torch.Tensor | None = None

    def subtract_from(self, buffer: torch.Tensor) -> None:
        buffer.sub_(self.approximation.to(buffer.dtype))
        if self.uncompressed is not None:
            buffer.index_fill_(0, self.uncompressed, 0)

    def dense(self, numel: int) -> torch.Tensor:
        out = self.approximation.clone()
        if self.uncompressed is not None:
            out.index_copy_(0, self.uncompressed, self.local.to(out.dtype))
        return out


def orthonormalise_(matrices: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns for a batch (b, k, r), in place: Gram-Schmidt for r ≤ 2 (as
    PyTorch's hook), Householder QR above. A zero column stays zero (no 0/0)."""
    rank = matrices.shape[2]
    if rank > 2:
        q, _ = torch.linalg.qr(matrices)
        return matrices.copy_(q)
    tiny = torch.finfo(matrices.dtype).tiny
    for i in range(rank):
        col = matrices[:, :, i : i + 1]
        col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True).clamp_min(tiny))
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest.sub_((col * rest).sum(dim=1, keepdim=True) * col)
    return matrices


@register("powersgd")
class PowerSGD(Compressor):
    """PowerSGD with warm start and error feedback, layer-wise over ctx.layout.

    rank: r of the approximation. Default 2, the paper's setting for image classification
        (ResNet-18 on CIFAR-10; it uses rank 4 for the WikiText-2 LSTM). PyTorch's
        PowerSGDState defaults to 1.
    warm_start: reuse last step's Q (the paper's "reuse query"; True in paper and PyTorch).
        False draws a fresh Q every step.
    start_iter: steps of plain allreduce before compression starts. Default 0: the paper
        compresses from the first step. PyTorch's hook defaults to 1000 (a schedule choice
        for accuracy) and needs ≥ 2 because DDP rebuilds its buckets after step 0; here
        state follows the layout, which it re-plans when it changes.
    min_compression_rate: a matrix is compressed only if (n + m)·r·rate < n·m, else sent
        uncompressed with the vectors (PyTorch's rule and default, 2).

    Q starts as a standard normal matrix drawn from ctx.shared_seed at the first
    compressed step, identical on every rank. P and Q are computed and sent in float32
    for 16-bit gradients (PyTorch computes in the gradient's dtype; sums and Gram-Schmidt
    in fp16 overflow or lose the basis); uncompressed tensors go in the gradient's dtype.
    """

    pattern = Pattern.DENSE_ALLREDUCE
    default_feedback = "residual"

    def __init__(
        self,
        rank: int = 2,
        warm_start: bool = True,
        start_iter: int = 0,
        min_compression_rate: float = 2.0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(
                f"rank={rank!r} is invalid: the approximation rank must be a positive integer"
            )
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start={warm_start!r} is invalid: use True or False")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(
                f"start_iter={start_iter!r} is invalid: the number of uncompressed steps "
                "before PowerSGD starts must be an integer ≥ 0"
            )
        if (
            isinstance(min_compression_rate, bool)
            or not isinstance(min_compression_rate, (int, float))
            or not math.isfinite(min_compression_rate)
            or min_compression_rate < 0
        ):
            raise ValueError(
                f"min_compression_rate={min_compression_rate!r} is invalid: it must be a "
                "finite number ≥ 0 (0 compresses every matrix)"
            )
        self.rank = rank
        self.warm_start = warm_start
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)

    # -- planning (once per layout) ----------------------------------------------------

    def _plan(self, flat: torch.Tensor, ctx: Context) -> _Plan:
        # Without a layout there is no shape to compress: one vector, sent as it is.
        layout = ctx.layout or (Segment(ctx.name, 0, flat.numel(), (flat.numel(),)),)
        key = (layout, flat.numel(), str(flat.device))
        plan = ctx.state.get("plan")
        if plan is not None and plan.key == key:
            return plan
        ctx.state.pop("q", None)  # a new layout (DDP bucket rebuild): restart Q
        plan = ctx.state["plan"] = self._build_plan(layout, flat, key)
        return plan

    def _build_plan(self, layout: tuple[Segment, ...], flat: torch.Tensor, key: tuple) -> _Plan:
        by_shape: dict[tuple[int, int], list[int]] = {}
        uncompressed: list[Segment] = []
        covered = 0
        for s in sorted((s for s in layout if s.numel > 0), key=lambda s: s.offset):
            if math.prod(s.shape) != s.numel:
                raise ValueError(
                    f"layout tensor {s.name!r} has shape {s.shape} but {s.numel} elements"
                )
            if s.offset != covered:
                raise ValueError(
                    f"layout does not tile the flat gradient: tensor {s.name!r} starts at "
                    f"{s.offset}, expected {covered} (segments must be contiguous, in order)"
                )
            covered += s.numel
            if len(s.shape) >= 2:
                rows, cols = s.shape[0], s.numel // s.shape[0]
                r = min(rows, cols, self.rank)
                if (rows + cols) * r * self.min_compression_rate < rows * cols:
                    by_shape.setdefault((rows, cols), []).append(s.offset)
                    continue
            uncompressed.append(s)
        if covered != flat.numel():
            raise ValueError(f"layout covers {covered} elements, the gradient has {flat.numel()}")

        groups = []
        p_numel = q_numel = 0
        for (rows, cols), offsets in by_shape.items():
            r = min(rows, cols, self.rank)
            group = _Group(rows, cols, r, sorted(offsets), p_numel, q_numel)
            gaps = {b - a for a, b in zip(group.offsets, group.offsets[1:])}
            if len(gaps) <= 1:
                group.stride = gaps.pop() if gaps else rows * cols
            else:
                group.index = torch.tensor(group.offsets, dtype=torch.int64, device=flat.device)
            groups.append(group)
            p_numel += group.count * rows * r
            q_numel += group.count * cols * r
        index = None
        if uncompressed:
            ranges = [torch.arange(s.offset, s.offset + s.numel) for s in uncompressed]
            index = torch.cat(ranges).to(flat.device)
        return _Plan(key, groups, p_numel, q_numel, index)

    # -- Q -----------------------------------------------------------------------------

    def _random_q(
        self, plan: _Plan, seed: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Standard normal, drawn on the CPU from the shared seed: the same on every rank
        and every device type."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(plan.q_numel, generator=g).to(device=device, dtype=dtype)

    def _revive_dead_columns(self, plan: _Plan, q: torch.Tensor, seed: int) -> None:
        """Redraw warm-started Q columns that are exactly zero (their matrix was zero last
        step), without a host sync: a zero column would stay zero forever."""
        g = torch.Generator(device=q.device).manual_seed(seed)
        fresh = torch.randn(q.numel(), generator=g, device=q.device, dtype=q.dtype)
        for group in plan.groups:
            qg = group.q(q)
            dead = torch.linalg.vector_norm(qg, dim=1, keepdim=True) == 0
            qg.copy_(torch.where(dead, group.q(fresh), qg))

    # -- one step ----------------------------------------------------------------------

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        flat = acc if acc.is_contiguous() else acc.contiguous()
        plan = self._plan(flat, ctx)
        world = ctx.world_size
        if ctx.step < self.start_iter or not plan.groups:
            total, sent = yield from dense_allreduce(acc, ctx)
            return Outcome(aggregate=total, sent=sent, extra={"compressed_numel": 0})

        work = torch.float32 if acc.dtype in (torch.float16, torch.bfloat16) else acc.dtype
        q = ctx.state.get("q")
        if q is None or not self.warm_start or q.dtype != work:
            q = self._random_q(plan, ctx.shared_seed, work, acc.device)
        else:
            self._revive_dead_columns(plan, q, ctx.shared_seed)

        p = torch.empty(plan.p_numel, dtype=work, device=acc.device)
        matrices = []
        for group in plan.groups:
            m = group.matrices(flat, work)
            torch.bmm(m, orthonormalise_(group.q(q)), out=group.p(p))
            matrices.append(m)
        requests = [AllReduce(p)]
        local = None
        if plan.uncompressed is not None:
            uncompressed = flat.index_select(0, plan.uncompressed)
            local = uncompressed.clone()  # the allreduce overwrites `uncompressed`
            requests.append(AllReduce(uncompressed))
        answers = yield tuple(requests)

        for group, m in zip(plan.groups, matrices):
            torch.bmm(m.transpose(1, 2), orthonormalise_(group.p(p)), out=group.q(q))
        q = yield AllReduce(q)
        q.div_(world)

        # The groups and the uncompressed tensors tile the gradient: every element is
        # written below. flat (acc) is not read after the rounds above.
        aggregate = ctx.aggregate_buffer(flat.numel(), flat.dtype, flat.device, zero=False)
        for group in plan.groups:
            group.write(aggregate, group.p(p), group.q(q))
        if plan.uncompressed is not None:
            aggregate.index_copy_(0, plan.uncompressed, answers[1].div_(world))
        ctx.state["q"] = q
        return Outcome(
            aggregate=aggregate,
            sent=LowRankSent(aggregate, plan.uncompressed, local),
            extra={"compressed_numel": plan.compressed_numel},
        )
