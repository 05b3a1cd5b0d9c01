"""Any registered compressor inside a user's own DistributedDataParallel model.

    state, hook = repro.hooks.make("sidco_e", ratio=0.01, model=ddp_model)
    ddp_model.register_comm_hook(state, hook)

The hook compresses each parameter's gradient (layer-wise, the papers' setting, from the
bucket's per-parameter views) or the whole bucket (granularity="bucket"), batches the
per-parameter collectives of a bucket into a few merged ones (compressors.multiplex), and
runs them on the communication thread so they overlap with the rest of backward. Error
feedback state is keyed by parameter name, so DDP's bucket rebuild after the first step
does not disturb it; in bucket mode the feedback buffers are re-sliced by parameter when
the buckets change. The returned Future holds the bucket's AVERAGED gradient.

No `from __future__ import annotations` here: DDP checks the hook's return annotation.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

import compressors
from compressors import Segment, Session
from compressors.session import all_finite, mix_seed
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
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
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
        self.session_for("")  # fails now, not in the first backward, on a bad feedback
        self.sessions.clear()
        self.selector = selector
        self.min_numel = min_numel
        self.enabled = True  # False: plain averaged allreduce (dense warm-up steps)
        self.records: list[StepRecord] = []
        self._names: dict[int, str] = dict(names or {})
        self._bucket_layouts: dict[str, tuple[Segment, ...]] = {}

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

    def layerwise(self, named: list[tuple[str, torch.Tensor]], step: int,
                  buffer: torch.Tensor | None = None):
        """(protocol, finish) for per-tensor compression of `named` gradients; the
        protocol returns outcomes, finish(outcomes) writes the averages back in place.
        `buffer`: the flat tensor the gradients are views of (a DDP bucket); when given,
        finiteness is checked once on it, and per tensor only if it fails (to name the
        tensor in the error)."""
        checked = (self.check_finite and buffer is not None
                   and all_finite(buffer))
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
            self.records.append(StepRecord(
                name=name, numel=target.numel(), compressed=compressed,
                selected=outcome.selected, target=outcome.target, union=outcome.union,
                bytes_sent=outcome.bytes_sent, encode_s=outcome.encode_s,
                decode_s=outcome.decode_s,
            ))

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
        granularity: str = "layer",
        process_group: Any = None,
        model: Optional[torch.nn.Module] = None,
        seed: int = 0,
        selector: Optional[EfficiencySelector] = None,
        min_numel: int = 0,
        measure: bool = False,
        check_finite: bool = True,
    ):
        if granularity not in ("layer", "bucket"):
            raise ValueError(f"granularity={granularity!r}: choose 'layer' or 'bucket'")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        names = {}
        if model is not None:
            names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
        super().__init__(
            compressor, dist.get_rank(process_group), dist.get_world_size(process_group),
            feedback=feedback, seed=seed, selector=selector, min_numel=min_numel,
            measure=measure, check_finite=check_finite, names=names,
        )
        self.process_group = process_group
        self.granularity = granularity
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, **super().state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        super().load_state_dict(sd)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress, exchange, and return the averaged bucket."""
    buffer = bucket.buffer()
    step = state.step
    if bucket.is_last():
        state.step += 1
    params = bucket.parameters()
    grads = bucket.gradients()
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


def make(
    name: str,
    *,
    feedback: Any = "default",
    granularity: str = "layer",
    process_group: Any = None,
    model: Optional[torch.nn.Module] = None,
    seed: int = 0,
    selector: Optional[EfficiencySelector] = None,
    min_numel: int = 0,
    measure: bool = False,
    **params: Any,
) -> tuple[CompressionHookState, Callable]:
    """(state, hook) for `ddp_model.register_comm_hook(state, hook)`.

    name/params: a registered compressor and its parameters (compressors.build).
    feedback: "default" (the compressor's), "none", "residual" or "momentum".
    granularity: "layer" (per parameter, the papers' setting) or "bucket".
    model: the DDP model, so state is keyed by parameter names (needed for checkpoints).
    selector: DRAGONN's efficiency-aware selection (repro.costmodel.EfficiencySelector).
    min_numel: tensors smaller than this are allreduced densely (a static cut-off).
    """
    compressor = compressors.build(name, **params)
    state = CompressionHookState(
        compressor, feedback=feedback, granularity=granularity, process_group=process_group,
        model=model, seed=seed, selector=selector, min_numel=min_numel, measure=measure,
    )
    return state, compression_hook
