"""The typed base of every compressor, and the pieces protocols share.

A compressor is stateless configuration plus one method, `protocol`, a generator that
runs ONE worker's side of a step: it encodes the (error-compensated) flat gradient,
yields collective requests (compressors.requests), decodes the answers and returns an
`Outcome`: the averaged update every worker applies, what this worker sent (so error
feedback can keep the rest), and the counts metrics need. Per-tensor state that must
persist across steps (PowerSGD's Q, SIDCo's stage count) lives in `ctx.state`, owned by
the worker's Session, so one compressor object serves any number of workers.
"""

from __future__ import annotations

import abc
import enum
import inspect
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from compressors.kernels import ops
from compressors.kernels.types import Selected
from compressors.requests import AllGather, AllReduce, Request

Result = TypeVar("Result")
# One worker's side of a collective exchange: a generator that yields requests (one, or a
# round of several issued together), is sent their answers, and returns its result: the
# Outcome of a compressor's `protocol`, the mean of allreduce_mean. Both drivers (the
# simulated one, the DDP hook's) run it; written Exchange[Outcome] and so on.
Exchange = Generator["Request | tuple[Request, ...]", Any, Result]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Pattern(str, enum.Enum):
    """The communication a compressor needs; declared, so trainers never hard-code it."""

    DENSE_ALLREDUCE = "dense-allreduce"
    SPARSE_ALLGATHER = "sparse-allgather"
    DENSE_ALLGATHER = "dense-allgather"  # quantised payloads of every element (QSGD, signs)
    INDEX_ALLGATHER_VALUE_ALLREDUCE = "allgather-indices+allreduce-values"
    LEADER_BROADCAST = "broadcast-from-leader"
    INTEGER_SUM = "homomorphic-integer-sum"


@dataclass(frozen=True)
class Segment:
    """One named tensor inside a flat gradient (a parameter inside a bucket)."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def flatten_named(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, tuple[Segment, ...]]:
    """Concatenate named tensors (a model's gradients, a bucket's parameter views) into
    one flat tensor and the layout that remembers their boundaries and shapes."""
    if not named:
        raise ValueError("flatten_named needs at least one (name, tensor) pair")
    layout = []
    offset = 0
    for name, t in named:
        layout.append(Segment(name, offset, t.numel(), tuple(t.shape)))
        offset += t.numel()
    flat = torch.cat([t.reshape(-1) for _, t in named])
    return flat, tuple(layout)


def unflatten(flat: torch.Tensor, layout: tuple[Segment, ...]) -> dict[str, torch.Tensor]:
    """Views of `flat` shaped as the layout's tensors, by name."""
    return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in layout}


@dataclass
class Context:
    """What a protocol knows about the step it runs in, for one worker."""

    rank: int
    world_size: int
    step: int
    name: str
    state: dict[str, Any]
    generator: torch.Generator
    shared_seed: int
    # The tensors inside the flat gradient: always set by the Session (a single segment
    # with the gradient's own shape when the caller gives no layout).
    layout: tuple[Segment, ...] = ()
    # True when `acc` is a buffer the protocol may overwrite (for example a DDP
    # bucket buffer with no error feedback). Otherwise protocols must not modify it.
    acc_writable: bool = False
    # False lets protocols skip statistics that cost extra passes (union size, ...).
    measure: bool = True
    # True when the Session left the NaN/Inf check of `acc` to the protocol (the compressor
    # said so by folds_finite_check): its first full read of acc must raise
    # compressors.kernels.ops.NonFinite on a NaN or an Inf, before it changes any state.
    check_finite: bool = False
    # Where the caller wants the aggregate (Session.exchange's `out`: flat, acc's numel,
    # dtype and device), or None. Protocols decode into it through destination and
    # aggregate_buffer; nothing else may write it. Without error feedback it is usually
    # acc's own memory (the DDP hook passes the gradient, which the aggregate replaces):
    # so a protocol asks for it only once it has read acc for the last time, and keeps
    # nothing that aliases acc in its Sent.
    out: torch.Tensor | None = None
    # True when `out` shares memory with acc (see above).
    out_is_acc: bool = False
    # The workspaces this worker keeps for this tensor between steps (ctx.workspace),
    # owned by the Session like `state` but never checkpointed: they hold nothing a later
    # step reads.
    workspaces: dict[str, torch.Tensor] = field(default_factory=dict)

    def workspace(self, key: str, numel: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        """A flat tensor of numel elements, contents undefined, for a buffer the protocol
        writes whole each step (a wire it hands to a collective): on the CPU the same one
        every step for this tensor (a fresh large CPU tensor costs a page fault per 4 KiB
        on first touch, more than filling it), elsewhere a fresh one (their caching
        allocators reuse memory already). A step must be done with it before the next
        step of the same tensor asks for it again, as every driver here is."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self.workspaces.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            self.workspaces.pop(key, None)  # the old one given back before the new one is had
            buf = self.workspaces[key] = ops.empty(numel, dtype)
        return buf

    def destination(self, numel: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor | None:
        """The caller's `out` when it has this numel, dtype and device, else None. Ask only
        after the last read of acc: it may be acc's own memory (out_is_acc)."""
        out = self.out
        if (out is not None and out.numel() == numel and out.dtype == dtype
                and out.device == torch.device(device)):
            return out
        return None

    def aggregate_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                         zero: bool = True) -> torch.Tensor:
        """A flat tensor to decode the aggregate into, zeroed unless `zero=False` (for
        a decoder that writes every element itself): the caller's `out` when it fits (a
        DDP gradient: no full-size buffer is allocated per step, and none is copied
        back), else a new one. Like destination, only after the last read of acc."""
        out = self.destination(numel, dtype, device)
        if out is not None:
            return out.zero_() if zero else out
        if zero:
            return torch.zeros(numel, dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)

    @property
    def is_leader(self) -> bool:
        """The cyclic leader of this step (CLT-k, DEFT, THC's preliminary rounds)."""
        return self.rank == self.step % self.world_size

    @property
    def leader(self) -> int:
        return self.step % self.world_size


