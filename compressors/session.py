"""One worker's compression state, and the generator a driver runs for it.

A Session owns a worker's per-tensor state (error feedback buffers, compressor state),
its private random stream and the shared seed schedule. `exchange` validates the
gradient, applies error feedback, runs the compressor's protocol while counting the
bytes of every request it yields and timing the compute between rounds, and updates the
feedback. Drivers (simulated or torch.distributed) only answer requests.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, NamedTuple

import torch

from compressors.base import FLOAT_DTYPES, Compressor, Context, Exchange, Outcome, Segment
from compressors.feedback import ErrorFeedback, make_feedback
from compressors.kernels import ops
from compressors.kernels.ops import all_finite  # the gradient check (repro.hooks too)
from compressors.requests import as_round, kind_of, sent_bytes, wire_bytes

_MASK64 = (1 << 63) - 1


_SEED_START = 0x9E3779B97F4A7C15


def mix_seed(*parts: int | str, start: int = _SEED_START) -> int:
    """A deterministic 63-bit seed from ints and strings (same in every process,
    unlike hash()). `start`: a mix_seed of leading parts, which these continue
    (mix_seed(a, b) == mix_seed(b, start=mix_seed(a)))."""
    h = start
    for p in parts:
        v = zlib.crc32(p.encode()) if isinstance(p, str) else int(p)
        h ^= (v + 0x9E3779B97F4A7C15 + ((h << 6) & _MASK64) + (h >> 2)) & _MASK64
        h = (h * 0xBF58476D1CE4E5B9) & _MASK64
    return h & _MASK64


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_norm(t: torch.Tensor) -> bool:
    """Whether `t`'s L2 norm is finite (computed in float32, float64 for float64 tensors):
    False for a NaN or an Inf, and for finite values so large that their squares
    overflow. Such a gradient is as unusable as one holding an Inf: compressors that
    normalise it (PowerSGD, SIDCo, THC) return zeros, and its sum over workers
    overflows. One read, like all_finite."""
    return bool(torch.isfinite(torch.linalg.vector_norm(t, dtype=_norm_dtype(t.dtype))))


def finite_norms(tensors: list[torch.Tensor]) -> bool:
    """finite_norm of every tensor, in one fused pass (torch._foreach_norm) and one host
    read: the check of what an exchange produced."""
    if not tensors:
        return True
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch._foreach_norm(tensors, 2, dtype=dtype)
    return bool(torch.isfinite(torch.stack(norms)).all())


def nonfinite_error(name: str, grad: torch.Tensor) -> FloatingPointError:
    """The error for a gradient holding NaN or Inf, with the fix."""
    bad = "NaN" if bool(torch.isnan(grad).any()) else "Inf"
    return FloatingPointError(
        f"gradient {name!r} contains {bad}; compressing it would spread it into every "
        "worker's error feedback. Lower the learning rate, clip gradients, or check "
        "the loss scale (fp16) before the exchange"
    )


def validate_gradient(name: str, grad: torch.Tensor, check_finite: bool = True) -> None:
    """Refuse what no compressor can handle, with the fix in the message."""
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"gradient {name!r} must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"gradient {name!r} has dtype {grad.dtype}; compressors take floating tensors "
            "(float16, bfloat16, float32, float64): cast it with .float()"
        )
    if grad.numel() == 0:
        raise ValueError(f"gradient {name!r} is empty; drop empty tensors before compressing")
    if check_finite and not all_finite(grad):
        raise nonfinite_error(name, grad)


def aggregate_destination(name: str, out: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """`out` (Session.exchange) checked against the flat gradient and viewed flat."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out for {name!r} must be a torch.Tensor, got {type(out).__name__}")
    if (out.numel() != flat.numel() or out.dtype != flat.dtype or out.device != flat.device
            or not out.is_contiguous()):
        raise ValueError(
            f"out for {name!r} must be a contiguous tensor like the gradient ({flat.numel()} "
            f"elements, {flat.dtype}, {flat.device}); got {out.numel()} elements, {out.dtype}, "
            f"{out.device}, contiguous={out.is_contiguous()}: pass the gradient tensor itself "
            "or a buffer allocated like it, or None")
    return out.view(-1)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any memory."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Prepared(NamedTuple):
    """What Session.prepare returns: the flat gradient, the tensor to compress (acc),
    the compressor's Context, the staged feedback (a speculation's, else None), whether
    this call created the tensor's state, and perf_counter() when compensation began."""

    flat: torch.Tensor
    acc: torch.Tensor
    ctx: Context
    staged: dict | None
    created: bool
    started: float


