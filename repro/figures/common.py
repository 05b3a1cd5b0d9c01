"""Helpers the paper figures share; a figure module imports them from here (or the
pipeline from base.py), never from another figure module.

Plots: `pyplot` (headless matplotlib), `smooth`, and the line styles of the SIDCo and
DRAGONN plots (`COLOURS`, `label`). Inputs: `model_gradients` and `saved_source` (real
model gradients for repro.measure), `bench_cpu_note` and `encode_cell` (repro bench
reports). Training: `train_grid` (runs through `ctx.train`, read with repro.runs),
`compressor_overrides`, `param_count`, `records_as_rows`. Verdicts: `claim_row`. Numbers
print with repro.runs.fmt.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from repro.figures.base import Context, Row, verdict
from repro.runs import Run, load_run

# Line styles per compressor, shared by the SIDCo and DRAGONN plots so a method keeps its
# colour from one figure to the next.
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


# -- plots ---------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot with a non-interactive backend (figures run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing running mean over the last `window` values (fewer at the start): SIDCo
    Fig. 9 smooths k̂/k, DEFT Fig. 3 the training loss this way."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    end = np.arange(1, v.size + 1)
    start = np.maximum(0, end - window)
    return (c[end] - c[start]) / (end - start)


def fmt_size(numel: int) -> str:
    """A tensor size for titles and settings: 2^20, 26M, 260k."""
    if numel >= 1024 and numel & (numel - 1) == 0:
        return f"2^{numel.bit_length() - 1}"
    if numel >= 10**6:
        return f"{numel / 1e6:g}M"
    if numel >= 10**3:
        return f"{numel / 1e3:g}k"
    return str(numel)


# -- inputs ----------------------------------------------------------------------------------


def model_gradients(task_name: str, workers: int, batch_size: int | None = None,
                    seed: int = 0) -> tuple[list[torch.Tensor], tuple, str]:
    """One step's flattened gradient of each of `workers` simulated workers: the task's
    small model at initialisation, each worker on its own shard of the stand-in data (the
    task's own sharding). Returns (per-worker gradients, layout, data source)."""
    import compressors
    import tasks

    torch.manual_seed(seed)
    task = tasks.build_task(task_name, size="smoke", data="standin", batch_size=batch_size,
                            seed=seed)
    model = task.build_model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads: list[torch.Tensor] = []
    layout: tuple = ()
    for rank in range(workers):
        batch = next(iter(task.train_batches(rank, workers, 0)))
        for _, p in named:
            p.grad = None
        task.loss(model, batch).backward()
        flat, layout = compressors.flatten_named(
            [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in named])
        grads.append(flat.detach().clone())
    return grads, layout, task.data_source


def saved_source(grads: Sequence[torch.Tensor] | torch.Tensor, folder: str) -> str:
    """Save gradients for `repro.measure`'s file: source; returns 'file:PATH'."""
    path = os.path.join(folder, "grads.pt")
    torch.save(list(grads) if not isinstance(grads, torch.Tensor) else grads, path)
    return f"file:{path}"


def bench_cpu_note(report: Mapping[str, Any]) -> str:
    """The machine a `repro bench` report was timed on, for plot titles."""
    m = report["machine"]
    return f"{m['cpu']} ({m['cpu_count']} cores, {m['threads']} threads), torch {m['torch']}"


def encode_cell(report: Mapping[str, Any], compressor: str, numel: int,
                ratio: float | None) -> dict[str, Any] | None:
    """The encode timing of one (compressor, size, ratio) in a `repro bench` report."""
    for e in report["encode"]:
        if e["compressor"] == compressor and e["numel"] == numel and (
                ratio is None or e["ratio"] == ratio):
            return e
    return None


# -- verdicts --------------------------------------------------------------------------------


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


# -- training runs ---------------------------------------------------------------------------


def train_grid(ctx: Context, specs: Iterable[Sequence[str]]) -> list[Run]:
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


def records_as_rows(runs: Sequence[Run], task: str) -> list[dict[str, Any]]:
    """One CSV row per run: its setting, quality, k̂/k and projected timing."""
    rows = []
    for r in runs:
        km, k5, k95 = r.k_ratio_stats()
        p = r.projection()
        rows.append({
            "task": task, "compressor": r.compressor, "ratio": r.ratio, "workers": r.workers,
            "steps": r.steps, "metric": r.metric, "final": r.final_eval, "best": r.best(),
            "k_ratio_mean": km, "k_ratio_p5": k5, "k_ratio_p95": k95,
            "measured_sim_step_s": p.measured_step_s, "compress_s": p.compress_s,
            "projected_step_s": p.step_s,
            "projected_samples_per_s": p.samples_per_s,
            "target_workers": r.target_workers, "data_source": r.data_source,
            "run_dir": os.path.relpath(r.path),
        })
    return rows