class Sent(abc.ABC):
    """What one worker contributed, in its own coordinates; error feedback keeps the rest."""

    @abc.abstractmethod
    def subtract_from(self, buffer: torch.Tensor) -> None:
        """buffer -= densified contribution, in place."""

    @abc.abstractmethod
    def dense(self, numel: int) -> torch.Tensor:
        """The contribution as a dense flat tensor (tests and metrics)."""


@dataclass
class SparseSent(Sent):
    indices: torch.Tensor
    values: torch.Tensor

    def subtract_from(self, buffer: torch.Tensor) -> None:
        buffer.index_add_(0, self.indices, self.values.to(buffer.dtype), alpha=-1)

    def dense(self, numel: int) -> torch.Tensor:
        out = torch.zeros(numel, dtype=self.values.dtype, device=self.values.device)
        out.index_add_(0, self.indices, self.values)
        return out


class Overwritten(Sent):
    """The contribution of a protocol whose aggregate was written over acc itself (no
    error feedback, and the caller gave acc's memory up for the aggregate: Session's
    `writable`, or `out` that is the gradient), where no copy was kept for it: nothing
    to subtract or show. Error feedback never gets here (acc is then its own buffer,
    which the caller's out never is)."""

    def _refuse(self):
        raise RuntimeError(
            "this worker's contribution was not kept: the aggregate was written over the "
            "gradient it came from (no error feedback, out= or writable= given to "
            "Session.exchange); call exchange without them to keep it")

    def subtract_from(self, buffer: torch.Tensor) -> None:
        self._refuse()

    def dense(self, numel: int) -> torch.Tensor:
        self._refuse()


@dataclass
class DecodedSent(Sent):
    """This worker's contribution, decoded only when error feedback (or a caller of
    dense) asks for it, once: from the worker's own payload, or from acc where acc is not
    written before the feedback has read it (never when Context.out_is_acc)."""

    decode: Callable[[], torch.Tensor]
    _tensor: torch.Tensor | None = field(default=None, repr=False)

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self.decode()
        return self._tensor

    def subtract_from(self, buffer: torch.Tensor) -> None:
        buffer.sub_(self.tensor().to(buffer.dtype))

    def dense(self, numel: int) -> torch.Tensor:
        return self.tensor()


@dataclass
class DenseSent(Sent):
    tensor: torch.Tensor

    def subtract_from(self, buffer: torch.Tensor) -> None:
        buffer.sub_(self.tensor.to(buffer.dtype))

    def dense(self, numel: int) -> torch.Tensor:
        return self.tensor


