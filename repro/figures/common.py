"""Helpers the paper figures share; a figure module imports them from here (or the
pipeline from base.py), never from another figure module.

Plots: `pyplot` (headless matplotlib), `smooth`, and the line styles of the SIDCo and
DRAGONN plots (`COLOURS`, `label`). Inputs: `model_gradients` and `saved_source` (real
model gradients for repro.measure), `bench_cpu_note` and `encode_cell` (repro bench
reports). Training: `train_grid` (runs through `ctx.train`, read with repro.runs),
`compressor_overrides`, `param_count`, `records_as_rows`. Verdicts: `claim_row` (base.judge
with the figures' argument order). Timed quantities: `Spread` (median and 10th–90th
percentile of samples, from repro.bench's interleaved rounds), `paired` (a ratio taken
round by round), `lowest` / `highest` (over several settings), and for training runs
`step_samples`, `pooled_steps` and `timing_ratio` (two runs' step times, with their
timing repeats, step by step: the interval of a ratio of two runs' mean step times);
`last_evaluations` (two runs' last evaluations compared step by step, for claims about
where training ends up: one evaluation of a small model swings by tens of points);
`errorbars` draws an interval on a plot. Numbers
print with repro.runs.fmt.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from repro.bench import spread
from repro.figures.base import Context
from repro.figures.verdicts import Row, judge
from repro.runs import WARMUP_STEPS, Run, load_run

# Line styles per compressor, shared by the SIDCo and DRAGONN plots so a method keeps its
# colour from one figure to the next.
COLOURS = {
    "none": "black", "topk": "tab:blue", "dgc": "tab:orange", "redsync": "tab:green",
    "gaussianksgd": "tab:red", "sidco_e": "tab:purple", "sidco_gp": "tab:brown",
    "sidco_p": "tab:pink", "mstopk": "tab:gray", "dragonn": "tab:cyan", "randomk": "tab:olive",
    "signsgd": "tab:gray", "dragonn_ea": "darkcyan",
}
LABELS = {
    "none": "no compression", "topk": "Top-k", "dgc": "DGC", "redsync": "RedSync",
    "gaussianksgd": "GaussianKSGD", "sidco_e": "SIDCo-E", "sidco_gp": "SIDCo-GP",
    "sidco_p": "SIDCo-P", "mstopk": "MSTopK", "dragonn": "DRAGONN", "randomk": "Random-k",
    "signsgd": "SignSGD", "dragonn_ea": "DRAGONN + efficiency-aware selection",
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
    from repro.checkpoints import save

    save(list(grads) if not isinstance(grads, torch.Tensor) else grads, path)
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
              missing_ok: bool = False, *, rule_name: str | None = None,
              interval: tuple[float, float] | None = None, threshold: float | None = None,
              op: str = ">", timed: bool = False, cause: str | None = None,
              projected: bool = False) -> Row:
    """base.judge in the figures' argument order: `holds` is the claim checked on the
    data (None: undecided), `caveat` what differs from the paper. A timed value passes
    its `interval` (with `threshold` and `op`, or a `holds` decided on intervals, where
    None means within noise; `timed` when there is no one interval to pass);
    `rule_name` names a not-comparable rule that applies; `cause` says why the claim
    would not hold ("<cause>: <specifics>"); `projected`: the value is the cost model's."""
    return judge(setting, metric, paper, reproduced, claim=claim, holds=holds,
                 interval=interval, threshold=threshold, op=op, rule_name=rule_name,
                 detail=caveat, unit=unit, missing_ok=missing_ok, timed=timed, cause=cause,
                 projected=projected)


# -- timed quantities ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """A timed quantity: the median of its samples and their 10th–90th percentile."""

    median: float
    lo: float
    hi: float
    n: int = 0

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        samples = [float(s) for s in samples if np.isfinite(s)]
        if not samples:
            raise ValueError("a spread of no samples")
        med, lo, hi = spread(samples)
        return cls(med, lo, hi, len(samples))

    @property
    def interval(self) -> tuple[float, float]:
        return (self.lo, self.hi)

    def scaled(self, factor: float) -> Spread:
        lo, hi = sorted((self.lo * factor, self.hi * factor))
        return Spread(self.median * factor, lo, hi, self.n)

    def map(self, fn: Callable[[float], float]) -> Spread:
        """fn applied to the median and both ends (fn monotone)."""
        lo, hi = sorted((fn(self.lo), fn(self.hi)))
        return Spread(fn(self.median), lo, hi, self.n)


