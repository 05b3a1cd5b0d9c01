"""Any registered compressor inside a user's own DistributedDataParallel model.

    state, hook = repro.hooks.make("sidco_e", ratio=0.01, model=ddp_model)
    ddp_model.register_comm_hook(state, hook)

What one exchange covers (`granularity`, by default the compressor's paper's setting,
Compressor.default_granularity):
- "layer": each parameter's gradient alone, from the bucket's per-parameter views;
  a bucket's per-parameter collectives are merged into a few (compressors.multiplex).
- "bucket": each DDP bucket as one tensor with its parameters' layout.
- "model": the worker's whole gradient as one tensor with every parameter's layout
  (DEFT's norm-based allocation of k across all layers, CLT-k's leader top-k over the
  whole model): the hook holds each bucket until the step's last one arrives, then runs
  one exchange and completes every bucket's Future.
DGC's local gradient clipping (`local_clip`) also needs the worker's whole gradient, so
with it the hook likewise holds the buckets until the last one. Otherwise the exchanges
run on the communication thread as each bucket arrives, overlapping with the rest of
backward. Error feedback state is keyed by parameter name (or "model"), so DDP's bucket
rebuild after the first step does not disturb it; in bucket mode the feedback buffers
are re-sliced by parameter when the buckets change. Each bucket's Future holds its
AVERAGED gradient.

DDP's options work as users set them: find_unused_parameters and static_graph (a
parameter no rank used in a step keeps its error feedback: DDP drops its update; every
collective of the hook is done before DDP's own after the last bucket), no_sync
accumulation, gradient_as_bucket_view, low-precision gradients, frozen parameters
(tests/test_hook_contract.py).

No `from __future__ import annotations` here: DDP checks the hook's return annotation.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import compressors
from compressors import MomentumCorrection, Segment, Session
from compressors.base import resolve_granularity
from compressors.requests import AllReduce
from compressors.session import finite_norm, finite_norms, mix_seed
from compressors.multiplex import multiplex
from repro.costmodel import EfficiencySelector
from repro.distributed import run_async
from repro.schedule import RatioWarmup


NONFINITE = ("error", "skip", "off")
SKIPPED = object()  # what a guarded protocol returns when the workers skip the step
# agree's kinds of an unusable gradient (0: none)
KINDS = {1: "NaN", 2: "Inf", 3: "values too large to compress (their norm overflows float32)"}


class NonFiniteGradient(FloatingPointError):
    """A NaN or an Inf in a worker's gradient: raised on every worker at once, naming the
    step, the tensor and the ranks that saw it."""


def nonfinite_message(reports, named, step: int) -> str:
    """The one message every worker raises (reports: the first list agree returns)."""
    rank, position, kind = reports[0]
    others = ", ".join(f"rank {r} ({named[p][0]!r}, {k})" for r, p, k in reports[1:])
    return (f"step {step}: gradient {named[position][0]!r} contains {kind} on rank {rank}"
            + (f"; also {others}" if others else "")
            + ". Compressing it would spread it into every worker's error feedback. Lower "
            "the learning rate, clip gradients, or check the loss scale (fp16); or skip such "
            "steps on every rank as torch.amp.GradScaler does: nonfinite='skip' "
            "(repro train: nonfinite=skip)")


@dataclass
class StepRecord:
    """What one tensor's exchange reported (metrics read these, then clear them)."""

    name: str
    numel: int
    compressed: bool
    selected: Any
    target: Any
    union: Any
    bytes_sent: int
    encode_s: float
    decode_s: float
    # (kind, bytes per worker) of each collective (Outcome.collectives): the cost model
    # charges the exchange as it ran.
    collectives: tuple = ()