@dataclass
class Outcome:
    """Result of one worker's protocol for one tensor and step.

    aggregate: the averaged update (flat, the input's dtype), identical on every worker.
    sent: this worker's contribution in its own coordinates; read it before this worker's
        next step of the same tensor (it may live in workspaces reused then,
        Context.workspace).
    selected: k̂, elements this worker selected (sparsifiers), else None.
    target: k, elements it was asked to select, else None.
    union: distinct coordinates in the aggregate (actual density · d), when known.
    bytes_sent: bytes per worker the collectives moved (an unequal AllGather counts the
        longest payload, as the padded collective carries it), filled by the Session
        from the requests and their answers.
    collectives: each collective as (kind, bytes per worker) in the order issued, so
        the cost model charges every pattern as it runs (an index allgather and a value
        allreduce are two collectives, not one allgather of all the bytes).
    encode_s / decode_s: filled by the Session.
    """

    aggregate: torch.Tensor
    sent: Sent
    selected: int | torch.Tensor | None = None
    target: int | None = None
    union: int | torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    bytes_sent: int = 0
    collectives: tuple[tuple[str, int], ...] = ()
    rounds: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0


MIN_RATIO = 1e-12  # 1/δ above 10¹² elements: larger than any tensor, finite in float64


def check_ratio(ratio: float, what: str = "ratio") -> float:
    """Validate δ = k/d, the fraction of elements kept."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"{what} must be a number in (0, 1], got {ratio!r}")
    if not (0.0 < float(ratio) <= 1.0) or math.isnan(ratio):
        raise ValueError(
            f"{what}={ratio!r} is out of range: it is the fraction of elements kept, "
            "so it must lie in (0, 1] (for example 0.01 keeps 1%)"
        )
    if float(ratio) < MIN_RATIO:
        raise ValueError(
            f"{what}={ratio!r} is below {MIN_RATIO:g}: no tensor a compressor can hold has "
            f"1/{what} elements (and its reciprocal overflows); give a ratio in "
            f"[{MIN_RATIO:g}, 1]"
        )
    return float(ratio)


def target_k(numel: int, ratio: float) -> int:
    """k = ⌊d·δ⌋ (at least 1). A tiny relative slack keeps 1000·0.001 from flooring to 0."""
    return max(1, min(numel, int(math.floor(numel * ratio * (1 + 1e-12)))))


def index_dtype(numel: int) -> torch.dtype:
    """Indices go over the wire as int32 while they fit: half the bytes of int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def sparse_mean(
    indices: list[torch.Tensor] | torch.Tensor,
    values: list[torch.Tensor] | torch.Tensor,
    numel: int,
    world_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """Batched sparse decoding (DRAGONN 4.3): every rank's (index, value) pairs added into
    a zero dense tensor, duplicates summed, then divided by the world size. `out`: the
    flat tensor of numel elements of dtype to decode into, whatever it holds
    (Context.aggregate_buffer(..., zero=False)); a new one when None.

    Duplicates are summed in rank order, on every device: ranks' payloads, one list entry
    (or `lengths` entry of a concatenation) per rank, each holding an index at most once.
    On the CPU the native kernel sweeps the concatenation once, which is rank order;
    elsewhere one index_add_ per rank, in rank order, so no two additions to one element
    ever race (ops.scatter_mean). Every index must be valid (0 <= i < numel): callers with empty slots
    (DRAGONN's −1) filter them first, or point them at an element with a value of +0.0."""
    if isinstance(indices, list):
        lengths = [int(i.numel()) for i in indices]
        idx = torch.cat(indices) if len(indices) != 1 else indices[0]
    else:
        idx = indices
    val = torch.cat(values) if isinstance(values, list) else values
    val = val.to(dtype)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=val.device)
    return ops.scatter_mean(idx, val, out, world_size, lengths)


def union_size(indices: list[torch.Tensor]) -> int:
    """|∪ indices| over ranks, empty slots (< 0) excluded: DEFT's actual density · d."""
    idx = torch.cat(indices)
    unique = torch.unique(idx)
    return int((unique >= 0).sum())