def paired(num: Sequence[float], den: Sequence[float]) -> Spread:
    """The ratio num[r] / den[r] of two cells timed in the same interleaved rounds."""
    return Spread.of([a / b for a, b in zip(num, den) if b > 0])


LAST_EVALUATIONS = 5


def last_evaluations(a: Run, b: Run, key: str, how: Callable[[float, float], float],
                     n: int = LAST_EVALUATIONS) -> tuple[Spread | None, list[int]]:
    """how(a's value, b's value) of `key` at each of the last `n` steps both runs evaluated:
    its Spread (median, 10th–90th percentile) and those steps; (None, []) without any."""
    xa, ya = a.series(key)
    xb, yb = b.series(key)
    mine, theirs = dict(zip(xa, ya)), dict(zip(xb, yb))
    steps = sorted(set(mine) & set(theirs))[-n:]
    values = [how(mine[s], theirs[s]) for s in steps]
    if not values or not any(np.isfinite(values)):
        return None, []
    return Spread.of(values), [int(s) for s in steps]


def lowest(spreads: Iterable[Spread]) -> Spread:
    """The smallest of several quantities: its median and both ends are the minima."""
    s = list(spreads)
    return Spread(min(x.median for x in s), min(x.lo for x in s), min(x.hi for x in s),
                  min(x.n for x in s))


def highest(spreads: Iterable[Spread]) -> Spread:
    s = list(spreads)
    return Spread(max(x.median for x in s), max(x.lo for x in s), max(x.hi for x in s),
                  min(x.n for x in s))


def cell_spread(cell: Mapping[str, Any], key: str) -> Spread:
    """A `repro bench` cell's timing as a Spread (ms): key "encode", "batched", ..."""
    return Spread(cell[f"{key}_ms"], cell[f"{key}_p10_ms"], cell[f"{key}_p90_ms"],
                  cell.get("repeats", 0))


def step_samples(run: Run, value: Callable[[Run], float | None]) -> list[float]:
    """`value` of each timed step of a run on its own (steps after the warm-up): e.g.
    `lambda r: r.projection().step_s` gives the projected time of every step."""
    out = []
    for rec in run.metrics:
        if rec.get("step_s") is None or rec["step"] < WARMUP_STEPS:
            continue
        v = value(dataclasses.replace(run, metrics=[rec]))
        if v is not None and np.isfinite(v):
            out.append(float(v))
    return out


def projected_steps(run: Run) -> list[float]:
    """The projected step time of each timed step of a simulated run (repro/runs.py)."""
    return step_samples(run, projected_step)


def step_ratio(num: Sequence[float], den: Sequence[float]) -> Spread:
    """The ratio of two training runs' step times: mean(num) / mean(den), with the 10th
    and 90th percentile of the step-by-step ratios num[i] / den[j] over every pair of
    steps. The runs were timed one after the other, not in interleaved rounds, so each
    pair stands for one measurement of the ratio, as a round does for a benchmark cell:
    the interval is the spread of a single measurement (which a shift of the machine's
    load between the two runs also widens), not the error of the means."""
    a = np.asarray(num, dtype=np.float64)
    b = np.asarray(den, dtype=np.float64)
    if a.size == 0 or b.size == 0 or b.mean() <= 0 or (b <= 0).any():
        raise ValueError("step_ratio needs positive samples on both sides")
    ratios = (a[:, None] / b[None, :]).ravel()
    lo, hi = np.percentile(ratios, [10, 90])
    return Spread(float(a.mean() / b.mean()), float(lo), float(hi), min(a.size, b.size))


def projected_step(run: Run) -> float | None:
    """The projected step time of a run (of one timed step, given a one-step run)."""
    return run.projection(skip_steps=0).step_s


def pooled_steps(run: Run, per_step: Callable[[Run], float | None] = projected_step
                 ) -> list[float]:
    """`per_step` of every timed step of the run and of its timing repeats
    (`train_grid(..., repeats=...)`)."""
    out = step_samples(run, per_step)
    for again in getattr(run, "timing_repeats", ()):
        out += step_samples(again, per_step)
    return out


