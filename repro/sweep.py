"""What a sweep (`repro train -m`) says while it runs and when it ends.

A failing run does not stop the sweep: its failure is recorded (RUN_DIR/FAILED:
repro.failures), the next run starts, and the end lists every failure. Progress is one
line before each run ("run 3/8: ...") with an estimate of the time left, from the seconds
per step of the runs this command trained; the end is a table with each run's status,
final loss and metric, and its throughput (summary.json's samples_per_s:
repro.throughput, the one rate).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from repro.failures import short


# -- progress ------------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """"45 s", "3 min 20 s", "1 h 05 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@dataclass
class Outcome:
    run_dir: str
    status: str  # done | failed | diverged | skipped (done) | skipped (failed / diverged)
    summary: dict[str, Any] | None = None
    reason: str | None = None
    log: str | None = None


@dataclass
class SweepProgress:
    """Progress lines and the end table of a command's runs (`out`: where lines go)."""

    total: int
    out: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)
    trained_s: float = 0.0  # seconds of the runs this command trained
    trained_steps: int = 0  # the steps they trained
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def before(self, index: int, steps_left: Sequence[int]) -> None:
        """The line before run `index` (1-based); steps_left: the steps each run from this
        one on still has to train (0: it will be skipped)."""
        to_run = sum(1 for s in steps_left if s > 0)
        text = f"run {index}/{self.total}"
        if self.trained_steps > 0:
            left = self.trained_s / self.trained_steps * sum(steps_left)
            text += f": about {duration(left)} left for {to_run} run(s)"
        elif to_run:
            text += f": {to_run} run(s) to train; an estimate follows the first"
        self.out(f"{text} ({duration(self.clock() - self.started)} elapsed)")

    def trained(self, seconds: float, steps: int) -> None:
        if steps > 0:
            self.trained_s += seconds
            self.trained_steps += steps

    def end(self, dry_run: bool = False) -> None:
        """The end table and the list of failures."""
        if dry_run or not self.outcomes:
            return
        from repro.runs import fmt

        failed = [o for o in self.outcomes if o.reason is not None]
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        self.out(f"sweep: {len(self.outcomes)} runs in {duration(self.clock() - self.started)}: "
                 + ", ".join(f"{n} {s}" for s, n in counts.items()))
        rows = [["run", "status", "final loss", "final metric", "samples/s"]]
        for o in self.outcomes:
            s = o.summary or {}
            metric = s.get("metric")
            value = s.get(f"eval/{metric}") if metric else None
            rows.append([os.path.basename(o.run_dir), o.status, fmt(s.get("final_loss")),
                         f"{metric} {fmt(value)}" if metric and value is not None else "—",
                         fmt(s.get("samples_per_s"), ".1f")])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for i, r in enumerate(rows):
            self.out("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                self.out("  " + "  ".join("-" * w for w in widths))
        if failed:
            self.out(f"{len(failed)} run(s) failed:")
            for o in failed:
                log = f" (traceback in {o.log})" if o.log else ""
                self.out(f"  {o.run_dir}: {o.status}: {short(o.reason)}{log}")
            self.out("the same command skips them; add --retry-failed to run them again")


def wandb_group(overrides: Sequence[str], limit: int = 120) -> str:
    """The W&B group of a sweep started without group=: its command's overrides, as typed
    (the same command groups its runs the same way again); a long one is cut and given a
    hash of the whole."""
    import hashlib

    text = " ".join(o for o in overrides if not o.split("=", 1)[0].lstrip("+~") in (
        "runs_root", "run_dir"))
    if len(text) <= limit:
        return text or "sweep"
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    return text[:limit - 8].rstrip() + "… " + digest
