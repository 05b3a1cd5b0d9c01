"""Any registered compressor inside a user's own DistributedDataParallel model.

    state, hook = repro.hooks.make("sidco_e", ratio=0.01, model=ddp_model)
    ddp_model.register_comm_hook(state, hook)

The state is this rank's WorkerCompression (repro.compression: what an exchange covers,
error feedback by parameter name, the agreement on NaN/Inf) plus what DDP adds: process
group, step, and the buckets held while an exchange waits for the whole gradient. The
hook runs each exchange on repro.distributed's communication thread, overlapping with
the rest of backward. DDP's options work as users set them: find_unused_parameters and
static_graph (a parameter no rank used keeps its error feedback), no_sync accumulation,
gradient_as_bucket_view, low-precision gradients, frozen parameters
(tests/engine/test_hook_contract.py).

No `from __future__ import annotations` here: DDP checks the hook's return annotation.
"""

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import compressors
from repro.compression import (
    OPTION_NAMES,
    CompressionOptions,
    NonFiniteGradient,
    StepRecord,
    WorkerCompression,
    layout_of,
)
from repro.distributed import run_async
from repro.replicas import ReplicasDiffer, check_replicas
from repro.schedule import RatioWarmup

__all__ = ["CompressionHookState", "CompressionOptions", "NonFiniteGradient", "ReplicasDiffer",
           "StepRecord", "WorkerCompression", "check_replicas", "compression_hook", "make",
           "warmup_hook"]


class CompressionHookState(WorkerCompression):
    """The DDP hook's state: this rank's WorkerCompression plus process group and step.

    It may be built before torch.distributed is initialised (PyTorch Lightning creates
    the process group inside `fit`, after the strategy got its hook and state): the
    options are checked at once, and the rank, world size and process group are resolved
    at the first hook call (or at any call that needs them), as PyTorch's own
    PowerSGDState does.

    compressor: a built compressor (compressors.build); options: CompressionOptions, or
    its fields as keywords; process_group: None for the default group; model: the DDP
    model (see make)."""

    def __init__(self, compressor: compressors.Compressor,
                 options: CompressionOptions | None = None, *, process_group: Any = None,
                 model: torch.nn.Module | None = None, **settings: Any):
        names = {}
        if model is not None:
            names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
        # Checked now, as rank 0 of a group of one: a bad option fails at once.
        super().__init__(compressor, 0, 1, options, names=names, **settings)
        # What the hook was given: the rank is resolved from these (resolve).
        self.process_group = process_group
        self._param_names = names
        # A DDP model given: whether it may leave a parameter unused in a step (usage).
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        # Progress: the hook's step (a skipped one does not count), whether the rank is
        # resolved, a checkpoint loaded before it was (applied once it is).
        self.step = 0
        self.resolved = False
        self._pending_state: dict[str, Any] | None = None
        # Within a step: the buckets held until the step's last one arrives (deferred
        # exchanges: named gradients, bucket buffer, the Future DDP got for it, their
        # usage), and the NaN/Inf found, raised at the step's end (_end_of_step).
        self._held: list[tuple[list, torch.Tensor, torch.futures.Future, Any]] = []
        self.error: NonFiniteGradient | None = None
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
        options = self.options
        if options.selector is not None and dist.get_world_size(group) > 1:
            # One decision for all ranks: rank 0's profile (each rank's own would put the
            # size cut-off in a different place, and the ranks' collectives would differ).
            box = [options.selector]
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast_object_list(box, src=src, group=group)
            options = dataclasses.replace(options, selector=box[0])
        step = self.step
        WorkerCompression.__init__(self, self.compressor, dist.get_rank(group),
                                   dist.get_world_size(group), options, names=self._param_names)
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
    """DDP communication hook: compresses the bucket's gradients, exchanges them among
    the ranks of `state.process_group` and averages them, in the bucket.

    Per state.granularity, an exchange covers each parameter's view of the bucket
    ("layer"), the bucket as one tensor with its parameters' layout ("bucket"), or the
    whole gradient ("model", held until the last bucket, as with local_clip or
    nonfinite="skip"). The step's last bucket returns once every exchange of the step
    has run, before DDP issues collectives of its own.

    Args:
        state: this rank's CompressionHookState (make builds it with the hook).
        bucket: DDP's bucket: a flat buffer, and its parameters with their gradients'
            views into it.

    Returns:
        A Future of the bucket's buffer, holding the average. A NaN or an Inf in any
        rank's gradient under nonfinite="error" zeroes the exchange's gradients and
        raises NonFiniteGradient from backward() on every rank once DDP has finished the
        step (catch it there); under "skip" every rank zeroes the step, `state.skipped`
        is True and the optimizer should not step.

    Example::
        >>> state = CompressionHookState(compressors.build("topk", ratio=0.01),
        ...                              CompressionOptions(granularity="bucket"), model=ddp)
        >>> ddp.register_comm_hook(state, compression_hook)
    """
    if not state.resolved:
        state.resolve()
    buffer = bucket.buffer()
    step = state.step
    last = bucket.is_last()
    params = bucket.parameters()
    named = [(state.name_of(p), g) for p, g in zip(params, bucket.gradients())]
    used = state.usage(params)
    if state.deferred:  # (the step advances once the exchange is done, unless skipped)
        return _hold(state, named, buffer, step, last, used)
    if last:
        state.step += 1
    if state.granularity == "bucket":
        job, finish = state.whole(buffer, layout_of(named), step, used)
    else:
        job, finish = state.layerwise(named, step, buffer=buffer, used=used)

    def done(f: torch.futures.Future) -> torch.Tensor:
        try:
            finish(f.value())
        except NonFiniteGradient as exc:
            state.hold_error(exc, [buffer])
        return buffer

    fut = run_async(job, state.process_group).then(done)
    return _end_of_step(state, fut, fut) if last else fut


def warmup_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """compression_hook with the compressor's ratio set from state.ratio_warmup for the
    hook's step first (every bucket of a step sees the same step, on every rank)."""
    state.compressor.ratio = state.ratio_warmup.at(state.step)
    return compression_hook(state, bucket)


def make(name: str, options: CompressionOptions | None = None, *, process_group: Any = None,
         model: torch.nn.Module | None = None, warmup_steps: int = 0,
         warmup_ratio: float = 0.25, **params: Any) -> tuple[CompressionHookState, Callable]:
    """(state, hook) for `ddp_model.register_comm_hook(state, hook)`.

    name, params: a registered compressor and its parameters (compressors.build). The
        keywords that name a field of CompressionOptions (feedback, granularity, seed,
        selector, min_numel, measure, local_clip, nonfinite) are the hook's options,
        over `options` where both are given.
    process_group: the ranks that exchange (None: the default group).
    model: the DDP model, so state is keyed by parameter names (needed for checkpoints;
        "model" granularity then lays the gradient out in parameter order, else in the
        order of DDP's first buckets), and so the hook knows from its
        find_unused_parameters and static_graph whether a parameter can go unused (else
        it assumes one can: one small collective per exchange even with nonfinite="off").
    warmup_steps, warmup_ratio: DGC's sparsity warm-up (repro.schedule.RatioWarmup): the
        ratio falls exponentially from warmup_ratio to `ratio` over the hook's first
        warmup_steps steps (0: off), for compressors that take a ratio.
    """
    settings = {key: params.pop(key) for key in OPTION_NAMES & params.keys()}
    compressor = compressors.build(name, **params)
    warmup = RatioWarmup(getattr(compressor, "ratio", None), warmup_steps, warmup_ratio)
    if warmup.steps and "ratio" not in compressor.params():
        raise ValueError(f"warmup_steps={warmup_steps} is DGC's ratio warm-up, but {name!r} "
                         "takes no ratio; leave warmup_steps at 0")
    state = CompressionHookState(compressor, options, process_group=process_group, model=model,
                                 **settings)
    if warmup.steps:
        state.ratio_warmup = warmup
        return state, warmup_hook
    return state, compression_hook


# -- holding the buckets of a step -------------------------------------------------------

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
    except BaseException as exc:  # noqa: BLE001 - every bucket's Future carries the error
        for _, _, f, _ in held:
            f.set_exception(exc)
        return fut

    def done(f: torch.futures.Future) -> None:
        try:
            finish(f.value())
        except NonFiniteGradient as exc:
            state.hold_error(exc, [b for _, b, *_ in held])
        except BaseException as exc:  # noqa: BLE001 - every bucket's Future carries the error
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