def timing_ratio(point: float | None, num: Run, den: Run,
                 per_step: Callable[[Run], float | None] = projected_step) -> Spread | None:
    """A ratio of two training runs (`point`, e.g. a throughput or time-to-target ratio
    computed from the runs) whose timing part is mean step(num) / mean step(den): the
    part that does not depend on timing (`point` over the runs' own step ratio) times
    `step_ratio` of the steps of both runs and their timing repeats. None without a
    point or timed steps."""
    if point is None or not np.isfinite(point):
        return None
    a, b = step_samples(num, per_step), step_samples(den, per_step)
    pa, pb = pooled_steps(num, per_step), pooled_steps(den, per_step)
    if not a or not b or min(pa) <= 0 or min(pb) <= 0:
        return None
    factor = point / (float(np.mean(a)) / float(np.mean(b)))
    return step_ratio(pa, pb).scaled(factor)


def errorbars(spreads: Sequence[Spread | None]) -> np.ndarray:
    """matplotlib's yerr (2 × n: below, above the median) for intervals (0 where None)."""
    below = [0.0 if s is None else max(0.0, s.median - s.lo) for s in spreads]
    above = [0.0 if s is None else max(0.0, s.hi - s.median) for s in spreads]
    return np.array([below, above])


# -- training runs ---------------------------------------------------------------------------


# Training runs whose step times a figure compares are trained this many times, each
# pass in the reverse order of the one before (A B C, then C B A): runs are timed one
# after the other, and a busy spell of the machine then falls on different runs in each
# pass. The repeats only add step times; the figure's other numbers come from the first.
TIMING_REPEATS = 2


def train_grid(ctx: Context, specs: Iterable[Sequence[str]], repeats: int = 1) -> list[Run]:
    """One `repro train` run per override list (finished runs are skipped), then read.
    repeats > 1: every run again in passes of alternating order (TIMING_REPEATS), under
    runs/<id>-repeat<i>/, each kept as the first run's `timing_repeats` (`pooled_steps`)."""
    specs = [list(s) for s in specs]
    out = []
    for overrides in specs:
        (run_dir,) = ctx.train(overrides)
        out.append(load_run(run_dir))
    order = list(range(len(specs)))
    for again in range(1, repeats):
        order.reverse()
        for i in order:
            (run_dir,) = ctx.train(specs[i], repeat=again,
                                   note=f"timing repeat {again} of {repeats - 1}")
            repeat_runs = getattr(out[i], "timing_repeats", [])
            out[i].timing_repeats = [*repeat_runs, load_run(run_dir)]
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


# -- measured on an emulated link ------------------------------------------------------------

# Real gloo ranks on an emulated link (cluster.network=emulated, repro.netem): the
# throughput figures' measured rows. Two ranks, one per core of this machine, at the
# highest link rate this 2-core host carries as the link, not as its own CPU, for two
# ranks (`repro netcheck`, results/netcheck/): the papers' 10–100 Gbps exceed it.
LINK_WORKERS = 2
LINK_GBPS = 2.5
MODEL_AGREEMENT = 0.20  # a projection "matches" a measurement within ±20%


def link_note(bandwidth_gbps: float = LINK_GBPS, workers: int = LINK_WORKERS) -> str:
    return (f"measured on an emulated {bandwidth_gbps:g} Gbps link, 2-core CPU compute "
            f"({workers} gloo ranks)")


def link_unavailable() -> str | None:
    """Why the emulated link cannot be built here (None: it can)."""
    from repro import netem

    try:
        netem.check_available()
    except netem.NetworkUnavailable as exc:
        return str(exc)
    return None


def link_overrides(bandwidth_gbps: float = LINK_GBPS, workers: int = LINK_WORKERS) -> list[str]:
    """A run's overrides for real gloo ranks on the emulated link, projected onto that
    same link (so its projection can be set beside its measurement)."""
    return ["cluster.mode=spawn", f"cluster.workers={workers}", "cluster.backend=gloo",
            "cluster.device=cpu", "cluster.nodes=1", "cluster.threads_per_worker=1",
            "cluster.network=emulated", f"cluster.bandwidth_gbps={bandwidth_gbps:g}",
            "cluster.latency_ms=0", f"cluster.target_workers={workers}"]


def link_runs(ctx: Context, specs: Mapping[str, Sequence[str]], steps: int
              ) -> dict[str, Run] | str:
    """One run per spec on the emulated link (link_overrides), `steps` steps, no
    evaluation; the runs by key, or the reason they cannot run here."""
    reason = link_unavailable()
    if reason is not None:
        return reason
    common = [*link_overrides(), f"steps={steps}", "eval_every=0", "eval_batches=1"]
    return {key: load_run(ctx.train([*overrides, *common],
                                    note=link_note())[0]) for key, overrides in specs.items()}