class WorkerCompression:
    """One worker's compression of a set of named tensors per step, independent of how
    collectives are carried out: used by the DDP hook (one per rank) and by the
    simulated-workers trainer (n of them), so both take the same decisions.

    Each tensor (by name) has its own Session: its error feedback, compressor state and
    private random stream (seeded from the run seed and the name). A worker's result
    therefore does not depend on the order in which tensors arrive: DDP's buckets (which
    hold parameters in reverse order and are rebuilt after the first step) and the
    simulated trainer's model order give bit-identical results."""

    def __init__(
        self,
        compressor: compressors.Compressor,
        rank: int,
        world_size: int,
        feedback: Any = "default",
        seed: int = 0,
        selector: Optional[EfficiencySelector] = None,
        min_numel: int = 0,
        measure: bool = False,
        check_finite: bool = True,
        names: Optional[dict] = None,
        granularity: str = "default",
        local_clip: Optional[float] = None,
        nonfinite: str = "error",
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r}: choose one of {', '.join(NONFINITE)}")
        # check_finite=False is the older spelling of nonfinite="off"
        self.nonfinite = nonfinite if check_finite else "off"
        self.granularity = resolve_granularity(compressor, granularity)
        if self.nonfinite == "skip" and self.granularity == "bucket":
            raise ValueError(
                "nonfinite='skip' leaves the whole step undone, so no bucket may be exchanged "
                "before all are known finite; granularity='bucket' exchanges each as it "
                "arrives: use granularity='layer' or 'model', or nonfinite='error'")
        if local_clip is not None:
            if isinstance(local_clip, bool) or not isinstance(local_clip, (int, float)) or not (
                    local_clip > 0 and local_clip < float("inf")):
                raise ValueError(f"local_clip={local_clip!r} must be a positive number (the "
                                 "clipping norm before it is scaled by world_size^-1/2) or None")
            if self.granularity == "bucket":
                raise ValueError(
                    "local_clip needs the worker's whole gradient before anything is "
                    "compressed, but granularity='bucket' compresses each bucket as it "
                    "arrives: use granularity='layer' or 'model', or local_clip=None")
        # DGC: each worker clips its own gradient before accumulating it, at the global
        # threshold scaled by N^-1/2 (its share if all N had the same distribution).
        self.local_clip = None if local_clip is None else float(local_clip) / world_size ** 0.5
        self.compressor = compressor
        self.rank = rank
        self.world_size = world_size
        self.feedback = feedback
        self.seed = seed
        # The agreement round (agree) checks every gradient before anything is
        # compressed; the Sessions then need no check of their own.
        self.check_finite = False
        self.measure = measure
        self.skipped = False  # whether the last step was skipped (nonfinite="skip")
        self.skipped_steps = 0
        self.sessions: dict[str, Session] = {}
        # Tensors not worth compressing (too small, or DRAGONN's rule says no) go dense;
        # "none" without feedback is stateless, so one session serves every tensor.
        self.dense = Session(compressors.build("none"), rank, world_size,
                             feedback="none", seed=seed, check_finite=False)
        self.selector = selector
        self.min_numel = min_numel
        self.enabled = True  # False: plain averaged allreduce (dense warm-up steps)
        self.records: list[StepRecord] = []
        self._names: dict[int, str] = dict(names or {})
        # The model's parameter order: a "model" exchange lays tensors out in it,
        # whatever order DDP's buckets deliver them in.
        self._order: dict[str, int] = {n: i for i, n in enumerate(self._names.values())}
        self._bucket_layouts: dict[str, tuple[Segment, ...]] = {}
        self._model_plans: dict[tuple, tuple] = {}
        self._flat: dict[str, torch.Tensor] = {}
        # Momentum correction (DGC) replaces the optimizer's momentum, so the tensors
        # exchanged densely (too small, not worth it, dense warm-up steps) get the same
        # momentum on their aggregate, in the same buffer u as when compressed.
        fb = self.session_for("").feedback  # (fails now, not in the first backward)
        self.sessions.clear()
        self.dense_momentum = fb if isinstance(fb, MomentumCorrection) else None

    def session_for(self, name: str) -> Session:
        """The Session of one tensor (created on first use)."""
        sess = self.sessions.get(name)
        if sess is None:
            sess = self.sessions[name] = Session(
                self.compressor, self.rank, self.world_size, feedback=self.feedback,
                seed=mix_seed(self.seed, "tensor", name), check_finite=self.check_finite,
                measure=self.measure,
            )
        sess.measure = self.measure
        return sess

    def name_of(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        if name is None:  # no model given: ids are stable for the parameter's lifetime
            name = self._names[id(param)] = f"param{len(self._names)}"
            # A "model" exchange lays tensors out in this order (the order DDP's first
            # buckets deliver them in), kept when DDP rebuilds its buckets after the
            # first step: the error feedback stays on its coordinates.
            self._order[name] = len(self._order)
        return name

    def compress_tensor(self, numel: int) -> bool:
        if not self.enabled or numel < self.min_numel:
            return False
        return self.selector is None or self.selector.should_compress(numel)

    @property
    def deferred(self) -> bool:
        """Whether an exchange needs the worker's whole gradient first (a "model" exchange,
        or local clipping): the DDP hook then holds the buckets until the last one."""
        return (self.granularity == "model" or self.local_clip is not None
                or self.nonfinite == "skip")

    def step_job(self, named: list[tuple[str, torch.Tensor]], step: int,
                 buffers: list[torch.Tensor] | None = None,
                 used: list[bool] | None = None):
        """(protocol, finish) for one worker's whole step: every named gradient of the
        model (the simulated trainer's worker, or the DDP hook once the last bucket has
        arrived; `buffers`: the DDP buckets they are views of). Clips locally first where
        local_clip is set, then compresses per granularity ("layer" or "model")."""
        if self.granularity == "bucket":
            raise ValueError("granularity='bucket' compresses each DDP bucket as it arrives "
                             "(whole); a worker's whole step has no buckets")
        clip = self.local_clip is not None
        if self.granularity == "model":
            return self.model(named, step, buffers, clip=clip, used=used)
        return self.layerwise(named, step, buffers=buffers, clip=clip, used=used)

    def clip_locally(self, grads: list[torch.Tensor]) -> None:
        """DGC's local gradient clipping (Lin et al. 2018, Section 3.2), in place: this
        worker's gradient rescaled to a total L2 norm of at most local_clip (the global
        threshold times N^-1/2), before it is added to the accumulation."""
        if not grads:
            return
        norms = torch._foreach_norm(grads)
        total = torch.linalg.vector_norm(torch.stack(norms).to(torch.float64))
        scale = float(self.local_clip / (float(total) + 1e-6))
        if scale < 1.0:  # (a NaN/Inf norm leaves the gradient to the finiteness check)
            torch._foreach_mul_(grads, scale)

    def layerwise(self, named: list[tuple[str, torch.Tensor]], step: int,
                  buffer: torch.Tensor | None = None,
                  buffers: list[torch.Tensor] | None = None, clip: bool = False,
                  used: list[bool] | None = None):
        """(protocol, finish) for per-tensor compression of `named` gradients; the
        protocol returns outcomes, finish(outcomes) writes the averages back in place.
        `buffer` (or `buffers`): the flat tensor(s) the gradients are views of (DDP
        buckets); when given, finiteness is checked once on each, and per tensor only
        if one fails (to name the tensor in the error). The protocol first agrees with
        the other workers on finiteness and, given `used` (whether this worker used each
        tensor), on the tensors no worker used, which it leaves alone (agree); `clip`:
        then clips locally."""
        if buffer is not None:
            buffers = [buffer]
        exchanged: dict[str, list] = {"targets": [], "flags": [], "names": []}

        def exchange(unused: frozenset):
            gens = []
            flags, targets, names = exchanged["flags"], exchanged["targets"], exchanged["names"]
            for i, (name, g) in enumerate(named):
                if i in unused:
                    continue
                if self.compress_tensor(g.numel()):
                    # The average is decoded straight into the gradient where the compressor
                    # can: no full-size buffer per step and no copy back in _finish.
                    gens.append(self.session_for(name).exchange(
                        name, g, step, finite_checked=True,
                        out=g if g.is_contiguous() else None))
                    flags.append(True)
                else:
                    gens.append(self.dense.exchange(name, g, step, writable=True,
                                                    finite_checked=True))
                    flags.append(False)
                targets.append(g)
                names.append(name)
            return (yield from multiplex(gens))

        return (self._guarded(exchange, named, buffers, step, clip, used),
                self._finisher(named, lambda outcomes: self._finish(
                    exchanged["targets"], outcomes, exchanged["flags"], exchanged["names"])))

    def model(self, named: list[tuple[str, torch.Tensor]], step: int,
              buffers: list[torch.Tensor] | None = None, clip: bool = False,
              used: list[bool] | None = None):
        """(protocol, finish) compressing the worker's whole gradient as ONE tensor
        ("model" granularity): the gradients worth compressing are copied, in the model's
        parameter order, into one flat buffer kept between steps, exchanged once with
        their layout (compressors.Segment per parameter), and the average copied back;
        the others are reduced densely beside it. `used`: as for layerwise."""
        key_names = tuple(n for n, _ in named)
        plan = self._model_plans.get(key_names)
        if plan is None:
            plan = self._model_plans[key_names] = self._plan_model(named)
        groups, dense_at = plan
        return (self._guarded(
                    lambda unused: self._model_exchange(named, step, groups, dense_at, unused),
                    named, buffers, step, clip, used),
                self._finisher(named, lambda result: result[1](result[0])))

    def _model_exchange(self, named, step, groups, dense_at, unused: frozenset):
        """The protocol of `model` once the workers agreed the gradients are finite (and
        they were clipped): copies them into the flat buffers, exchanges, and returns
        (outcomes, the finish that writes the averages back). The tensors no worker used
        (`unused`, positions in `named`) keep their error feedback (set_aside)."""
        gens, flags, names, finishers, put_back = [], [], [], [], []
        dense = [i for i in dense_at if i not in unused]
        for key, positions, layout, total in groups:
            if not self.enabled:  # dense warm-up: each tensor as DDP's allreduce would
                dense += [i for i in positions if i not in unused]
                continue
            grads = [named[i][1] for i in positions]
            flat = self._flat.get(key)
            like = grads[0]
            if (flat is None or flat.numel() != total or flat.dtype != like.dtype
                    or flat.device != like.device):
                flat = self._flat[key] = torch.empty(total, dtype=like.dtype, device=like.device)
            views = list(flat.split([s.numel for s in layout]))
            torch._foreach_copy_(views, [g.reshape(-1) for g in grads])
            idle = [seg for i, seg in zip(positions, layout) if i in unused]
            if idle:
                put_back.append(self.set_aside(key, idle, flat))
            gens.append(self.session_for(key).exchange(
                key, flat, step, layout=layout, finite_checked=True, out=flat))
            flags.append(True)
            names.append(key)
            finishers.append((grads, views))
        for i in sorted(dense):
            name, g = named[i]
            gens.append(self.dense.exchange(name, g, step, writable=True,
                                            finite_checked=True))
            flags.append(False)
            names.append(name)
            finishers.append(None)
        by_name = dict(named)
        targets = [by_name[n] if fin is None else self._flat[n] for n, fin in zip(names, finishers)]

        def finish(outcomes):
            self._finish(targets, outcomes, flags, names)
            copies_to, copies_from = [], []
            for fin in finishers:
                if fin is not None:
                    grads, views = fin
                    copies_to += [g.view(-1) if g.is_contiguous() else g for g in grads]
                    copies_from += [v if g.is_contiguous() else v.view_as(g)
                                    for g, v in zip(grads, views)]
            if copies_to:
                torch._foreach_copy_(copies_to, copies_from)

        outcomes = yield from multiplex(gens)
        for restore in put_back:
            restore()
        return outcomes, finish

    def set_aside(self, key: str, segments: list[Segment], out: torch.Tensor):
        """Take `segments` of the flat tensor exchanged under `key` out of one exchange
        (parameters no worker used in this step, whose update DDP drops): their error
        feedback is zeroed for the exchange, so the compressor spends nothing on them,
        and the returned function puts it back afterwards and zeroes their part of the
        aggregate in `out` (what DDP's zero-filled slots average to)."""
        state = self.session_for(key).state(key)["feedback"]
        total = out.numel()
        kept = {}
        for buf_name, buf in state.items():
            if isinstance(buf, torch.Tensor) and buf.numel() == total:
                parts = [buf[s.offset: s.offset + s.numel] for s in segments]
                kept[buf_name] = (buf, [part.clone() for part in parts])
                torch._foreach_zero_(parts)

        def put_back() -> None:
            for buf_name, buf in state.items():
                if not (isinstance(buf, torch.Tensor) and buf.numel() == total):
                    continue
                parts = [buf[s.offset: s.offset + s.numel] for s in segments]
                old, saved = kept.get(buf_name, (None, None))
                if old is buf:
                    torch._foreach_copy_(parts, saved)
                else:  # created by this exchange: nothing was held for them yet
                    torch._foreach_zero_(parts)
            torch._foreach_zero_([out[s.offset: s.offset + s.numel] for s in segments])
        return put_back

    # -- finiteness and use, decided once for all workers --------------------------------

    def _guarded(self, make_job, named, buffers, step: int, clip: bool,
                 used: list[bool] | None = None):
        """The protocol of one exchange: first the workers agree whether every gradient of
        it is finite and, given `used`, which tensors no worker used (agree), then, if
        all are finite, local clipping and the exchange itself (make_job(unused) builds
        it only then, so nothing is touched before the agreement)."""
        unused: frozenset = frozenset()
        if self.nonfinite != "off" or used is not None:
            reports, unused = yield from self.agree(named, buffers, used)
            if reports:
                if self.nonfinite == "error":
                    raise NonFiniteGradient(nonfinite_message(reports, named, step))
                return SKIPPED
        if clip:
            self.clip_locally([g for _, g in named])
        return (yield from make_job(unused))

    def agree(self, named, buffers=None, used: list[bool] | None = None):
        """One small collective in which every worker reports whether it holds a NaN or
        an Inf in these gradients, and in which one (first by position), and, given
        `used`, which of them it used in this step. Returns ([(rank, tensor position,
        'NaN' | 'Inf')] for every worker that holds one, the positions no worker used),
        the same on every worker, so all take the same decisions. `buffers` (the DDP
        buckets the gradients are views of) are checked first, one native read each."""
        position, kind = -1, 0
        if self.nonfinite != "off" and not (buffers and all(finite_norm(b) for b in buffers)):
            for i, (_, g) in enumerate(named):
                if not finite_norm(g):
                    position = i
                    kind = 1 if bool(torch.isnan(g).any()) else 2 if bool(torch.isinf(g).any()) else 3
                    break
        device = named[0][1].device if named else torch.device("cpu")
        # Each worker fills its own row of a (workers × 2) table, zero elsewhere, and adds
        # its use of each tensor: one allreduce gives every worker the whole table and
        # the number of workers that used each tensor.
        uses = 0 if used is None else len(used)
        table = torch.zeros(2 * self.world_size + uses, dtype=torch.int64)
        table[2 * self.rank: 2 * self.rank + 2] = torch.tensor([position + 1, kind])
        if used is not None:
            table[2 * self.world_size:] = torch.tensor(used, dtype=torch.int64)
        table = (yield AllReduce(table.to(device))).cpu()
        rows = table[: 2 * self.world_size].view(self.world_size, 2).tolist()
        reports = [(rank, p - 1, KINDS[k]) for rank, (p, k) in enumerate(rows) if p > 0]
        unused = frozenset((table[2 * self.world_size:] == 0).nonzero().flatten().tolist())
        return reports, unused

    def _finisher(self, named, finish):
        """finish for a guarded protocol: a skipped step leaves every gradient zero (so a
        loop that steps anyway applies no NaN) and flags the worker (`skipped`). What the
        exchange produced is checked too, under the same policy (finite_norms: a sum that
        overflowed, a compressor's output that did): the aggregate is the same on every
        rank, so every rank decides alike without another collective. (A step skipped
        there keeps what the exchange put into the error feedback.)"""
        def run(result):
            self.skipped = result is SKIPPED
            if not self.skipped:
                finish(result)
                if self.nonfinite != "off" and not finite_norms([g for _, g in named]):
                    if self.nonfinite == "error":
                        raise NonFiniteGradient(
                            f"the aggregate of {len(named)} gradient(s) ({named[0][0]!r}, ...) "
                            f"is not finite after compression by {type(self.compressor).__name__}: "
                            "its output overflowed although its input was finite. Lower the "
                            "learning rate or clip gradients; or skip such steps: "
                            "nonfinite='skip'")
                    self.skipped = True
            if self.skipped:
                self.skipped_steps += 1
                torch._foreach_zero_([g for _, g in named])
        return run

    def _plan_model(self, named):
        """For a list of named gradients (in arrival order): the "model" exchanges, one
        per (dtype, device), each as (state key, positions in `named` in model order,
        layout, numel); and the positions of the tensors reduced densely."""
        order = self._order
        fallback = len(order)
        compressed = [i for i, (_, g) in enumerate(named) if self.compress_tensor(g.numel())]
        dense_at = [i for i in range(len(named)) if i not in set(compressed)]
        kinds: dict[tuple, list[int]] = {}
        for i in compressed:
            g = named[i][1]
            kinds.setdefault((g.dtype, g.device), []).append(i)
        groups = []
        for (dtype, device), positions in kinds.items():
            positions.sort(key=lambda i: (order.get(named[i][0], fallback), i))
            layout, offset = [], 0
            for i in positions:
                name, g = named[i]
                layout.append(Segment(name, offset, g.numel(), tuple(g.shape)))
                offset += g.numel()
            key = "model" if len(kinds) == 1 else (
                f"model:{str(dtype).removeprefix('torch.')}:{device}")
            groups.append((key, positions, tuple(layout), offset))
        return groups, dense_at

    def whole(self, flat: torch.Tensor, layout: tuple[Segment, ...], step: int,
              used: list[bool] | None = None):
        """(protocol, finish) for compressing a flat bucket as one tensor with a layout.
        `used` (per segment): as for layerwise; segments no worker used keep their error
        feedback (set_aside)."""
        compressed = self.compress_tensor(flat.numel())
        if compressed:
            key = self.bucket_key(layout)
            gen = self.session_for(key).exchange(key, flat, step, layout=layout, out=flat,
                                                 finite_checked=True)
            flags, names = [True], [key]
        else:
            gen = self.dense.exchange("dense", flat, step, writable=True, finite_checked=True)
            flags, names = [False], ["dense"]
        named = [(s.name, flat[s.offset: s.offset + s.numel]) for s in layout]

        def exchange(unused: frozenset):
            restore = None
            if unused and compressed:
                restore = self.set_aside(key, [layout[i] for i in sorted(unused)], flat)
            outcomes = yield from multiplex([gen])
            if restore is not None:
                restore()
            return outcomes

        return (self._guarded(exchange, named, [flat], step, False, used),
                self._finisher(named, lambda outcomes: self._finish([flat], outcomes, flags,
                                                                    names)))

    def _finish(self, targets, outcomes, flags, names) -> None:
        for target, outcome, compressed, name in zip(targets, outcomes, flags, names):
            agg = outcome.aggregate
            if agg.data_ptr() != target.data_ptr():
                target.copy_(agg.view_as(target))
            if not compressed and self.dense_momentum is not None and name != "dense":
                self._momentum_on_aggregate(name, target)
            self.records.append(StepRecord(
                name=name, numel=target.numel(), compressed=compressed,
                selected=outcome.selected, target=outcome.target, union=outcome.union,
                bytes_sent=outcome.bytes_sent, encode_s=outcome.encode_s,
                decode_s=outcome.decode_s, collectives=outcome.collectives,
            ))

    def _momentum_on_aggregate(self, name: str, grad: torch.Tensor) -> None:
        """SGD momentum on a densely reduced tensor's aggregate, in the momentum buffer
        its momentum correction uses when it is compressed (DGC's code shares them)."""
        fb = self.dense_momentum
        state = self.session_for(name).state(name)["feedback"]
        flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1)
        u = state.get("momentum")
        if u is None or u.shape != flat.shape or u.dtype != flat.dtype:
            u = state["momentum"] = torch.zeros_like(flat)
        if fb.nesterov:
            u.add_(flat).mul_(fb.momentum)
            flat.add_(u)
        else:
            u.mul_(fb.momentum).add_(flat)
            flat.copy_(u)
        if not grad.is_contiguous():
            grad.copy_(flat.view_as(grad))

    def pop_records(self) -> list[StepRecord]:
        out, self.records = self.records, []
        return out

    def residuals(self) -> list[torch.Tensor]:
        """Every error-feedback buffer this worker holds (for the EF-norm metric)."""
        out = []
        for name, sess in self.sessions.items():
            r = sess.residual(name)
            if r is not None:
                out.append(r)
        return out

    def parameter_residuals(self) -> dict[str, torch.Tensor]:
        """Each parameter's error-feedback buffer (its residual, or DGC's velocity) by
        parameter name, flat: a per-tensor Session's own, or its part of a "model" or
        "bucket" exchange's (DDP's latest buckets where they were rebuilt). Parameters
        for which nothing is held (no feedback, or not exchanged yet) are absent."""
        flat_layouts = list(self._bucket_layouts.items())  # oldest first: newer ones win
        for groups, _ in self._model_plans.values():
            flat_layouts += [(key, layout) for key, _, layout, _ in groups]
        flat_keys = {key for key, _ in flat_layouts}
        out = {}
        for name, sess in self.sessions.items():
            r = sess.residual(name)
            if r is not None and name not in flat_keys:
                out[name] = r
        for key, layout in flat_layouts:
            sess = self.sessions.get(key)
            r = None if sess is None else sess.residual(key)
            if r is None or r.numel() != sum(s.numel for s in layout):
                continue
            out.update({s.name: r[s.offset: s.offset + s.numel] for s in layout})
        return out

    # Checkpointing: error feedback, compressor state and RNG of every tensor, by name.
    def state_dict(self) -> dict[str, Any]:
        return {
            "sessions": {name: sess.state_dict() for name, sess in self.sessions.items()},
            "layouts": self._bucket_layouts,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "sessions" not in sd:
            raise ValueError("compression checkpoint has no per-tensor sessions: it was written "
                             "by an older version of the suite; restart the run (--restart)")
        self.sessions = {}
        for name, state in sd["sessions"].items():
            self.session_for(name).load_state_dict(state)
        self._bucket_layouts = dict(sd["layouts"])

    def bucket_key(self, layout: tuple[Segment, ...]) -> str:
        """Bucket-mode state key; re-slices feedback buffers when DDP rebuilt buckets."""
        key = "bucket:" + "|".join(s.name for s in layout)
        if key not in self._bucket_layouts:
            self._migrate(key, layout)
            self._bucket_layouts[key] = layout
        return key

    def _migrate(self, key: str, layout: tuple[Segment, ...]) -> None:
        where: dict[str, tuple[str, Segment]] = {}
        for old_key, old_layout in self._bucket_layouts.items():
            for seg in old_layout:
                where[seg.name] = (old_key, seg)
        if not where:
            return
        total = sum(s.numel for s in layout)
        new_fb: dict[str, torch.Tensor] = {}
        for seg in layout:
            if seg.name not in where:
                continue
            old_key, old_seg = where[seg.name]
            old_fb = self.session_for(old_key).state(old_key)["feedback"]
            for buf_name, buf in old_fb.items():
                if not isinstance(buf, torch.Tensor):
                    continue
                dst = new_fb.setdefault(buf_name, torch.zeros(total, dtype=buf.dtype, device=buf.device))
                dst[seg.offset : seg.offset + seg.numel] = buf[old_seg.offset : old_seg.offset + old_seg.numel]
        self.session_for(key).state(key)["feedback"].update(new_fb)


class CompressionHookState(WorkerCompression):
    """The DDP hook's state: this rank's WorkerCompression plus process group and step.

    It may be built before torch.distributed is initialised (PyTorch Lightning creates
    the process group inside `fit`, after the strategy got its hook and state): the
    arguments are checked at once, and the rank, world size and process group are
    resolved at the first hook call (or at any call that needs them), as PyTorch's own
    PowerSGDState does."""

    def __init__(
        self,
        compressor: compressors.Compressor,
        feedback: Any = "default",
        granularity: str = "default",
        process_group: Any = None,
        model: Optional[torch.nn.Module] = None,
        seed: int = 0,
        selector: Optional[EfficiencySelector] = None,
        min_numel: int = 0,
        measure: bool = False,
        check_finite: bool = True,
        local_clip: Optional[float] = None,
        nonfinite: str = "error",
    ):
        names = {}
        if model is not None:
            names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
        # A DDP model given: whether it may leave a parameter unused in a step (below).
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._arguments = dict(
            feedback=feedback, seed=seed, selector=selector, min_numel=min_numel,
            measure=measure, check_finite=check_finite, names=names,
            granularity=granularity, local_clip=local_clip, nonfinite=nonfinite)
        # Checked now, with a placeholder group of one: a bad argument fails at once.
        super().__init__(compressor, 0, 1, **self._arguments)
        self.process_group = process_group
        self.step = 0
        self.resolved = False
        self.error: NonFiniteGradient | None = None  # raised at the step's end
        self._pending_state: Optional[dict[str, Any]] = None
        # Buckets held until the step's last one arrives (deferred exchanges):
        # (named gradients, bucket buffer, the Future DDP got for it, their usage).
        self._held: list[tuple[list, torch.Tensor, torch.futures.Future, Any]] = []
        if dist.is_initialized():
            self.resolve()

    def resolve(self) -> None:
        """Take this rank's place in the process group (once; a collective when a
        selector is given: every rank must resolve)."""
        if self.resolved:
            return
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: the compression hook runs inside "
                "DistributedDataParallel, after init_process_group (Lightning and Accelerate "
                "initialise it before the first backward)")
        group = self.process_group
        args = dict(self._arguments)
        selector = args["selector"]
        if selector is not None and dist.get_world_size(group) > 1:
            # One decision for all ranks: rank 0's profile (each rank's own would put the
            # size cut-off in a different place, and the ranks' collectives would differ).
            box = [selector]
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast_object_list(box, src=src, group=group)
            args["selector"] = box[0]
        step = self.step
        WorkerCompression.__init__(self, self.compressor, dist.get_rank(group),
                                   dist.get_world_size(group), **args)
        self.step = step
        self.resolved = True
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def hold_error(self, error: NonFiniteGradient, buffers: list[torch.Tensor]) -> None:
        """A NaN or Inf found by an exchange (nonfinite="error"): its buckets are zeroed
        (a loop that steps anyway applies nothing of them) and the error is raised from
        backward at the step's end (_end_of_step), the first if several."""
        torch._foreach_zero_(buffers)
        if self.error is None:
            self.error = error

    def usage(self, params: list[torch.Tensor]) -> list[bool] | None:
        """Whether this rank used each of a bucket's parameters in this step, where DDP may
        leave some unused (find_unused_parameters or static_graph, or no DDP model given
        to tell): None where it cannot. DDP zero-fills the slot of a parameter whose
        gradient is undefined (unused on this rank), and drops the averaged update of one
        that no rank used; the exchange then leaves that parameter's error feedback as
        it is. Used means a defined .grad: zero_grad's default (set_to_none=True) leaves
        an unused parameter's .grad None; with set_to_none=False DDP copies the stale
        zeros into the bucket, and the parameter counts as used (zero gradient)."""
        ddp = self._ddp
        if ddp is not None and not (ddp.find_unused_parameters or ddp.static_graph):
            return None
        return [p.grad is not None for p in params]

    def state_dict(self) -> dict[str, Any]:
        if self._pending_state is not None:
            return self._pending_state
        return {"step": self.step, **super().state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if not self.resolved and not dist.is_initialized():
            self._pending_state = sd  # applied once the rank is known
            self.step = sd["step"]
            return
        self.resolve()
        self.step = sd["step"]
        super().load_state_dict(sd)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress, exchange, and return the averaged bucket."""
    if not state.resolved:
        state.resolve()
    buffer = bucket.buffer()
    step = state.step
    last = bucket.is_last()
    params = bucket.parameters()
    grads = bucket.gradients()
    used = state.usage(params)
    if state.deferred:  # (the step advances once the exchange is done, unless skipped)
        return _hold(state, [(state.name_of(p), g) for p, g in zip(params, grads)], buffer,
                     step, last, used)
    if last:
        state.step += 1
    if state.granularity == "bucket":
        layout, offset = [], 0
        for p, g in zip(params, grads):
            layout.append(Segment(state.name_of(p), offset, g.numel(), tuple(g.shape)))
            offset += g.numel()
        job, finish = state.whole(buffer, tuple(layout), step, used)
    else:
        job, finish = state.layerwise([(state.name_of(p), g) for p, g in zip(params, grads)], step,
                                      buffer=buffer, used=used)

    def done(f: torch.futures.Future) -> torch.Tensor:
        try:
            finish(f.value())
        except NonFiniteGradient as exc:
            state.hold_error(exc, [buffer])
        return buffer

    fut = run_async(job, state.process_group).then(done)
    return _end_of_step(state, fut, fut) if last else fut


def _hold(state: CompressionHookState, named: list, buffer: torch.Tensor, step: int,
          last: bool, used: list[bool] | None) -> torch.futures.Future:
    """A deferred exchange: each bucket's Future is completed once the step's last bucket
    has arrived and the one exchange of the whole gradient has run. DDP calls the hook
    for every bucket, in order, before it waits on any Future, so holding them is safe."""
    fut: torch.futures.Future = torch.futures.Future()
    state._held.append((named, buffer, fut, used))
    if not last:
        return fut
    held, state._held = state._held, []
    every_use = None if used is None else [u for *_, us in held for u in us]
    try:
        job, finish = state.step_job([ng for n, *_ in held for ng in n], step,
                                     buffers=[b for _, b, *_ in held], used=every_use)
    except BaseException as exc:
        for _, _, f, _ in held:
            f.set_exception(exc)
        return fut

    def done(f: torch.futures.Future) -> None:
        try:
            finish(f.value())
        except NonFiniteGradient as exc:
            state.hold_error(exc, [b for _, b, *_ in held])
        except BaseException as exc:  # every bucket's Future carries the error
            for _, _, h, _ in held:
                h.set_exception(exc)
            return
        else:
            if not state.skipped:  # a skipped step is as if it never happened
                state.step += 1
        for _, b, h, _ in held:
            h.set_result(b)

    return _end_of_step(state, run_async(job, state.process_group).then(done), fut)


def _end_of_step(state: CompressionHookState, last_exchange: torch.futures.Future,
                 fut: torch.futures.Future) -> torch.futures.Future:
    """The step's last bucket (its Future `fut`): returns only once every exchange of the
    step has run, then raises a NonFiniteGradient one of them found from backward.

    DDP issues collectives of its own on the backward thread right after the last
    bucket's hook returns (with find_unused_parameters, the allreduce of which parameters
    each rank used); the hook's run on the communication thread. Were both in flight at
    once, each rank could issue them in a different order, and gloo would mismatch them
    or wait forever. Jobs run in submission order, so the last one done means all are.
    Nothing of backward is left to overlap with at this point: DDP waits for every
    bucket's Future right after."""
    with contextlib.suppress(Exception):  # the Future carries an error to DDP
        last_exchange.wait()
    error, state.error = state.error, None
    if error is not None and not _raise_after_backward(error):
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(error)
        return failed
    return fut


