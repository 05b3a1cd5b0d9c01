"""Pieces the SIDCo and DRAGONN figures share: reading `repro bench` reports and training
runs, the projection of a simulated run onto the papers' clusters, claim checks, plots.

Projection of a simulated run. The trainer logs, per step, `step_s` (the whole simulated
step: n workers' forward/backward one after the other, plus every worker's compression),
`compress_s` (worker 0's encode + decode) and `projected/step_s` = compute_s + compress_s +
projected communication, where compute_s = step_s − compress_s still holds all n workers'
forward/backward passes. A real worker computes only its own, so the figures here take

    compute per worker  = (step_s − n·compress_s) / n
    projected step      = compute per worker + compress_s + projected communication,
    projected comm      = projected/step_s − compute_s − compress_s   (from the log)

i.e. the communication the trainer projected from the bytes each tensor really sent on
the target cluster (cluster.target_workers, bandwidth_gbps, latency_us), with this CPU's
measured compute and compression times.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repro.figures.base import Context, Row, verdict

# Line styles per compressor, shared by every plot here so a method keeps its colour.
COLOURS = {
    "none": "black", "topk": "tab:blue", "dgc": "tab:orange", "redsync": "tab:green",
    "gaussianksgd": "tab:red", "sidco_e": "tab:purple", "sidco_gp": "tab:brown",
    "sidco_p": "tab:pink", "mstopk": "tab:gray", "dragonn": "tab:cyan", "randomk": "tab:olive",
    "signsgd": "tab:gray",
}
LABELS = {
    "none": "no compression", "topk": "Top-k", "dgc": "DGC", "redsync": "RedSync",
    "gaussianksgd": "GaussianKSGD", "sidco_e": "SIDCo-E", "sidco_gp": "SIDCo-GP",
    "sidco_p": "SIDCo-P", "mstopk": "MSTopK", "dragonn": "DRAGONN", "randomk": "Random-k",
    "signsgd": "SignSGD",
}


def label(name: str) -> str:
    return LABELS.get(name, name)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fmt_size(numel: int) -> str:
    if numel >= 1024 and numel & (numel - 1) == 0:
        return f"2^{numel.bit_length() - 1}"
    if numel >= 10**6:
        return f"{numel / 1e6:g}M"
    if numel >= 10**3:
        return f"{numel / 1e3:g}k"
    return str(numel)


def fmt_bytes(nbytes: float) -> str:
    exp = math.log2(nbytes) if nbytes > 0 else 0
    return f"2^{exp:.0f} B" if abs(exp - round(exp)) < 1e-9 else f"{nbytes:.3g} B"


def bench_cpu_note(report: Mapping[str, Any]) -> str:
    m = report["machine"]
    return f"{m['cpu']} ({m['cpu_count']} cores, {m['threads']} threads), torch {m['torch']}"


def encode_cell(report: Mapping[str, Any], compressor: str, numel: int,
                ratio: float | None) -> dict[str, Any] | None:
    for e in report["encode"]:
        if e["compressor"] == compressor and e["numel"] == numel and (
                ratio is None or e["ratio"] == ratio):
            return e
    return None


def claim_row(setting: str, metric: str, paper: float | None, reproduced: float | None,
              holds: bool | None, claim: str, caveat: str, unit: str = "",
              missing_ok: bool = False) -> Row:
    """A comparison row whose verdict comes from `holds` (None: not checkable here).
    Without a reproduced value the verdict is "not comparable" unless `missing_ok` (the
    claim was decided without a number, e.g. a baseline that never reached the target)."""
    if reproduced is None or (isinstance(reproduced, float) and not math.isfinite(reproduced)):
        reproduced = None
        if not missing_ok:
            holds = None
    state = {True: "holds here", False: "does NOT hold here", None: "cannot be checked here"}[holds]
    reason = f"claim: {claim}; {state}"
    if caveat:
        reason += f" ({caveat})"
    return Row(setting, metric, paper, reproduced, verdict(holds), reason, unit)


# -- training runs -----------------------------------------------------------------------


@dataclass
class RunStats:
    """What the figures read from one finished training run."""

    run_dir: str
    compressor: str
    ratio: float | None
    workers: int
    steps: int
    metric: str
    higher_is_better: bool
    target: float | None
    data_source: str
    final: float | None  # final evaluation of the task metric
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (steps done, value)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    k_ratio_curve: list[tuple[int, float]] = field(default_factory=list)
    projected_step_s: float | None = None  # mean, per worker (see module docstring)
    projected_samples_per_s: float | None = None  # whole target cluster
    measured_step_s: float | None = None  # mean wall time of a simulated step, all workers
    compress_s: float | None = None  # mean worker-0 encode + decode per step
    per_worker_samples: float | None = None
    target_workers: int | None = None

    @property
    def k_ratios(self) -> np.ndarray:
        return np.asarray([v for _, v in self.k_ratio_curve], dtype=np.float64)

    def k_ratio_stats(self) -> tuple[float | None, float | None, float | None]:
        k = self.k_ratios
        if not k.size:
            return None, None, None
        return float(k.mean()), float(np.percentile(k, 5)), float(np.percentile(k, 95))

    def projected_time_at(self, steps_done: int) -> float | None:
        if self.projected_step_s is None:
            return None
        return steps_done * self.projected_step_s

    def steps_to(self, target: float) -> int | None:
        """Steps done at the first evaluation reaching `target` (None: never)."""
        for s, v in self.eval_curve:
            if (v >= target) if self.higher_is_better else (v <= target):
                return s
        return None

    def best(self) -> float | None:
        vals = [v for _, v in self.eval_curve]
        if not vals:
            return None
        return max(vals) if self.higher_is_better else min(vals)


def load_run(run_dir: str, skip_steps: int = 1) -> RunStats:
    """Read a finished run; the first `skip_steps` steps (warm-up: allocator, caches) are
    left out of the timing means."""
    from omegaconf import OmegaConf

    from repro.logging import read_metrics, read_summary

    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    summary = read_summary(run_dir) or {}
    records = read_metrics(run_dir)
    metric = summary.get("metric", "accuracy")
    workers = int(cfg.cluster.workers)
    key = f"eval/{metric}"
    stats = RunStats(
        run_dir=run_dir, compressor=str(cfg.compressor.name),
        ratio=None if cfg.compressor.ratio is None else float(cfg.compressor.ratio),
        workers=workers, steps=int(cfg.steps), metric=metric,
        higher_is_better=bool(summary.get("higher_is_better", True)),
        target=summary.get("target"), data_source=str(summary.get("data_source", "")),
        final=summary.get(key), target_workers=int(cfg.cluster.target_workers),
    )
    proj, step_s, comp, samples = [], [], [], []
    for r in records:
        done = r["step"] + 1
        if key in r and r[key] is not None:
            if stats.eval_curve and stats.eval_curve[-1][0] == done:
                stats.eval_curve[-1] = (done, float(r[key]))
            else:
                stats.eval_curve.append((done, float(r[key])))
        if "loss" in r and r["loss"] is not None:
            stats.loss_curve.append((r["step"], float(r["loss"])))
        if r.get("estimation_quality") is not None:
            stats.k_ratio_curve.append((r["step"], float(r["estimation_quality"])))
        if r.get("step_s") is None or r["step"] < skip_steps:
            continue
        compress = float(r.get("compress_s") or 0.0)
        comm = float(r["projected/step_s"]) - float(r["compute_s"]) - compress
        compute_per_worker = max(0.0, (float(r["step_s"]) - workers * compress) / workers)
        proj.append(compute_per_worker + compress + max(0.0, comm))
        step_s.append(float(r["step_s"]))
        comp.append(compress)
        if r.get("samples_per_s") is not None:
            samples.append(float(r["samples_per_s"]) * float(r["step_s"]) / workers)
    if proj:
        stats.projected_step_s = float(np.mean(proj))
        stats.measured_step_s = float(np.mean(step_s))
        stats.compress_s = float(np.mean(comp))
    if samples:
        stats.per_worker_samples = float(np.mean(samples))
        if stats.projected_step_s:
            stats.projected_samples_per_s = (stats.per_worker_samples * stats.target_workers
                                             / stats.projected_step_s)
    return stats


def train_grid(ctx: Context, specs: Iterable[Sequence[str]]) -> list[RunStats]:
    """One `repro train` run per override list (finished runs are skipped), then read."""
    out = []
    for overrides in specs:
        (run_dir,) = ctx.train(list(overrides))
        out.append(load_run(run_dir))
    return out


def compressor_overrides(name: str, ratio: float | None) -> list[str]:
    o = [f"compressor={name}"]
    if ratio is not None:
        o.append(f"compressor.ratio={ratio}")
    return o


def param_count(task: str, size: str = "smoke") -> int:
    import tasks

    model = tasks.build_task(task, size=size, data="standin").build_model()
    return sum(p.numel() for p in model.parameters())


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Running mean over the last `window` values (SIDCo Fig. 9's smoothing)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    out = np.empty_like(v)
    for i in range(v.size):
        lo = max(0, i + 1 - window)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def quality_per_time(run: RunStats) -> float | None:
    """SIDCo's "normalized training speed-up" numerator: model quality at the end of
    training over the (projected) time to get there; quality is accuracy, or 1/perplexity
    for language models (lower is better)."""
    if run.final is None or run.projected_step_s is None:
        return None
    quality = run.final if run.higher_is_better else 1.0 / run.final
    return quality / (run.steps * run.projected_step_s)


def records_as_rows(runs: Sequence[RunStats], task: str) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        km, k5, k95 = r.k_ratio_stats()
        rows.append({
            "task": task, "compressor": r.compressor, "ratio": r.ratio, "workers": r.workers,
            "steps": r.steps, "metric": r.metric, "final": r.final, "best": r.best(),
            "k_ratio_mean": km, "k_ratio_p5": k5, "k_ratio_p95": k95,
            "measured_sim_step_s": r.measured_step_s, "compress_s": r.compress_s,
            "projected_step_s": r.projected_step_s,
            "projected_samples_per_s": r.projected_samples_per_s,
            "target_workers": r.target_workers, "data_source": r.data_source,
            "run_dir": os.path.relpath(r.run_dir),
        })
    return rows
