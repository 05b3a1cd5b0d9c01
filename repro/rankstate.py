"""What makes each rank's pass its own, beyond its data: its random stream, and the
buffers its forward starts from.

`get_rng` / `set_rng`: this process's random state (torch CPU and CUDA, Python), which
every checkpoint saves per rank or per simulated worker.

`SimulatedRanks`: n simulated workers run one after the other on ONE model in one process
(repro.train.SimulatedTrainer), each seeing what a real DDP rank would: its own random
stream (dropout), started from the same seeded state as every rank's, and rank 0's
buffers as they were when the step began (DDP broadcasts them before every forward).
After the n passes the process goes on as rank 0, with rank 0's gradients, stream and
the buffers rank 0's forward left. So n = 2 simulated equals a real 2-rank run step for
step. A checkpoint holds each worker's stream with its exchange's state (`state`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def get_rng() -> dict[str, Any]:
    """This process's random state: torch (CPU and, where present, CUDA) and Python."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng(state: dict[str, Any]) -> None:
    """Restore a state get_rng returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class SimulatedRanks:
    """The per-rank streams and starting buffers of n workers simulated on `model`."""

    def __init__(self, model: torch.nn.Module, n: int):
        self.n = n
        # Each worker's stream: set at the first step (every rank starts from the same
        # seeded state) or from a checkpoint.
        self.rng: list[dict[str, Any]] | None = None
        self.buffers = list(model.buffers())
        self.buffers_start = [b.clone() for b in self.buffers]  # as the step began

    def passes(self) -> Iterator[int]:
        """Each rank in turn, rank 0 last, with its random stream and the buffers of the
        step's start in place while the caller runs its pass. Rank 0 goes last so that
        afterwards the model's gradients, buffers and the process's stream are rank 0's
        as they are: nothing has to be put back, parameter by parameter."""
        if self.rng is None:
            self.rng = [get_rng() for _ in range(self.n)]
        self.rng[0] = get_rng()  # this process's own stream is rank 0's
        if self.buffers and self.n > 1:
            torch._foreach_copy_(self.buffers_start, self.buffers)
        for i, rank in enumerate([*range(1, self.n), 0]):
            if i and self.buffers:  # DDP: every rank's forward starts from rank 0's buffers
                torch._foreach_copy_(self.buffers, self.buffers_start)
            set_rng(self.rng[rank])
            yield rank
            self.rng[rank] = get_rng()

    def state(self, exchanges: Sequence[Any]) -> list[dict[str, Any]]:
        """Each worker's part of a checkpoint: its exchange's state (error feedback,
        compressor state), the steps it skipped for a NaN/Inf, its random stream."""
        return [{"compression": c.state_dict(), "rng": rng, "skipped_steps": c.skipped_steps}
                for c, rng in zip(exchanges, self.rng)]

    def load(self, states: list[dict[str, Any]], exchanges: Sequence[Any], path: str) -> None:
        """Resume every worker from `state`'s list, read from checkpoint `path`; the
        process goes on as rank 0."""
        if len(states) != self.n:
            raise ValueError(f"checkpoint {path} holds {len(states)} simulated workers but "
                             f"cluster.workers={self.n}; restart the run (--restart)")
        for c, w in zip(exchanges, states):
            c.load_state_dict(w["compression"])
            # steps skipped for a NaN/Inf: the exchanges' step index (compression_step)
            c.skipped_steps = int(w.get("skipped_steps", 0))
        self.rng = [w["rng"] for w in states]
        set_rng(self.rng[0])
