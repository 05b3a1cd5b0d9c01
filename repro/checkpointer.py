"""A training run's checkpoints: when one is written, how every process writes its part,
and which one a relaunch resumes from.

    RUN_DIR/checkpoints/step_00000040/{trainer.pt, rank0.pt, ... | workers.pt, MANIFEST.json}

When (`decide`): every checkpoint_every steps, every checkpoint_every_s seconds, at the
last step (checkpoint_at_end: a finished run given more steps goes on from it), and at
the step a signal stopped the run (repro.stopping). With real ranks the trainer agrees
on the flags (`local_flags`) across ranks first, so every rank decides alike.

How (`save`): rank 0 unseals the step's folder, every process writes its own files,
rank 0 seals it (MANIFEST.json, LATEST) once every file is complete and prunes the old
ones. With real ranks each stage ends with every rank learning which ranks failed, so
one rank's failed write (disk full) stops all of them at once with its message instead
of leaving the others waiting at a collective until cluster.timeout_s. A checkpoint
left unfinished is removed.

Which (`latest`): the newest complete, unaltered checkpoint made under this config that
metrics.jsonl covers (repro.runwriter.metrics_gap), decided on rank 0 for every rank.

The files' format (manifest, checksums, safe loading, pruning) is repro.checkpoints'.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from repro import checkpoints, stopping
from repro.distributed import from_rank0
from repro.durable import remove_stale_temps_under
from repro.runwriter import MetricsGap, metrics_gap

# A checkpoint's files written by this process: file name -> its state, made when written.
Parts = dict[str, Callable[[], Any]]


class Checkpointer:
    """One run's checkpoints, as one process sees them (every process has one)."""

    def __init__(self, run_dir: str, cfg, rank: int = 0, world_size: int = 1,
                 ranks: bool = False):
        """ranks: every process of the process group writes a part of each checkpoint
        (real ranks); else this process writes all of it (simulated workers)."""
        self.run_dir, self.cfg = run_dir, cfg
        self.rank, self.world_size, self.ranks = rank, world_size, ranks
        self.is_main = rank == 0
        self.dir = os.path.join(run_dir, "checkpoints")
        self.last_saved_t = time.perf_counter()

    # -- when ------------------------------------------------------------------------------
    def local_flags(self) -> tuple[bool, bool]:
        """(this process was asked to stop by a signal, a checkpoint is due by time)."""
        every = self.cfg.checkpoint_every_s
        due = bool(every) and time.perf_counter() - self.last_saved_t >= every
        return stopping.requested() is not None, due

    def decide(self, step: int, flags: tuple[bool, bool]) -> tuple[bool, bool]:
        """(write a checkpoint now, then stop) once `step` steps are done, from the
        step's (stop requested, checkpoint due by time) flags as every process agreed."""
        stop, due = flags
        last = step == self.cfg.steps
        stop = stop and not last  # a signal at the last step: the run just finishes
        every = self.cfg.checkpoint_every
        save = (stop or due or (last and self.cfg.checkpoint_at_end)
                or bool(every and step % every == 0))
        return save, stop

    # -- which -----------------------------------------------------------------------------
    def latest(self, needed: list[str]) -> str | None:
        """The checkpoint to resume from, holding every file in `needed`, or None. A bad
        one is skipped with a warning naming the file (repro.checkpoints.find); so is one
        that passes its checksums but not the safe loader. Only a checkpoint whose steps
        metrics.jsonl covers is taken; when the newest does not and no older one is left,
        MetricsGap names the missing steps. With real ranks rank 0 decides and every rank
        resumes from the same one (or raises the same error)."""
        path: Any = None
        if self.is_main:
            try:
                path = self._find(needed)
            except MetricsGap as exc:
                path = exc
        path = from_rank0(path)
        if isinstance(path, MetricsGap):
            raise path
        return path

    def _find(self, needed: list[str]) -> str | None:
        cfg_hash = checkpoints.config_hash(self.cfg)
        path = checkpoints.find(self.dir, cfg_hash, needed, loadable=True)
        upto = None if path is None else checkpoints.step_of(path)
        gap = None if path is None else metrics_gap(self.run_dir, self.cfg, upto=upto)
        if gap is None:
            return path
        older = checkpoints.find(self.dir, cfg_hash, needed, max_step=gap[0], loadable=True)
        if older is not None:
            warnings.warn(f"resuming from {older}, not {path}: {gap[1]}", RuntimeWarning,
                          stacklevel=2)
            return older
        raise MetricsGap(f"{path} cannot be resumed: {gap[1]}; nothing was run. Restore that "
                         "file, or start the run afresh with --restart")

    @staticmethod
    def load(path: str, name: str) -> Any:
        """File `name` of checkpoint `path`, through the safe loader."""
        return checkpoints.load(os.path.join(path, name))

    # -- how -------------------------------------------------------------------------------
    def prepare(self) -> None:
        if self.is_main:
            os.makedirs(self.dir, exist_ok=True)

    def save(self, step: int, parts: Parts) -> None:
        """Checkpoint `step`: this process's `parts` written, the folder sealed by rank 0
        once every process's are complete, then the old ones pruned. A failed write
        removes the unfinished folder and raises an OutputError naming the file (with
        real ranks: on every rank, naming the ranks whose write failed)."""
        name = f"step_{step:08d}"
        path = os.path.join(self.dir, name)
        error: BaseException | None = None

        def stage(work: Callable[[], None]) -> list[tuple[int, str, bool]]:
            nonlocal error
            if error is None:
                try:
                    work()
                except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                    error = exc
            mine = None if error is None else (str(error), isinstance(error, OSError))
            every: list[Any] = [mine]
            if self.ranks:
                every = [None] * self.world_size
                dist.all_gather_object(every, mine)
            return [(r, *e) for r, e in enumerate(every) if e is not None]

        def write_parts() -> None:
            for file, state in parts.items():
                checkpoints.save(state(), os.path.join(path, file))

        def seal() -> None:
            if self.is_main:
                checkpoints.finish(path, checkpoints.config_hash(self.cfg))

        failed = stage(lambda: checkpoints.begin(path) if self.is_main else None)
        if not failed:
            failed = stage(write_parts)
        if not failed:  # sealed only once every process's files are complete
            failed = stage(seal)
        if not failed:
            self.last_saved_t = time.perf_counter()
            if self.is_main:
                checkpoints.prune(self.dir, self.cfg.keep_checkpoints)
            return
        if error is not None:
            raised = checkpoints.failure(path, error, remove=self.is_main)
            if raised is error:
                raise error
            raise raised from error
        if self.is_main:
            checkpoints.discard(path)
        text = "; ".join(f"rank {r}: {message}" for r, message, _ in failed)
        kind = checkpoints.OutputError if all(fs for _, _, fs in failed) else RuntimeError
        raise kind(f"rank {self.rank} stops: checkpoint {name} could not be written ({text})")

    def tidy(self) -> None:
        """Once the run is finished (rank 0): the temp files killed attempts left in the
        run folder removed, and a prune that was cut short completed."""
        if self.is_main:
            remove_stale_temps_under(self.run_dir)
            checkpoints.prune(self.dir, self.cfg.keep_checkpoints)