def _raise_after_backward(error: BaseException) -> bool:
    """Raise `error` from the backward pass that is running once DDP has finished its
    part of it, so that `except NonFiniteGradient` around backward catches it (DDP wraps
    an error a hook's Future carries in a RuntimeError) and the next step starts
    cleanly. A callback queued now runs before the one DDP queues after this last bucket
    (its finalisation); it queues the raise behind DDP's. False outside backward."""
    engine = torch.autograd.Variable._execution_engine

    def raise_error() -> None:
        raise error

    try:
        engine.queue_callback(lambda: engine.queue_callback(raise_error))
    except RuntimeError:
        return False
    return True


def make(
    name: str,
    *,
    feedback: Any = "default",
    granularity: str = "default",
    process_group: Any = None,
    model: Optional[torch.nn.Module] = None,
    seed: int = 0,
    selector: Optional[EfficiencySelector] = None,
    min_numel: int = 0,
    measure: bool = False,
    local_clip: Optional[float] = None,
    nonfinite: str = "error",
    warmup_steps: int = 0,
    warmup_ratio: float = 0.25,
    **params: Any,
) -> tuple[CompressionHookState, Callable]:
    """(state, hook) for `ddp_model.register_comm_hook(state, hook)`.

    name/params: a registered compressor and its parameters (compressors.build).
    feedback: "default" (the compressor's), "none", "residual" or "momentum" (DGC's
        momentum correction: then give your optimizer no momentum of its own, see
        repro.optim.MomentumCorrectedSGD).
    granularity: "default" (the compressor's paper's setting: "model" for DEFT and CLT-k,
        "layer" for the others), "layer" (per parameter), "bucket" (per DDP bucket) or
        "model" (the whole gradient as one exchange, after the last bucket).
    model: the DDP model, so state is keyed by parameter names (needed for checkpoints;
        "model" granularity then lays the gradient out in parameter order, else in the
        order of DDP's first buckets), and so the hook knows from its
        find_unused_parameters and static_graph whether a parameter can go unused (else
        it assumes one can: one small collective per exchange even with nonfinite="off").
    selector: DRAGONN's efficiency-aware selection (repro.costmodel.EfficiencySelector),
        given on every rank: rank 0's is broadcast and used by all.
    min_numel: tensors smaller than this are allreduced densely (a static cut-off).
    local_clip: DGC's local gradient clipping: each rank clips its own gradient to this
        global norm times world_size^-1/2 before error feedback accumulates it (holds the
        buckets until the last one, as "model" does). None: off.
    nonfinite: what every rank does when any rank's gradient holds a NaN or an Inf,
        decided together in one small collective per exchange: "error" (every rank's
        backward() raises NonFiniteGradient, naming the step, the tensor and the rank,
        once DDP has finished the step: `except NonFiniteGradient` around backward
        catches it, with that exchange's gradients zeroed), "skip" (every rank
        skips the step as torch.amp.GradScaler does: error feedback untouched, gradients
        zeroed, `state.skipped` True: do not step the optimizer; holds the buckets until
        the last one) or "off" (no check).
    warmup_steps, warmup_ratio: DGC's sparsity warm-up (repro.schedule.RatioWarmup): the
        ratio falls exponentially from warmup_ratio to `ratio` over the hook's first
        warmup_steps steps (0: off), for compressors that take a ratio.
    """
    compressor = compressors.build(name, **params)
    warmup = RatioWarmup(getattr(compressor, "ratio", None), warmup_steps, warmup_ratio)
    if warmup.steps and "ratio" not in compressor.params():
        raise ValueError(f"warmup_steps={warmup_steps} is DGC's ratio warm-up, but {name!r} "
                         "takes no ratio; leave warmup_steps at 0")
    state = CompressionHookState(
        compressor, feedback=feedback, granularity=granularity, process_group=process_group,
        model=model, seed=seed, selector=selector, min_numel=min_numel, measure=measure,
        local_clip=local_clip, nonfinite=nonfinite,
    )
    if warmup.steps:
        state.ratio_warmup = warmup
        return state, warmup_hook
    return state, compression_hook