def _per_sample_steps(run: Run) -> list[float]:
    out = []
    for rec in run.metrics:
        if rec.get("step_s") is None or rec["step"] < WARMUP_STEPS:
            continue
        samples = rec.get("samples") or (rec.get("samples_per_s") or 0) * rec["step_s"]
        if samples:
            out.append(float(rec["step_s"]) / float(samples))
    return out


def measured_throughput_ratio(num: Run, den: Run) -> Spread | None:
    """num's measured samples/s over den's (total samples over total step time, steps
    after the warm-up), with the step-by-step interval of `step_ratio`."""
    a, b = _per_sample_steps(num), _per_sample_steps(den)
    if not a or not b or min(a) <= 0 or min(b) <= 0:
        return None
    return step_ratio(b, a)


def measured_part_ratio(num: Run, den: Run, key: str) -> Spread | None:
    """num's mean per-step `key` (e.g. comm_s) over den's, steps after the warm-up,
    with the step-by-step interval of `step_ratio`."""
    a = num.series(key, skip_steps=WARMUP_STEPS)[1]
    b = den.series(key, skip_steps=WARMUP_STEPS)[1]
    if not a or not b or min(b) <= 0:
        return None
    return step_ratio(a, b)


def projection_check(run: Run) -> Spread | None:
    """Projected over measured step time of a run on the emulated link, projected onto
    that link (its own compute and compression, the cost model's communication): the
    overall ratio (sums) with the 10–90% interval of the per-step ratios."""
    pairs = [(float(r["projected/step_s"]), float(r["step_s"])) for r in run.metrics
             if r["step"] >= WARMUP_STEPS and r.get("step_s") and r.get("projected/step_s")]
    if not pairs:
        return None
    each = [p / m for p, m in pairs]
    lo, hi = np.percentile(each, [10, 90])
    return Spread(sum(p for p, _ in pairs) / sum(m for _, m in pairs), float(lo), float(hi),
                  len(pairs))


def within(spread: Spread | None, tolerance: float = MODEL_AGREEMENT) -> bool | None:
    """A ratio's interval inside 1 ± tolerance (True), wholly outside it (False), or
    reaching across its edge (None)."""
    if spread is None:
        return None
    lo, hi = 1 - tolerance, 1 + tolerance
    if lo <= spread.lo and spread.hi <= hi:
        return True
    if spread.hi < lo or spread.lo > hi:
        return False
    return None


def projection_rows(setting: str, runs: Mapping[str, Run], names: Mapping[str, str],
                    bandwidth_gbps: float = LINK_GBPS) -> list[Row]:
    """One row per run on the emulated link: its projected step (the method the figure's
    projected rows use: measured compute and compression, communication from the cost
    model) over its measured step, checked within ±20%."""
    rows = []
    for key, run in runs.items():
        check = projection_check(run)
        rows.append(claim_row(
            setting, f"{names.get(key, key)}: projected / measured step time", None,
            None if check is None else check.median, within(check),
            f"the projection this figure uses matches a measurement on the same link within "
            f"±{MODEL_AGREEMENT:.0%} (checked on the step-by-step interval)",
            f"{link_note(bandwidth_gbps)}; the projection onto that link: this run's compute "
            "and compression plus the cost model's communication (gloo on the emulated link)",
            "×", interval=None if check is None else check.interval, timed=True,
            cause="suite: the cost model's communication on this link misses part of the "
                  "measured step (e.g. gloo's per-collective costs, the hook's thread hops, "
                  "how much of it overlaps backward)"))
    return rows


def not_measured_row(setting: str, metric: str, reason: str) -> Row:
    """The row a measured quantity gets where the emulated link cannot be built."""
    return claim_row(setting, metric, None, None, None,
                     "measured on an emulated link (needs root and iproute2)",
                     f"not measured here: {reason}", rule_name="not run")


def measured_split_text(run: Run, name: str) -> str:
    """`name`'s mean measured step on the link, split: "compute 41.2 ms, compression 3.1
    ms, communication 5.0 ms" (steps after the warm-up; communication overlaps backward)."""
    def ms(key: str) -> str:
        values = run.series(key, skip_steps=WARMUP_STEPS)[1]
        return "n/a" if not values else f"{1e3 * float(np.mean(values)):.3g} ms"

    return (f"{name}: step {ms('step_s')} = compute {ms('compute_s')}, compression "
            f"{ms('compress_s')}, communication {ms('comm_s')} (measured)")
