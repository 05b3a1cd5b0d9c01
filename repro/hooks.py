"""Any registered compressor inside a user's own DistributedDataParallel model.

    state, hook = repro.hooks.make("sidco_e", ratio=0.01, model=ddp_model)
    ddp_model.register_comm_hook(state, hook)

What one exchange covers (`granularity`, by default the compressor's paper's setting,
Compressor.scope):
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

No `from __future__ import annotations` here: DDP checks the hook's return annotation.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

import compressors
from compressors import MomentumCorrection, Segment, Session
from compressors.base import resolve_scope
from compressors.session import all_finite, mix_seed, nonfinite_error
from compressors.multiplex import multiplex
from repro.costmodel import EfficiencySelector
from repro.distributed import run_async


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
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self.granularity = resolve_scope(compressor, granularity)
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
        self.check_finite = check_finite
        self.measure = measure
        self.sessions: dict[str, Session] = {}
        # Tensors not worth compressing (too small, or DRAGONN's rule says no) go dense;
        # "none" without feedback is stateless, so one session serves every tensor.
        self.dense = Session(compressors.build("none"), rank, world_size,
                             feedback="none", seed=seed, check_finite=check_finite)
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
        return name

    def compress_tensor(self, numel: int) -> bool:
        if not self.enabled or numel < self.min_numel:
            return False
        return self.selector is None or self.selector.should_compress(numel)

    @property
    def deferred(self) -> bool:
        """Whether an exchange needs the worker's whole gradient first (a "model" exchange,
        or local clipping): the DDP hook then holds the buckets until the last one."""
        return self.granularity == "model" or self.local_clip is not None

    def step_job(self, named: list[tuple[str, torch.Tensor]], step: int,
                 buffers: Optional[list[torch.Tensor]] = None):
        """(protocol, finish) for one worker's whole step: every named gradient of the
        model (the simulated trainer's worker, or the DDP hook once the last bucket has
        arrived; `buffers`: the DDP buckets they are views of). Clips locally first where
        local_clip is set, then compresses per granularity ("layer" or "model")."""
        if self.local_clip is not None:
            self.clip_locally([g for _, g in named])
        if self.granularity == "model":
            return self.model(named, step, buffers)
        if self.granularity == "bucket":
            raise ValueError("granularity='bucket' compresses each DDP bucket as it arrives "
                             "(whole); a worker's whole step has no buckets")
        return self.layerwise(named, step, buffers=buffers)

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
                  buffers: Optional[list[torch.Tensor]] = None):
        """(protocol, finish) for per-tensor compression of `named` gradients; the
        protocol returns outcomes, finish(outcomes) writes the averages back in place.
        `buffer` (or `buffers`): the flat tensor(s) the gradients are views of (DDP
        buckets); when given, finiteness is checked once on each, and per tensor only
        if one fails (to name the tensor in the error)."""
        if buffer is not None:
            buffers = [buffer]
        checked = (self.check_finite and bool(buffers)
                   and all(all_finite(b) for b in buffers))
        gens, flags = [], []
        for name, g in named:
            if self.compress_tensor(g.numel()):
                # The average is decoded straight into the gradient where the compressor
                # can: no full-size buffer per step and no copy back in _finish.
                gens.append(self.session_for(name).exchange(
                    name, g, step, finite_checked=checked,
                    out=g if g.is_contiguous() else None))
                flags.append(True)
            else:
                gens.append(self.dense.exchange(name, g, step, writable=True,
                                                finite_checked=checked))
                flags.append(False)
        targets = [g for _, g in named]
        names = [n for n, _ in named]
        return multiplex(gens), lambda outcomes: self._finish(targets, outcomes, flags, names)

    def model(self, named: list[tuple[str, torch.Tensor]], step: int,
              buffers: Optional[list[torch.Tensor]] = None):
        """(protocol, finish) compressing the worker's whole gradient as ONE tensor
        ("model" granularity): the gradients worth compressing are copied, in the model's
        parameter order, into one flat buffer kept between steps, exchanged once with
        their layout (compressors.Segment per parameter), and the average copied back;
        the others are reduced densely beside it."""
        key_names = tuple(n for n, _ in named)
        plan = self._model_plans.get(key_names)
        if plan is None:
            plan = self._model_plans[key_names] = self._plan_model(named)
        groups, dense_at = plan
        checked = (self.check_finite and bool(buffers)
                   and all(all_finite(b) for b in buffers))
        gens, flags, names, finishers = [], [], [], []
        dense = list(dense_at)
        for key, positions, layout, total in groups:
            if not self.enabled:  # dense warm-up: each tensor as DDP's allreduce would
                dense += positions
                continue
            grads = [named[i][1] for i in positions]
            flat = self._flat.get(key)
            like = grads[0]
            if (flat is None or flat.numel() != total or flat.dtype != like.dtype
                    or flat.device != like.device):
                flat = self._flat[key] = torch.empty(total, dtype=like.dtype, device=like.device)
            views = list(flat.split([s.numel for s in layout]))
            torch._foreach_copy_(views, [g.reshape(-1) for g in grads])
            if self.check_finite and not checked and not all_finite(flat):
                bad = next(s for s, v in zip(layout, views) if not all_finite(v))
                raise nonfinite_error(bad.name, views[layout.index(bad)])
            gens.append(self.session_for(key).exchange(
                key, flat, step, layout=layout, finite_checked=True, out=flat))
            flags.append(True)
            names.append(key)
            finishers.append((grads, views))
        for i in sorted(dense):
            name, g = named[i]
            gens.append(self.dense.exchange(name, g, step, writable=True,
                                            finite_checked=checked))
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

        return multiplex(gens), finish

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

    def whole(self, flat: torch.Tensor, layout: tuple[Segment, ...], step: int):
        """(protocol, finish) for compressing a flat bucket as one tensor with a layout."""
        if self.compress_tensor(flat.numel()):
            key = self.bucket_key(layout)
            gen = self.session_for(key).exchange(key, flat, step, layout=layout, out=flat)
            flags, names = [True], [key]
        else:
            gen = self.dense.exchange("dense", flat, step, writable=True)
            flags, names = [False], ["dense"]
        return multiplex([gen]), lambda outcomes: self._finish([flat], outcomes, flags, names)

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
    """The DDP hook's state: this rank's WorkerCompression plus process group and step."""

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
    ):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        names = {}
        if model is not None:
            names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
        super().__init__(
            compressor, dist.get_rank(process_group), dist.get_world_size(process_group),
            feedback=feedback, seed=seed, selector=selector, min_numel=min_numel,
            measure=measure, check_finite=check_finite, names=names,
            granularity=granularity, local_clip=local_clip,
        )
        self.process_group = process_group
        self.step = 0
        # Buckets held until the step's last one arrives (deferred exchanges):
        # (named gradients, bucket buffer, the Future DDP got for it).
        self._held: list[tuple[list, torch.Tensor, torch.futures.Future]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, **super().state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        super().load_state_dict(sd)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress, exchange, and return the averaged bucket."""
    buffer = bucket.buffer()
    step = state.step
    last = bucket.is_last()
    if last:
        state.step += 1
    params = bucket.parameters()
    grads = bucket.gradients()
    if state.deferred:
        return _hold(state, [(state.name_of(p), g) for p, g in zip(params, grads)], buffer,
                     step, last)
    if state.granularity == "bucket":
        layout, offset = [], 0
        for p, g in zip(params, grads):
            layout.append(Segment(state.name_of(p), offset, g.numel(), tuple(g.shape)))
            offset += g.numel()
        job, finish = state.whole(buffer, tuple(layout), step)
    else:
        job, finish = state.layerwise([(state.name_of(p), g) for p, g in zip(params, grads)], step,
                                      buffer=buffer)

    def done(f: torch.futures.Future) -> torch.Tensor:
        finish(f.value())
        return buffer

    return run_async(job, state.process_group).then(done)


