"""One worker's compression of its named gradients per step, whatever carries the
collectives: the DDP hook runs one per rank (repro.hooks), the simulated-workers trainer
n in one process, so both take the same decisions.

What one exchange covers (CompressionOptions.granularity, by default the setting of the
compressor's paper, Compressor.default_granularity):
- "layer": each parameter's gradient alone; a sparsifier's exchanges of a batch of
  tensors (a DDP bucket) run as one, each tensor still selected alone
  (compressors.batched, CompressionOptions.batch), the other compressors' collectives
  are merged into a few (compressors.multiplex).
- "bucket": a flat tensor (a DDP bucket) as one exchange with its parameters' layout.
- "model": the worker's whole gradient as one tensor with every parameter's layout
  (DEFT's norm-based allocation of k across all layers, CLT-k's leader top-k over the
  whole model).

Error feedback is keyed by parameter name ("model" or "bucket:<names>" for a flat
exchange), so DDP's bucket rebuild after the first step does not disturb it; bucket
exchanges re-slice their feedback by parameter when the buckets change. Before anything
is compressed the workers agree whether every gradient is finite: each checks its own,
and the verdicts ride on the exchange's first collective (a few elements appended to a
payload it carries anyway), the exchange running speculatively until then
(compressors.session.Speculation), where that is cheaper than a collective of its own
(WorkerCompression.fold_agreement); else, and where some tensors may be unused (which
no worker used is agreed too), in one small collective first (WorkerCompression.agree).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

import compressors
from compressors import MomentumCorrection, Segment, Session
from compressors.base import resolve_granularity
from compressors.batched import batches, sparse_batch
from compressors.feedback import ErrorFeedback
from compressors.multiplex import multiplex
from compressors.requests import AllGather, AllReduce, Broadcast, as_round
from compressors.session import Speculation, finite_norm, finite_norms, mix_seed
from repro.costmodel import EfficiencySelector

NONFINITE = ("error", "skip", "off")
SKIPPED = object()  # what a guarded protocol returns when the workers skip the step
# agree's kinds of an unusable gradient (0: none)
KINDS = {1: "NaN", 2: "Inf", 3: "values too large to compress (their norm overflows float32)"}
# What each worker adds to an exchange's first collective when the finiteness agreement
# rides on it: [position of its first unusable tensor + 1, kind] (0, 0 when all usable).
HEADER = 2
# The largest AllReduce that carries the header (it is copied to append it).
SMALL_CARRIER = 1 << 16


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


@dataclass(frozen=True)
class CompressionOptions:
    """How a worker compresses, beyond the compressor itself: the one set of options of
    the DDP hook (repro.hooks.make takes each field as a keyword) and of the simulated
    workers. Values that need no compressor to judge are checked here, at once.

    feedback: "default" (the compressor's), "none", "residual", "momentum" (DGC's
        momentum correction: then give your optimizer no momentum of its own, see
        repro.optim.MomentumCorrectedSGD), or an ErrorFeedback instance.
    granularity: "default" (the compressor's paper's setting: "model" for DEFT and CLT-k,
        "layer" for the others), "layer" (per parameter), "bucket" (per DDP bucket) or
        "model" (the whole gradient as one exchange; the hook runs it after the last
        bucket).
    seed: the run's seed; each tensor's random stream comes from it and the tensor's name.
    selector: DRAGONN's efficiency-aware selection (repro.costmodel.EfficiencySelector);
        the hook broadcasts rank 0's, so every rank compresses the same tensors.
    min_numel: tensors smaller than this are allreduced densely (a static cut-off).
    measure: time encoding and decoding (StepRecord.encode_s, .decode_s).
    local_clip: DGC's local gradient clipping: each worker clips its own gradient to this
        global norm times world_size^-1/2 before error feedback accumulates it (needs the
        whole gradient first, as "model" does). None: off.
    nonfinite: what every worker does when any worker's gradient holds a NaN or an Inf,
        decided together in the exchange's first collective or in a small one before it
        (WorkerCompression.fold_agreement): "error" (raise
        NonFiniteGradient on every worker, naming the step, the tensor and the rank),
        "skip" (every worker skips the step as torch.amp.GradScaler does: error feedback
        untouched, gradients zeroed, `skipped` True; needs the whole gradient first) or
        "off" (no check).
    batch: at "layer" granularity, run a bucket's per-tensor sparsifier exchanges as one
        (compressors.batched): each tensor still selected with its own k, threshold,
        feedback and random stream, bit for bit as alone, with one payload, one round and
        one decode for the bucket instead of one per tensor. False: one exchange per
        tensor (the reference it is compared against).
    """

    feedback: Any = "default"
    granularity: str = "default"
    seed: int = 0
    selector: EfficiencySelector | None = None
    min_numel: int = 0
    measure: bool = False
    local_clip: float | None = None
    nonfinite: str = "error"
    batch: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.batch, bool):
            raise TypeError(f"batch={self.batch!r} must be True or False")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={self.nonfinite!r}: choose one of {', '.join(NONFINITE)}")
        clip = self.local_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not 0 < clip < float("inf")):
            raise ValueError(f"local_clip={clip!r} must be a positive number (the "
                             "clipping norm before it is scaled by world_size^-1/2) or None")

    @classmethod
    def of(cls, options: "CompressionOptions | None" = None,
           **settings: Any) -> "CompressionOptions":
        """`options` (default: all defaults) with the fields named in `settings` replaced."""
        unknown = sorted(set(settings) - OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown compression option(s) {', '.join(unknown)}: the options "
                            f"are {', '.join(sorted(OPTION_NAMES))} (CompressionOptions)")
        return dataclasses.replace(options or cls(), **settings)


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(CompressionOptions))


def layout_of(named: list[tuple[str, torch.Tensor]]) -> tuple[Segment, ...]:
    """The layout of named tensors laid end to end in one flat tensor (a DDP bucket)."""
    layout, offset = [], 0
    for name, g in named:
        layout.append(Segment(name, offset, g.numel(), tuple(g.shape)))
        offset += g.numel()
    return tuple(layout)


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

    def __init__(self, compressor: compressors.Compressor, rank: int, world_size: int,
                 options: CompressionOptions | None = None, *,
                 names: dict | None = None, **settings: Any):
        """`options`, or its fields as keywords (`settings`, which override it); `names`:
        id(parameter) → name (else parameters are named by first arrival)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self.options = options = CompressionOptions.of(options, **settings)
        self.nonfinite = options.nonfinite
        self.granularity = resolve_granularity(compressor, options.granularity)
        if self.nonfinite == "skip" and self.granularity == "bucket":
            raise ValueError(
                "nonfinite='skip' leaves the whole step undone, so no bucket may be exchanged "
                "before all are known finite; granularity='bucket' exchanges each as it "
                "arrives: use granularity='layer' or 'model', or nonfinite='error'")
        if options.local_clip is not None and self.granularity == "bucket":
            raise ValueError(
                "local_clip needs the worker's whole gradient before anything is "
                "compressed, but granularity='bucket' compresses each bucket as it "
                "arrives: use granularity='layer' or 'model', or local_clip=None")
        # DGC: each worker clips its own gradient before accumulating it, at the global
        # threshold scaled by N^-1/2 (its share if all N had the same distribution).
        self.local_clip = (None if options.local_clip is None
                           else float(options.local_clip) / world_size ** 0.5)
        self.compressor = compressor
        self.rank = rank
        self.world_size = world_size
        self.measure = options.measure  # (the trainer turns it on for the steps it logs)
        self.skipped = False  # whether the last step was skipped (nonfinite="skip")
        self.skipped_steps = 0
        self.sessions: dict[str, Session] = {}
        # Tensors not worth compressing (too small, or DRAGONN's rule says no) go dense;
        # "none" without feedback is stateless, so one session serves every tensor.
        self.dense = Session(compressors.build("none"), rank, world_size,
                             feedback="none", seed=options.seed, check_finite=False)
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
        # Whether the feedback can be written apart (ErrorFeedback.stage), so an
        # exchange can run before the workers know all gradients are finite, and whether
        # that costs nothing (no feedback to write).
        self._speculative = type(fb).stage is not ErrorFeedback.stage
        self._stages_free = fb.passes_through
        # Whether the finiteness agreement rides on each exchange's first collective, the
        # exchange running speculatively until then (_folded), rather than taking a small
        # collective of its own before it. None: where that is cheaper, decided per
        # exchange: with no error feedback (nothing to stage), or off the CPU, where the
        # staged feedback's extra traffic (written apart, not in place) costs far less
        # than a collective and its host round trip; on the CPU it costs more than
        # gloo's small allreduce (measured: residual + gradient written apart takes
        # ~40% longer than in place, 13.3 vs 9.4 ms for 25M float32 on one core).
        self.fold_agreement: bool | None = None
        self.dense_momentum = fb if isinstance(fb, MomentumCorrection) else None
        self._batchable = batches(compressor)

    @property
    def selector(self) -> EfficiencySelector | None:
        """DRAGONN's efficiency-aware selection (in the DDP hook: rank 0's)."""
        return self.options.selector

    def session_for(self, name: str) -> Session:
        """The Session of one tensor (created on first use)."""
        sess = self.sessions.get(name)
        if sess is None:
            sess = self.sessions[name] = Session(
                self.compressor, self.rank, self.world_size, feedback=self.options.feedback,
                seed=mix_seed(self.options.seed, "tensor", name),
                # every gradient is checked before anything is kept (_guarded): the
                # Sessions need no check of their own
                check_finite=False, measure=self.measure,
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
        if not self.enabled or numel < self.options.min_numel:
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
        if one fails (to name the tensor in the error). The protocol agrees with the
        other workers on finiteness and, given `used` (whether this worker used each
        tensor), on the tensors no worker used, which it leaves alone (_guarded); `clip`:
        clips locally first."""
        if buffer is not None:
            buffers = [buffer]
        exchanged: dict[str, list] = {"targets": [], "flags": [], "names": []}

        def exchange(unused: frozenset, speculation: Speculation | None):
            gens, batched = [], []
            flags, targets, names = exchanged["flags"], exchanged["targets"], exchanged["names"]
            together = self._batches(named, unused)
            for group in together:
                group_names = [named[i][0] for i in group]
                grads = [named[i][1] for i in group]
                gens.append(sparse_batch([self.session_for(n) for n in group_names],
                                         group_names, grads, step, outs=grads,
                                         speculation=speculation))
                batched.append(len(group))
                flags += [True] * len(group)
                targets += grads
                names += group_names
            alone = set(range(len(named))) - unused - {i for g in together for i in g}
            for i, (name, g) in enumerate(named):
                if i not in alone:
                    continue
                batched.append(0)
                if self.compress_tensor(g.numel()):
                    # The average is decoded straight into the gradient where the compressor
                    # can: no full-size buffer per step and no copy back in _finish.
                    gens.append(self.session_for(name).exchange(
                        name, g, step, finite_checked=True,
                        out=g if g.is_contiguous() else None, speculation=speculation))
                    flags.append(True)
                else:
                    gens.append(self.dense.exchange(name, g, step, writable=True,
                                                    finite_checked=True,
                                                    speculation=speculation))
                    flags.append(False)
                targets.append(g)
                names.append(name)
            results = yield from multiplex(gens)
            # a batch returns its tensors' outcomes, in the order they were laid out above
            return [o for r, n in zip(results, batched) for o in (r if n else [r])]

        return (self._guarded(exchange, named, buffers, step, clip, used),
                self._finisher(named, lambda outcomes: self._finish(
                    exchanged["targets"], outcomes, exchanged["flags"], exchanged["names"])))

    def _batches(self, named: list[tuple[str, torch.Tensor]], unused: frozenset) -> list[list[int]]:
        """Positions in `named` whose per-tensor exchanges run as one
        (compressors.batched.sparse_batch): the compressed, contiguous tensors of each
        dtype and device, where the compressor's protocol is a Sparsifier's and
        CompressionOptions.batch is on; groups of two or more."""
        if not (self.options.batch and self._batchable):
            return []
        groups: dict[tuple, list[int]] = {}
        for i, (_, g) in enumerate(named):
            if i not in unused and g.is_contiguous() and self.compress_tensor(g.numel()):
                groups.setdefault((g.dtype, g.device), []).append(i)
        return [group for group in groups.values() if len(group) > 1]

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
                    lambda unused, speculation: self._model_exchange(
                        named, step, groups, dense_at, unused, speculation),
                    named, buffers, step, clip, used),
                self._finisher(named, lambda result: result[1](result[0])))

    def _model_exchange(self, named, step, groups, dense_at, unused: frozenset,
                        speculation: Speculation | None = None):
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
                key, flat, step, layout=layout, finite_checked=True, out=flat,
                speculation=speculation))
            flags.append(True)
            names.append(key)
            finishers.append((grads, views))
        for i in sorted(dense):
            name, g = named[i]
            gens.append(self.dense.exchange(name, g, step, writable=True,
                                            finite_checked=True, speculation=speculation))
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
        """The protocol of one exchange, run only where every worker's gradients are
        finite: make_job(unused, speculation) builds the exchange itself. Where no tensor
        can go unused (`used` None) and it is cheaper (_folds), each worker checks its
        own gradients and the verdicts ride on the exchange's first collective (_folded);
        else the workers first agree in one small collective (agree), and the exchange
        starts only then."""
        if self.nonfinite != "off" and used is None and self._folds(named):
            return (yield from self._folded(make_job, named, buffers, step, clip))
        unused: frozenset = frozenset()
        if self.nonfinite != "off" or used is not None:
            reports, unused = yield from self.agree(named, buffers, used)
            if reports:
                return self._refuse(reports, named, step)
        if clip:
            self.clip_locally([g for _, g in named])
        return (yield from make_job(unused, None))

    def _folds(self, named) -> bool:
        """Whether this exchange's finiteness agreement rides on its first collective
        (fold_agreement)."""
        if not (self._speculative and named):
            return False
        if self.fold_agreement is not None:
            return self.fold_agreement
        return self._stages_free or named[0][1].device.type != "cpu"

    def _refuse(self, reports, named, step: int):
        """What every worker does once they agreed some gradient is not finite."""
        if self.nonfinite == "error":
            raise NonFiniteGradient(nonfinite_message(reports, named, step))
        return SKIPPED

    def _folded(self, make_job, named, buffers, step: int, clip: bool):
        """The exchange with the finiteness agreement folded into its first collective.
        A worker whose gradient is not finite zeroes it (the exchange is called off below,
        and carries nothing of it meanwhile); every worker runs the exchange
        speculatively up to its first round of collectives other than broadcasts, which
        carries each worker's verdict;
        if any is not finite, every worker abandons the exchange (its error feedback,
        compressor state and random stream as before it began) and raises or skips."""
        position, kind = self._local_check(named, buffers)
        if kind:
            torch._foreach_zero_([g for _, g in named])
        elif clip:
            self.clip_locally([g for _, g in named])
        speculation = Speculation()
        job = make_job(frozenset(), speculation)
        answer = None
        while True:  # a leader's broadcast (DEFT's bins) cannot carry every worker's verdict
            try:
                item = job.send(answer)
            except StopIteration:
                raise RuntimeError("an exchange issued no collective but broadcasts, so the "
                                   "workers cannot agree on their gradients' finiteness in "
                                   "it") from None
            if not all(isinstance(r, Broadcast) for r in as_round(item)[0]):
                break
            answer = yield item
        item, read = self._with_header(item, position, kind)
        reports, answer = read((yield item))
        if reports:
            speculation.abandon()
            job.close()
            return self._refuse(reports, named, step)
        while True:
            try:
                item = job.send(answer)
            except StopIteration as stop:
                return stop.value
            answer = yield item

    def _with_header(self, item, position: int, kind: int):
        """(the first round `item` with this worker's verdict [position + 1, kind] added,
        read(answer) → (reports as agree's, the answer `item` expects)). It rides on the
        round's header gather (AllGather.header: a batched round's table of lengths,
        which the distributed driver carries in its own size exchange), else its last
        AllGather (each worker's payload gets HEADER more elements), or failing that
        its smallest sum or max AllReduce up to SMALL_CARRIER elements (a table of one
        row per worker, this worker's filled), of a dtype that holds the numbers
        exactly; else a small AllReduce of the table joins the round. The choice
        depends on nothing that differs between workers."""
        requests, is_tuple = as_round(item)
        world, rank = self.world_size, self.rank
        verdict = [position + 1, kind]
        best = None
        for i, r in enumerate(requests):
            t = r.tensor
            if (t.dtype == torch.bool or t.element_size() < 4 or t.is_complex()
                    or (t.is_floating_point() and t.dtype not in (torch.float32, torch.float64))):
                continue
            if isinstance(r, AllGather):  # (sizes differ by worker: the choice must not)
                order = (0 if r.header else 1, -i)
            elif isinstance(r, AllReduce) and r.op in ("sum", "max") and t.numel() <= SMALL_CARRIER:
                order = (2, t.numel())
            else:
                continue
            if best is None or order < best[0]:
                best = (order, i)

        def table(dtype, device) -> torch.Tensor:
            rows = torch.zeros(world * HEADER, dtype=dtype)
            rows[rank * HEADER: rank * HEADER + HEADER] = torch.tensor(verdict, dtype=dtype)
            return rows.to(device)

        requests = list(requests)
        if best is None:
            carrier = len(requests)
            requests.append(AllReduce(table(torch.int64, requests[0].tensor.device)))
        else:
            carrier = best[1]
            r = requests[carrier]
            t = r.tensor
            if isinstance(r, AllGather):
                requests[carrier] = dataclasses.replace(r, tensor=torch.cat(
                    [t, torch.tensor(verdict, dtype=t.dtype).to(t.device)]))
            else:
                requests[carrier] = AllReduce(torch.cat([t.reshape(-1), table(t.dtype, t.device)]),
                                              r.op)
        original = item

        def read(answer):
            got = list(answer) if isinstance(answer, tuple) else [answer]
            ans = got[carrier]
            if best is None:
                rows = ans
                del got[carrier]
            elif isinstance(requests[carrier], AllGather):
                rows = torch.stack([a[-HEADER:] for a in ans])
                got[carrier] = [a[:-HEADER] for a in ans]
            else:
                t = as_round(original)[0][carrier].tensor
                n = t.numel()
                t.copy_(ans[:n].view_as(t))
                rows, got[carrier] = ans[n:], t
            rows = rows.reshape(world, HEADER).tolist()
            reports = [(r, int(p) - 1, KINDS[int(k)]) for r, (p, k) in enumerate(rows) if p > 0]
            return reports, (tuple(got) if is_tuple else got[0])

        return tuple(requests), read

    def _local_check(self, named, buffers=None) -> tuple[int, int]:
        """(position of this worker's first unusable gradient in `named`, its kind in
        KINDS), or (-1, 0) where all are usable. `buffers` (the DDP buckets the gradients
        are views of) are checked first, one native read each; only a failing one is
        looked into tensor by tensor, to name the tensor."""
        if buffers and all(finite_norm(b) for b in buffers):
            return -1, 0
        for i, (_, g) in enumerate(named):
            if not finite_norm(g):
                kind = 1 if bool(torch.isnan(g).any()) else 2 if bool(torch.isinf(g).any()) else 3
                return i, kind
        return -1, 0

    def agree(self, named, buffers=None, used: list[bool] | None = None):
        """One small collective in which every worker reports whether it holds a NaN or
        an Inf in these gradients, and in which one (first by position), and, given
        `used`, which of them it used in this step. Returns ([(rank, tensor position,
        'NaN' | 'Inf')] for every worker that holds one, the positions no worker used),
        the same on every worker, so all take the same decisions. `buffers`: as for
        _local_check."""
        position, kind = -1, 0
        if self.nonfinite != "off":
            position, kind = self._local_check(named, buffers)
        device = named[0][1].device if named else torch.device("cpu")
        # Each worker fills its own row of a (workers × 2) table, zero elsewhere, and adds
        # its use of each tensor: one allreduce gives every worker the whole table and
        # the number of workers that used each tensor.
        uses = 0 if used is None else len(used)
        table = torch.zeros(HEADER * self.world_size + uses, dtype=torch.int64)
        table[HEADER * self.rank: HEADER * self.rank + HEADER] = torch.tensor([position + 1, kind])
        if used is not None:
            table[HEADER * self.world_size:] = torch.tensor(used, dtype=torch.int64)
        table = (yield AllReduce(table.to(device))).cpu()
        rows = table[: HEADER * self.world_size].view(self.world_size, HEADER).tolist()
        reports = [(rank, p - 1, KINDS[k]) for rank, (p, k) in enumerate(rows) if p > 0]
        unused = frozenset((table[HEADER * self.world_size:] == 0).nonzero().flatten().tolist())
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
            layout = layout_of([named[i] for i in positions])
            key = "model" if len(kinds) == 1 else (
                f"model:{str(dtype).removeprefix('torch.')}:{device}")
            groups.append((key, positions, layout, layout[-1].offset + layout[-1].numel))
        return groups, dense_at

    def whole(self, flat: torch.Tensor, layout: tuple[Segment, ...], step: int,
              used: list[bool] | None = None):
        """(protocol, finish) for compressing a flat bucket as one tensor with a layout.
        `used` (per segment): as for layerwise; segments no worker used keep their error
        feedback (set_aside)."""
        compressed = self.compress_tensor(flat.numel())
        if compressed:
            key = self.bucket_key(layout)
            flags, names = [True], [key]
        else:
            flags, names = [False], ["dense"]
        named = [(s.name, flat[s.offset: s.offset + s.numel]) for s in layout]

        def exchange(unused: frozenset, speculation: Speculation | None):
            restore = None
            if unused and compressed:
                restore = self.set_aside(key, [layout[i] for i in sorted(unused)], flat)
            if compressed:
                gen = self.session_for(key).exchange(key, flat, step, layout=layout, out=flat,
                                                     finite_checked=True,
                                                     speculation=speculation)
            else:
                gen = self.dense.exchange("dense", flat, step, writable=True,
                                          finite_checked=True, speculation=speculation)
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