class Speculation:
    """Exchanges started before the workers know whether they will keep them: a caller
    that learns only from an exchange's first collective whether every worker's gradient
    was finite (repro.compression folds that agreement into it) gives each Session
    exchange of it one Speculation. Such an exchange writes its error feedback apart
    (ErrorFeedback.stage) and commits it once it has finished; until then abandon() puts
    back its compressor state and random stream as they were before it began, and the
    caller closes the exchanges unfinished: the workers are left as if it never ran."""

    def __init__(self) -> None:
        self._undo: list = []

    def on_abandon(self, undo) -> None:
        self._undo.append(undo)

    def abandon(self) -> None:
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()


class Session:
    """One worker: compressor + error feedback + per-tensor state + RNG."""

    def __init__(
        self,
        compressor: Compressor,
        rank: int = 0,
        world_size: int = 1,
        feedback: str | ErrorFeedback | None = "default",
        seed: int = 0,
        check_finite: bool = True,
        measure: bool = True,
        device: torch.device | str | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self.compressor = compressor
        self.rank = rank
        self.world_size = world_size
        self.feedback = make_feedback(
            compressor.default_feedback if feedback == "default" else feedback
        )
        self.feedback.check(compressor)
        self.seed = seed
        self.check_finite = check_finite
        self.measure = measure
        self.states: dict[str, dict[str, Any]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._shared_prefix: dict[str, int] = {}
        # The workspaces protocols keep per tensor between steps (Context.workspace): not
        # state, so never checkpointed; clear() gives them back.
        self.workspaces: dict[str, dict[str, torch.Tensor]] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """This worker's private random stream on `device` (distinct per rank)."""
        key = str(device)
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(mix_seed(self.seed, "worker", self.rank))
            self._generators[key] = g
        return g

    def shared_seed(self, name: str, step: int) -> int:
        """Identical on every rank for (tensor, step): shared random indices, RHT signs.
        mix_seed(seed, "shared", name, step), its part before the step kept per name."""
        prefix = self._shared_prefix.get(name)
        if prefix is None:
            prefix = self._shared_prefix[name] = mix_seed(self.seed, "shared", name)
        return mix_seed(step, start=prefix)

    def state(self, name: str) -> dict[str, Any]:
        return self.states.setdefault(name, {"compressor": {}, "feedback": {}})

    def residual(self, name: str) -> torch.Tensor | None:
        return self.feedback.residual(self.state(name)["feedback"])

    def exchange(
        self,
        name: str,
        grad: torch.Tensor,
        step: int,
        layout: tuple[Segment, ...] | None = None,
        writable: bool = False,
        finite_checked: bool = False,
        out: torch.Tensor | None = None,
        speculation: Speculation | None = None,
    ) -> Exchange[Outcome]:
        """Run one step for one tensor. Yields the compressor's requests unchanged and
        returns its Outcome with bytes and timings filled in. `writable=True` lets the
        protocol overwrite `grad` (a DDP bucket buffer without error feedback).
        `finite_checked=True`: the caller has already found `grad` finite (for example by
        one check of the whole DDP bucket it lives in), so the per-tensor check is skipped.
        `out`: a contiguous tensor of grad's size, dtype and device where the caller will
        put the aggregate (the gradient itself, in a DDP hook). Compressors that decode into
        a dense buffer then write the aggregate there (Outcome.aggregate is `out` viewed
        flat) instead of allocating one per step; the others leave it alone. Without
        error feedback the tensor being compressed is `grad` itself, so `out` may be its
        memory: protocols write it only after their last read of it (Context.out), and
        a dense allreduce (`none`) then reduces it in place. `speculation`: the caller may
        still call the exchange off after its first collective (Speculation)."""
        _, acc, ctx, staged, created, t0 = self.prepare(
            name, grad, step, layout=layout, writable=writable,
            finite_checked=finite_checked, out=out, speculation=speculation)
        folded = ctx.check_finite
        # The compressor may draw from the worker's stream before its first full read:
        # on a NaN/Inf the stream is put back, so a skipped step changes nothing.
        rng_state = ctx.generator.get_state() if folded else None
        gen = self.compressor.protocol(acc, ctx)
        answer: Any = None
        nbytes = 0
        rounds = 0
        collectives: list[tuple[str, int]] = []
        segments: list[float] = []
        while True:
            try:
                item = gen.send(answer)
            except StopIteration as stop:
                outcome = stop.value
                break
            except ops.NonFinite:
                if rng_state is None or rounds:
                    raise
                ctx.generator.set_state(rng_state)
                if created:  # the worker is left as if this call had not happened
                    del self.states[name]
                    self.workspaces.pop(name, None)
                raise nonfinite_error(name, grad) from None
            segments.append(time.perf_counter() - t0)
            requests, is_tuple = as_round(item)
            rounds += 1
            answer = yield item
            for request, got in zip(requests, answer if is_tuple else (answer,)):
                nbytes += sent_bytes(request, got, self.rank)
                collectives.append((kind_of(request), wire_bytes(request, got)))
            t0 = time.perf_counter()
        if not isinstance(outcome, Outcome):
            raise TypeError(
                f"{type(self.compressor).__name__}.protocol returned {type(outcome).__name__}, "
                "expected Outcome"
            )
        self.conclude(name, acc, outcome.sent, staged)
        segments.append(time.perf_counter() - t0)
        outcome.bytes_sent = nbytes
        outcome.collectives = tuple(collectives)
        outcome.rounds = rounds
        outcome.encode_s = sum(segments[:-1])
        outcome.decode_s = segments[-1]
        return outcome

    def prepare(
        self,
        name: str,
        grad: torch.Tensor,
        step: int,
        layout: tuple[Segment, ...] | None = None,
        writable: bool = False,
        finite_checked: bool = False,
        out: torch.Tensor | None = None,
        speculation: Speculation | None = None,
    ) -> Prepared:
        """Everything of `exchange` before the compressor runs (its arguments are
        exchange's): the gradient checked, error feedback applied (or staged), and the
        compressor's Context; batched drivers (compressors.batched) run the compressor
        between prepare and conclude themselves, with the same arithmetic."""
        # The NaN/Inf check is one read of the gradient. Where nothing is written before
        # the compressor runs (no error feedback) and the compressor finds non-finite
        # values in its own first read of acc, that read does it (ctx.check_finite);
        # otherwise validate_gradient does it here, before anything is written.
        check = self.check_finite and not finite_checked
        flat = None
        folded = False
        if (check and self.feedback.passes_through and isinstance(grad, torch.Tensor)
                and grad.dtype in FLOAT_DTYPES and grad.numel() > 0):
            flat = grad.reshape(-1)
            folded = self.compressor.folds_finite_check(flat)
        validate_gradient(name, grad, check and not folded)
        if flat is None:
            flat = grad.reshape(-1)
        out_flat = None if out is None else aggregate_destination(name, out, flat)
        if layout is None:
            layout = (Segment(name, 0, flat.numel(), tuple(grad.shape)),)
        elif sum(s.numel for s in layout) != flat.numel():
            raise ValueError(
                f"layout of {name!r} covers {sum(s.numel for s in layout)} elements but the "
                f"gradient has {flat.numel()}"
            )
        created = name not in self.states
        st = self.state(name)
        started = time.perf_counter()
        staged = None
        if speculation is None:
            acc = self.feedback.compensate(flat, st["feedback"])
        else:
            acc, staged = self._speculate(name, flat, st, created, speculation)
        ctx = Context(
            rank=self.rank,
            world_size=self.world_size,
            step=step,
            name=name,
            state=st["compressor"],
            workspaces=self.workspaces.setdefault(name, {}),
            generator=self.generator(flat.device),
            shared_seed=self.shared_seed(name, step),
            layout=layout,
            acc_writable=writable and acc is flat and flat.data_ptr() == grad.data_ptr(),
            measure=self.measure,
            check_finite=folded,
            out=out_flat,
            out_is_acc=out_flat is not None and overlaps(out_flat, acc),
        )
        return Prepared(flat, acc, ctx, staged, created, started)

    def conclude(self, name: str, acc: torch.Tensor, sent: Any,
                 staged: dict | None) -> None:
        """Everything of `exchange` after the compressor's protocol: the staged feedback
        committed, and the feedback updated with what this worker sent."""
        st = self.state(name)
        if staged:
            self._commit(name, st["feedback"], staged)
        self.feedback.update(acc, sent, st["feedback"])

    def _speculate(self, name: str, flat: torch.Tensor, st: dict, created: bool,
                   speculation: Speculation):
        """(acc, staged feedback) for an exchange the caller may call off; registers the
        undo of what the protocol may change before its first collective: the
        compressor state (its tensors copied: some are updated in place) and the random
        stream."""
        staged = self.feedback.stage(flat, st["feedback"], self._spare(name, flat.device))
        if staged is None:
            raise ValueError(f"{type(self.feedback).__name__} cannot stage its error feedback "
                             "apart (ErrorFeedback.stage): exchange without a speculation")
        generator = self.generator(flat.device)
        rng = generator.get_state()
        kept = {k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in st["compressor"].items()}

        def undo() -> None:
            generator.set_state(rng)
            if created:
                self.states.pop(name, None)
                self.workspaces.pop(name, None)
            else:
                st["compressor"].clear()
                st["compressor"].update(kept)

        speculation.on_abandon(undo)
        return staged

    def _spare(self, name: str, device: torch.device):
        """spare(key, like) for ErrorFeedback.stage: on the CPU the buffer that held
        state[key] before the last commit (a fresh large CPU tensor costs a page fault
        per 4 KiB on first touch), elsewhere a new one (caching allocators reuse)."""
        pool = self.workspaces.setdefault(name, {})

        def spare(key: str, like: torch.Tensor) -> torch.Tensor:
            if like.device.type != "cpu":
                return torch.empty_like(like)
            buf = pool.pop(f"feedback:{key}", None)
            if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
                buf = torch.empty_like(like)
            return buf
        return spare

    def _commit(self, name: str, feedback_state: dict, staged: dict) -> None:
        """The staged feedback becomes the state; on the CPU the buffers it replaces are
        kept as the next step's spares."""
        pool = self.workspaces.setdefault(name, {})
        for key, buf in staged.items():
            old = feedback_state.get(key)
            if (isinstance(old, torch.Tensor) and old.device.type == "cpu"
                    and old is not buf):
                pool[f"feedback:{key}"] = old
            feedback_state[key] = buf

    # Checkpointing (model-independent): every tensor of every state, by name.
    def state_dict(self) -> dict[str, Any]:
        return {
            "states": self.states,
            "generators": {k: g.get_state() for k, g in self._generators.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.states = sd["states"]
        for key, s in sd["generators"].items():
            self.generator(torch.device(key)).set_state(s)
