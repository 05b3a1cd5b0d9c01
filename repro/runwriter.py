"""What a training run writes into its folder while it trains and when it ends (rank 0).

    RUN_DIR/metrics.jsonl   one line per logged step (repro.logging.MetricsWriter), and
                            the same metrics to W&B (repro.logging.WandbLogger)
    RUN_DIR/summary.json    the finished run's results
    RUN_DIR/DONE            the number of steps: the run finished, its summary is complete

`RunWriter` is the one writer of all of them, and the only one of DONE: summary.json
first, then DONE, each written whole or not at all. `metrics_gap` says whether
metrics.jsonl holds every line the run must have logged up to a step: a run whose file
lost lines is never marked finished, and a relaunch resumes only from a checkpoint the
file covers (repro.checkpointer).
"""

from __future__ import annotations

import os
from typing import Any

from repro.durable import write_error, write_text
from repro.logging import (
    DONE_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    MetricsWriter,
    WandbLogger,
    parse_metrics,
    run_results,
)


class MetricsGap(RuntimeError):
    """metrics.jsonl lacks steps a checkpoint or a finished run must have logged."""


def logged_steps(cfg, upto: int) -> list[int]:
    """The steps below `upto` that leave a line in metrics.jsonl: every
    logger.log_every-th, each one ending with an evaluation, and the last."""
    every, evals = cfg.logger.log_every, cfg.eval_every
    return [s for s in range(min(upto, cfg.steps))
            if (every and s % every == 0) or (evals and (s + 1) % evals == 0)
            or s == cfg.steps - 1]


def metrics_gap(run_dir: str, cfg, upto: int | None = None) -> tuple[int, str] | None:
    """(first step whose line metrics.jsonl lacks, what is missing) among the steps below
    `upto` (all) that leave one, or None when it holds all of them."""
    path = os.path.join(run_dir, METRICS_FILE)
    records = parse_metrics(path)[0] if os.path.exists(path) else []
    have = {r["step"] for r in records}
    missing = [s for s in logged_steps(cfg, cfg.steps if upto is None else upto)
               if s not in have]
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
    return missing[0], (f"{path} lacks the lines of {len(missing)} step(s) ({shown}): it "
                        "was truncated, replaced or deleted")


def wandb_group(cfg) -> str | None:
    """The run's W&B group: logger.group, else its group= (None for the plain "default",
    which would lump unrelated runs together; a sweep sets logger.group to its own)."""
    if cfg.logger.group:
        return str(cfg.logger.group)
    return None if str(cfg.group) == "default" else str(cfg.group)


class RunWriter:
    """The run folder's writer on rank 0 (elsewhere every call does nothing): metrics
    lines to metrics.jsonl and W&B as the steps go, then `finish` (summary.json, DONE)
    or `close` (a run stopped by a signal: neither)."""

    def __init__(self, run_dir: str, cfg, main: bool, resume_step: int | None = None,
                 wall_offset: float | None = None):
        """resume_step: the last step the checkpoint resumed from covers (None: a fresh
        start); wall_offset: the checkpoint's clock, which wall_time goes on from."""
        self.run_dir, self.cfg = run_dir, cfg
        self.metrics: MetricsWriter | None = None
        self.wandb: WandbLogger | None = None
        if not main:
            return
        self.metrics = MetricsWriter(run_dir, resume_step=resume_step, wall_offset=wall_offset)
        if cfg.logger.wandb:
            from omegaconf import OmegaConf

            self.wandb = WandbLogger(
                OmegaConf.to_container(cfg, resolve=True), project=cfg.logger.project,
                group=wandb_group(cfg), name=os.path.basename(run_dir), run_dir=run_dir,
                entity=cfg.logger.entity, tags=list(cfg.logger.tags), notes=cfg.logger.notes,
                # W&B steps only go up: what an earlier attempt logged is not logged again
                logged_through=(self.metrics.previous_last_step
                                if resume_step is not None else None),
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.metrics is None:
            return
        self.metrics.log(step, **metrics)
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def close(self) -> None:
        """The metrics file closed, the W&B run finished (its summary: the summary.json
        written since it started, if any)."""
        if self.metrics is None:
            return
        self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish()

    def finish(self, summary: dict[str, Any], steps: int) -> dict[str, Any]:
        """The finished run's summary, completed from metrics.jsonl (the throughput over
        every logged step, earlier attempts' included, and the results the summary line
        prints); written as summary.json, then DONE, then closed. If either write fails
        (disk full) neither file is left, so the run never looks finished and the same
        command finishes it; so too when metrics.jsonl lacks lines (MetricsGap)."""
        if self.metrics is None:
            return summary
        summary.update(self.metrics.throughput().summary())
        records = parse_metrics(os.path.join(self.run_dir, METRICS_FILE))[0]
        summary.update(run_results(records, self.cfg.compressor.ratio))
        try:
            gap = metrics_gap(self.run_dir, self.cfg)
            if gap is not None:  # another writer, or a hand, took lines away
                raise MetricsGap(f"{self.run_dir} is not marked finished: {gap[1]}; start "
                                 "the run afresh with --restart")
            self.metrics.write_summary(summary)
            write_text(os.path.join(self.run_dir, DONE_FILE), f"{steps}\n")
        except OSError as exc:
            summary_path = os.path.join(self.run_dir, SUMMARY_FILE)
            if os.path.exists(summary_path):
                os.remove(summary_path)
            raised = write_error(getattr(exc, "path", None) or exc.filename or self.run_dir,
                                 exc, "the run is not marked finished (no summary.json, no DONE)")
            if raised is None:
                raise
            raise raised from exc
        finally:
            self.close()
        return summary