class Compressor(abc.ABC):
    """Base class. Subclasses set `pattern`, implement `protocol`, and are registered
    with @compressors.register("name")."""

    name: ClassVar[str] = ""
    pattern: ClassVar[Pattern]
    # Selects a subset of coordinates and sends their exact values (DGC momentum
    # correction only makes sense for these).
    sparse: ClassVar[bool] = False
    # Error feedback a researcher gets by default: "none", "residual" or "momentum".
    default_feedback: ClassVar[str] = "residual"
    # Lossless up to dtype rounding: no estimator to check.
    exact: ClassVar[bool] = False
    # What one exchange covers in training (`granularity`, where the caller, the DDP hook
    # or the trainer, chooses): "layer" (each parameter tensor alone, the setting of most
    # papers), "bucket" (a DDP bucket as one tensor) or "model" (the worker's whole
    # gradient as one tensor, with the layout of its parameters). `default_granularity` is
    # this compressor's, the setting of its paper; `granularities` the ones it accepts.
    default_granularity: ClassVar[str] = "layer"
    granularities: ClassVar[tuple[str, ...]] = ("layer", "bucket", "model")

    def params(self) -> dict[str, Any]:
        """Constructor arguments and their current values (for configs and logs)."""
        sig = inspect.signature(type(self).__init__)
        return {
            p: getattr(self, p)
            for p in sig.parameters
            if p != "self" and hasattr(self, p)
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    @abc.abstractmethod
    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        """One worker's side of one step on the flat, error-compensated gradient."""

    def sent_elements(self, numel: int) -> int | None:
        """Elements sent per worker for a tensor of `numel` when it is known in advance
        (fixed-size payloads); None when it depends on the data (thresholds)."""
        return None

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        """Whether this compressor's protocol finds a NaN or an Inf in `acc` in its own
        first full read of it (a native statistics or selection pass), before it changes
        any state, so the Session may skip its separate read pass (ctx.check_finite)."""
        return False


GRANULARITIES = ("layer", "bucket", "model")


def resolve_granularity(compressor: Compressor, granularity: str) -> str:
    """"default" → the compressor's own (Compressor.default_granularity, its paper's
    setting); any other value checked against the ones it accepts
    (Compressor.granularities), with the reason when refused."""
    if granularity == "default":
        return compressor.default_granularity
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}: choose 'default', "
                         + ", ".join(f"'{g}'" for g in GRANULARITIES))
    if granularity not in compressor.granularities:
        raise ValueError(
            f"granularity={granularity!r} is refused for {compressor.name!r}: its algorithm "
            "works across the tensors of one exchange (its paper's setting: "
            f"{compressor.default_granularity!r}); per parameter tensor it would run one "
            "independent instance per tensor, give every small tensor at least one selection "
            "per worker and allocate nothing across layers. Use granularity="
            + " or ".join(repr(g) for g in compressor.granularities))
    return granularity



class Sparsifier(Compressor):
    """Selects coordinates of |acc| and sends their exact values by sparse allgather.

    Subclasses implement `select`; decoding is the batched scatter-add of sparse_mean.
    """

    pattern = Pattern.SPARSE_ALLGATHER
    sparse = True

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio(ratio)

    def target(self, numel: int) -> int:
        """k, the elements to select of a tensor of numel: ⌊d·δ⌋, at least 1 (target_k)."""
        return target_k(numel, self.ratio)

    @abc.abstractmethod
    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
        """What this worker sends of acc for a target of k: Selected(indices, values,
        extra), the values acc's at the indices (Selected.gather reads them), extra the
        selection's diagnostics (threshold, stages, ...), which land in Outcome.extra."""

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        k = self.target(numel)
        chosen = self.select(acc, k, ctx)
        indices, values = chosen.indices.to(index_dtype(numel)), chosen.values
        all_idx, all_val = yield (AllGather(indices), AllGather(values))
        aggregate = sparse_mean(all_idx, all_val, numel, ctx.world_size, acc.dtype,
                                out=ctx.aggregate_buffer(numel, acc.dtype, acc.device,
                                                         zero=False))
        union = union_size(all_idx) if ctx.measure else None
        return Outcome(
            aggregate=aggregate,
            sent=SparseSent(indices, values),
            selected=indices.numel(),
            target=k,
            union=union,
            extra=dict(chosen.extra),
        )


def dense_allreduce(acc: torch.Tensor, ctx: Context) -> Exchange[tuple[torch.Tensor, Sent]]:
    """The uncompressed exchange (`none`, PowerSGD's warm-up): (the mean of acc over
    ranks, this worker's Sent). Reduced in acc's own memory where the caller gave it up
    (ctx.acc_writable, or `out` that is acc itself: no error feedback), as DDP's own
    allreduce does, with nothing copied; else in the caller's `out`, or a copy."""
    out = ctx.destination(acc.numel(), acc.dtype, acc.device)
    if ctx.acc_writable or (out is not None and out.data_ptr() == acc.data_ptr()):
        buf, sent = acc, Overwritten()
    else:
        sent = DenseSent(acc.clone())  # acc may be a feedback buffer updated later
        buf = acc.clone() if out is None or ctx.out_is_acc else out.copy_(acc)
    total = yield from allreduce_mean(buf, ctx.world_size)
    return total, sent


def allreduce_mean(tensor: torch.Tensor, world_size: int) -> Exchange[torch.Tensor]:
    """Sum a dense tensor across ranks and divide by world size (in place)."""
    total = yield AllReduce(tensor)
    if world_size > 1:
        total.div_(world_size)
    return total