def warmup_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """compression_hook with the compressor's ratio set from state.ratio_warmup for the
    hook's step first (every bucket of a step sees the same step, on every rank)."""
    state.compressor.ratio = state.ratio_warmup.at(state.step)
    return compression_hook(state, bucket)


def check_replicas(model: torch.nn.Module, process_group: Any = None,
                   step: Optional[int] = None) -> None:
    """Compare every parameter across ranks, bit for bit, and raise ReplicasDiffer on
    every rank, naming the first parameter that differs and the ranks that differ from
    rank 0, if any does. Each rank sends two 64-bit checksums per parameter (the sum of
    its bits read as integers, and that sum weighted by position): exact integer sums,
    the same whatever the order or the thread count."""
    named = [(n.removeprefix("module."), p.detach()) for n, p in model.named_parameters()]
    if not named:
        return
    sums = torch.stack([_fingerprint(p) for _, p in named])  # [params, 2] int64
    world = dist.get_world_size(process_group)
    device = named[0][1].device
    local = sums.to(device)
    every = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(every, local, group=process_group)
    table = torch.stack(every).cpu()  # [rank, params, 2]
    differ = (table != table[0]).any(dim=2)  # [rank, params]
    if not bool(differ.any()):
        return
    first = int(differ.any(dim=0).nonzero()[0])
    ranks = differ[:, first].nonzero().flatten().tolist()
    when = "" if step is None else f" after step {step}"
    raise ReplicasDiffer(
        f"replicas differ{when}: parameter {named[first][0]!r} on rank(s) "
        f"{', '.join(map(str, ranks))} differs from rank 0's (the first of "
        f"{int(differ.any(dim=0).sum())} differing parameters, in model order). Every rank "
        "must apply the same update: a decode that depends on arrival order, a per-rank "
        "decision, or a rank-local change to the model breaks that")


class ReplicasDiffer(RuntimeError):
    """The ranks' parameters are not bit-identical (check_replicas)."""


_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """(Σ bits, Σ bits·(position mod 65521 + 1)) of a tensor, as int64 (wrapping)."""
    flat = p.reshape(-1)
    view = _INT_VIEW.get(flat.dtype)
    bits = flat.view(view).to(torch.int64) if view is not None else flat.to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()]).cpu()