def _hold(state: CompressionHookState, named: list, buffer: torch.Tensor, step: int,
          last: bool) -> torch.futures.Future:
    """A deferred exchange: each bucket's Future is completed once the step's last bucket
    has arrived and the one exchange of the whole gradient has run. DDP calls the hook
    for every bucket, in order, before it waits on any Future, so holding them is safe."""
    fut: torch.futures.Future = torch.futures.Future()
    state._held.append((named, buffer, fut))
    if not last:
        return fut
    held, state._held = state._held, []
    try:
        job, finish = state.step_job([ng for n, _, _ in held for ng in n], step,
                                     buffers=[b for _, b, _ in held])
    except BaseException as exc:
        for _, _, f in held:
            f.set_exception(exc)
        return fut

    def done(f: torch.futures.Future) -> None:
        try:
            finish(f.value())
        except BaseException as exc:  # every bucket's Future carries the error
            for _, _, h in held:
                h.set_exception(exc)
            return
        for _, b, h in held:
            h.set_result(b)

    run_async(job, state.process_group).then(done)
    return fut


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
    model: the DDP model, so state is keyed by parameter names (needed for checkpoints
        and for "model" granularity's layout in parameter order).
    selector: DRAGONN's efficiency-aware selection (repro.costmodel.EfficiencySelector).
    min_numel: tensors smaller than this are allreduced densely (a static cut-off).
    local_clip: DGC's local gradient clipping: each rank clips its own gradient to this
        global norm times world_size^-1/2 before error feedback accumulates it (holds the
        buckets until the last one, as "model" does). None: off.
    """
    compressor = compressors.build(name, **params)
    state = CompressionHookState(
        compressor, feedback=feedback, granularity=granularity, process_group=process_group,
        model=model, seed=seed, selector=selector, min_numel=min_numel, measure=measure,
        local_clip=local_clip,
    )
    return state, compression_hook
