"""Faults the suite's own tests inject into a training run, through the environment (so
they reach spawned and torchrun ranks alike); nothing happens when the variables are
unset.

    GRADCOMP_FAIL_AT_STEP=STEP:RANK   that rank dies (exit 17) as it starts that step, in
                                      the first attempt only (not after a torchrun relaunch)
    GRADCOMP_NAN_AT_STEP=STEP:RANK    that rank's loss is NaN at that step
"""

from __future__ import annotations

import os

import torch

FAIL_ENV = "GRADCOMP_FAIL_AT_STEP"
NAN_ENV = "GRADCOMP_NAN_AT_STEP"


def poisoned(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """The loss, or NaN where NAN_ENV names this step and rank."""
    spec = os.environ.get(NAN_ENV)
    if spec and tuple(int(x) for x in spec.split(":")) == (step, rank):
        return loss * float("nan")
    return loss


def maybe_fail(step: int, rank: int) -> None:
    """End this process at once where FAIL_ENV names this step and rank, as a kill would
    (no cleanup, no exception)."""
    spec = os.environ.get(FAIL_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fail_step, fail_rank = (int(x) for x in spec.split(":"))
    if step == fail_step and rank == fail_rank:
        os._exit(17)
