"""What the training loop asks of one worker's gradient exchange, whichever runs it:
repro.hooks.WorkerCompression (a simulated worker), CompressionHookState (a real rank's
comm hook), or `BuiltinAllreduce` (DDP's own allreduce, comm_hook=false); and the
compression schedule the loop sets on every exchange before each step (`schedule`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from repro.hooks import StepRecord
from repro.schedule import RatioWarmup


@runtime_checkable
class GradientExchange(Protocol):
    """One worker's gradient exchange, as the loop drives it: switched on and measured
    per step, asked whether the step was skipped, its records popped, its error feedback
    read, its state checkpointed."""

    enabled: bool  # compress this step (False before compressor.start_step)
    measure: bool  # keep this step's StepRecords (a logging step)
    skipped: bool  # nonfinite=skip: every worker agreed to skip the last step
    skipped_steps: int  # steps skipped so far: the exchanges' step index leaves them out

    def pop_records(self) -> list[StepRecord]: ...

    def residuals(self) -> list[torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...



def ratio_at(cfg, step: int) -> float | None:
    """DGC warm-up: the ratio decays exponentially from warmup_ratio to ratio
    (repro.schedule.RatioWarmup)."""
    c = cfg.compressor
    if c.ratio is None:
        return None
    return RatioWarmup(c.ratio, c.warmup_steps, c.warmup_ratio, c.start_step).at(step)


def schedule(exchanges: list[GradientExchange], compressor: Any, cfg, step: int) -> None:
    """The compression schedule at `step`: the compressor's ratio where DGC's warm-up sets
    one, every exchange dense before compressor.start_step, measured on logging steps."""
    r = ratio_at(cfg, step)
    if r is not None and hasattr(compressor, "ratio"):
        compressor.ratio = r
    enabled = step >= cfg.compressor.start_step
    log = cfg.logger.log_every and step % cfg.logger.log_every == 0
    for c in exchanges:
        c.enabled = enabled
        c.measure = bool(log)


class BuiltinAllreduce:
    """Stands in for the hook state when DDP's own allreduce exchanges the gradients
    (comm_hook=false): every parameter goes dense in fp32, nothing to schedule or save."""

    def __init__(self, model: torch.nn.Module):
        self.enabled = True
        self.measure = False
        self.skipped = False  # DDP's allreduce has no way to skip a step
        self.skipped_steps = 0
        self.records = [
            StepRecord(name=n, numel=p.numel(), compressed=False, selected=None, target=None,
                       union=None, bytes_sent=p.numel() * p.element_size(), encode_s=0.0,
                       decode_s=0.0, collectives=(("allreduce", p.numel() * p.element_size()),))
            for n, p in model.named_parameters() if p.requires_grad
        ]

    def pop_records(self) -> list[StepRecord]:
        return self.records

    def residuals(self) -> list[torch.Tensor]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass
