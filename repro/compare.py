"""Side-by-side comparison of finished (or running) training runs (`repro compare`).

Reads each run directory with repro.runs (config.yaml, metrics.jsonl, summary.json; see
repro/logging.py for the layout), prints one table row per run (and, for a config run over
several seeds, one row of mean ± std) and writes PNG plots plus a static index.html to an
output folder, by default runs/<group>/compare/<time>/ (never inside a run folder). Each
run's curve has its own color, line style and marker; every plot is saved whole (titles,
labels and legends inside the image). Runs that differ in workers or launch mode get a
warning: their throughputs and times are not comparable.

Table columns (means are over the logged steps that carry the value):

| column               | meaning                                                            |
|----------------------|--------------------------------------------------------------------|
| final loss           | training loss of the last logged step                              |
| best eval/<metric>   | best evaluation value of the task's quality metric (direction from |
|                      | the summary's higher_is_better, else from the metric's name)       |
| time to target (s)   | wall time when the metric first reached the task's target          |
| samples/s            | measured throughput, all workers: total samples / total step time  |
| projected samples/s  | onto the target cluster: projected samples / projected step time   |
| k̂/k                  | mean estimation quality (selected / target elements)               |
| density              | mean actual density of the aggregate, |∪ indices| / d               |
| sent/worker/step     | mean payload one worker contributed per step                       |
| wire/worker/step     | mean bytes its link carried per step (ring collectives at the run's |
|                      | worker count: (K−1)× an allgather's payload, 2(K−1)/K× allreduce's) |
| compress / comm (ms) | mean per-step encode+decode time / communication time              |

Projected values (keys "projected/...") come from the cost model, not from a measurement,
and are labelled "projected" wherever they appear.

Further metrics (`metrics`, `repro compare --metric NAME`) add a "mean KEY" and a "last
KEY" column and a plot against `x` each. NAME is a metrics.jsonl key or its W&B name
(repro.logging.wandb_name): "compress/khat_over_k" selects the same series as
"estimation_quality".
"""

from __future__ import annotations

import csv
import html
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from repro.durable import write_file, write_text
from repro.logging import metric_key, wandb_name
from repro.runs import Run, fmt, load_runs

X_LABELS = {"step": "step", "time": "wall time (s)"}


# -- the table ---------------------------------------------------------------------------
def best_and_target(run: Run) -> tuple[float | None, float | None, str]:
    """(best value of the quality metric, time to target in s, status of the target)."""
    if run.metric is None:
        return None, None, "no metric"
    best = run.best()
    target = run.target
    if run.summary and isinstance(run.summary.get("time_to_target_s"), (int, float)):
        return best, float(run.summary["time_to_target_s"]), "reached"
    if target is None:
        return best, None, "no target"
    for t, v in zip(*run.series(run.eval_key, "time")):
        if run.reaches(v, target):
            return best, t, "reached"
    return best, None, "not reached" if run.done else "not yet"


def selected_keys(runs: Sequence[Run], names: Sequence[str]) -> list[str]:
    """The metrics.jsonl keys of the metrics asked for by either name, in order, each
    once; a ValueError for one that no run logged."""
    keys = list(dict.fromkeys(metric_key(n) for n in names))
    logged = {k for r in runs for rec in r.metrics for k in rec}
    missing = [k for k in keys if k not in logged]
    if missing:
        known = ", ".join(f"{k} ({wandb_name(k)})" for k in sorted(logged - {"step", "wall_time"}))
        raise ValueError(f"no run logged {', '.join(map(repr, missing))}; the runs logged: {known}")
    return keys


def table_rows(runs: Sequence[Run], extra: Sequence[str] = ()) -> tuple[list[str], list[list[Any]]]:
    """Column headers and raw values (numbers stay numbers; the formatter rounds);
    `extra`: metrics.jsonl keys, each adding its mean and its last value."""
    metrics = {r.metric for r in runs if r.metric}
    best_header = f"best eval/{next(iter(metrics))}" if len(metrics) == 1 else "best eval metric"
    with_projected = any(r.series("projected/samples_per_s")[1] for r in runs)
    target_workers = sorted({r.cfg("cluster.target_workers") for r in runs
                             if r.cfg("cluster.target_workers") is not None})
    projected_header = "projected samples/s" + (
        f" ({target_workers[0]} workers)" if len(target_workers) == 1 else "")
    headers = ["run", "compressor", "ratio", "workers", "task", "data", "status", "final loss",
               best_header, "time to target (s)", "samples/s"]
    if with_projected:
        headers.append(projected_header)
    headers += ["k̂/k", "density", "sent/worker/step", "wire/worker/step", "compress (ms)",
                "comm (ms)"]
    for key in extra:
        headers += [f"mean {key}", f"last {key}"]
    rows = []
    for r in runs:
        best, ttt, status = best_and_target(r)
        rate = r.throughput()
        best_cell: Any = best
        if len(metrics) > 1 and best is not None:
            best_cell = f"{r.metric}={fmt(best)}"
        row: list[Any] = [
            r.name, r.compressor, r.cfg("compressor.ratio"), r.cfg("cluster.workers"), r.task,
            r.data_source, r.status, r.last("loss"), best_cell,
            ttt if ttt is not None else status, rate.samples_per_s,
        ]
        if with_projected:
            row.append(rate.projected_samples_per_s)
        compress, comm = r.mean("compress_s"), r.mean("comm_s")
        row += [r.mean("estimation_quality"), r.mean("density"), ByteCount(r.mean("bytes_sent")),
                ByteCount(r.mean("wire_bytes")),
                None if compress is None else compress * 1e3, None if comm is None else comm * 1e3]
        for key in extra:
            row += [r.mean(key), r.last(key)]
        rows.append(row)
    return headers, rows



def wrap_title(title: str, width: int = 80) -> str:
    """A plot title broken into lines of at most `width` characters, so that a long task
    or data-set name is not cut at the figure's edge."""
    import textwrap

    return "\n".join(textwrap.wrap(title, width)) or title

LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "x", "P", "*")


def wrap_label(text: str, width: int = 60) -> str:
    """A legend or tick label in lines of at most `width` characters (a run name without
    spaces is cut at any character)."""
    return "\n".join(text[i:i + width] for i in range(0, len(text), width)) or text


def legend_below(fig, entries: int, ncol: int | None = None) -> None:
    """The figure's legend under its axes, outside the plotted area (constrained layout
    makes room): it hides no curve and no axis label."""
    ncol = ncol or (1 if entries > 3 else max(1, entries))
    fig.legend(fontsize="small", loc="outside lower center", ncol=ncol, frameon=False)


def figure_size(width: float, height: float, legend_rows: int) -> tuple[float, float]:
    """A figure tall enough for its axes and a legend of `legend_rows` lines below them."""
    return width, height + 0.22 * legend_rows


class ByteCount:
    """Bytes, printed with a binary unit."""

    def __init__(self, value: float | None):
        self.value = value

    def __str__(self) -> str:
        if self.value is None:
            return "—"
        v = float(self.value)
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(v) < 1024 or unit == "GiB":
                return f"{v:.0f} {unit}" if unit == "B" else f"{v:.2f} {unit}"
            v /= 1024
        return f"{v:.2f} GiB"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(headers)] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- plots -------------------------------------------------------------------------------
@dataclass
class Plot:
    file: str
    title: str


def title_suffix(runs: Sequence[Run]) -> str:
    """"cifar10_resnet20 (standin data)" for the tasks the plotted runs cover."""
    parts = []
    for task, src in dict.fromkeys((r.task, r.data_source) for r in runs):
        parts.append(f"{task} ({src} data)" if src else task)
    return ", ".join(parts)


def safe_file(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


class Plotter:
    def __init__(self, runs: Sequence[Run], out: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.runs = runs
        self.out = out
        cmap = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")
        self.colors = {r.path: cmap(i % cmap.N) for i, r in enumerate(runs)}
        # Each run also gets its own line style and marker, so that runs whose curves lie
        # on top of each other (equal losses, a baseline twice) stay visible.
        self.styles = {r.path: (LINE_STYLES[i % len(LINE_STYLES)], MARKERS[i % len(MARKERS)])
                       for i, r in enumerate(runs)}
        self.plots: list[Plot] = []
        self.skipped: list[str] = []

    def draw(self, ax, r: Run, xs, ys, label: str, dashed: bool = False) -> None:
        style, marker = self.styles[r.path]
        ax.plot(xs, ys, "--" if dashed else style, label=label, color=self.colors[r.path],
                lw=1.4, marker=marker, ms=4, markevery=max(1, len(xs) // 10),
                fillstyle="none")

    def save(self, fig, file: str, title: str) -> None:
        try:
            # bbox_inches="tight": the saved image grows to hold every title, label and
            # legend, so none is cut at its edge.
            write_file(os.path.join(self.out, file),
                       lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight",
                                             pad_inches=0.15), binary=True)
        finally:
            self.plt.close(fig)
        self.plots.append(Plot(file, title))

    def line(self, key: str, x: str, ylabel: str, what: str, *, ref: float | None = None,
             ref_label: str | None = None, runs: Sequence[Run] | None = None) -> None:
        """One line per run that logged `key` against step or wall time."""
        runs = self.runs if runs is None else runs
        have = [(r, *r.series(key, x)) for r in runs]
        have = [(r, xs, ys) for r, xs, ys in have if ys]
        file = f"{safe_file(key)}_vs_{x}.png"
        if not have:
            self.skipped.append(f"{file}: no run logged {key!r}")
            return
        lines = sum(len(r.name) // 60 + 1 for r, _, _ in have) + (ref is not None)
        fig, ax = self.plt.subplots(figsize=figure_size(7.5, 4.5, lines), layout="constrained")
        for r, xs, ys in have:
            self.draw(ax, r, xs, ys, wrap_label(r.name))
        if ref is not None:
            ax.axhline(ref, color="grey", ls=":", lw=1, label=ref_label)
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(ylabel)
        title = f"{what} vs {X_LABELS[x].split(' (')[0]} — {title_suffix([r for r, _, _ in have])}"
        ax.set_title(wrap_title(title), fontsize=10)
        ax.grid(alpha=0.3)
        legend_below(fig, len(have) + (ref is not None))
        self.save(fig, file, title)

    def throughput(self, x: str) -> None:
        """Measured throughput; projected throughput in its own panel, labelled."""
        measured = [(r, *r.series("samples_per_s", x)) for r in self.runs]
        measured = [m for m in measured if m[2]]
        projected = [(r, *r.series("projected/samples_per_s", x)) for r in self.runs]
        projected = [p for p in projected if p[2]]
        file = f"throughput_vs_{x}.png"
        if not measured and not projected:
            self.skipped.append(f"{file}: no run logged 'samples_per_s' or 'projected/samples_per_s'")
            return
        panels = [(measured, "measured", "samples/s (all workers)")] if measured else []
        if projected:
            workers = sorted({r.cfg("cluster.target_workers") for r, _, _ in projected} - {None})
            on = f" on {workers[0]} workers" if len(workers) == 1 else ""
            panels.append((projected, f"projected{on} (cost model)", "projected samples/s"))
        entries = sum(len(p[0]) for p in panels)
        fig, axes = self.plt.subplots(1, len(panels), squeeze=False, layout="constrained",
                                      figsize=figure_size(7.5 * len(panels), 4.5,
                                                          (entries + len(panels) - 1)
                                                          // len(panels) * 2))
        for ax, (series, label, ylabel) in zip(axes[0], panels):
            dashed = label.startswith("projected")
            for r, xs, ys in series:
                name = wrap_label(r.name) + (" (projected)" if dashed else "")
                self.draw(ax, r, xs, ys, name, dashed=dashed)
            ax.set_xlabel(X_LABELS[x])
            ax.set_ylabel(ylabel)
            ax.set_title(f"throughput, {label}", fontsize=10)
            ax.grid(alpha=0.3)
        legend_below(fig, entries, ncol=len(panels) if entries > 3 else None)
        title = f"Throughput — {title_suffix([s[0] for p in panels for s in p[0]])}"
        fig.suptitle(wrap_title(title, 70 * len(panels)), fontsize=11)
        self.save(fig, file, title)

    def time_breakdown(self) -> None:
        """Mean per-step time split into compute, compression and communication."""
        parts = [("compute_s", "compute"), ("compress_s", "compress (encode+decode)"),
                 ("comm_s", "communication")]
        runs = [r for r in self.runs if any(r.mean(k) is not None for k, _ in parts)]
        file = "step_time_breakdown.png"
        if not runs:
            self.skipped.append(f"{file}: no run logged 'compute_s', 'compress_s' or 'comm_s'")
            return
        import numpy as np

        # One horizontal bar per run: its name (wrapped) beside the bar, never rotated
        # past the figure's edge; the legend below the axes.
        fig, ax = self.plt.subplots(figsize=(7.5, 2.0 + 0.55 * len(runs)), layout="constrained")
        left = np.zeros(len(runs))
        rows = np.arange(len(runs))[::-1]  # the first run on top, as in the table
        for key, label in parts:
            vals = np.array([(r.mean(key) or 0.0) * 1e3 for r in runs])
            ax.barh(rows, vals, left=left, label=label)
            left += vals
        ax.set_yticks(rows, [wrap_label(r.name, 40) for r in runs], fontsize="small")
        ax.set_xlabel("mean time per step (ms)")
        title = f"Step time breakdown (measured) — {title_suffix(runs)}"
        ax.set_title(wrap_title(title, 70), fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        legend_below(fig, len(parts), ncol=3)
        self.save(fig, file, title)


def make_plots(runs: Sequence[Run], out: str, x: str = "step", metrics: Sequence[str] = ()
               ) -> Plotter:
    """Loss and quality metric against both step and wall time; the per-step diagnostics
    (throughput, k̂/k, density, bytes) and the `metrics` (metrics.jsonl keys) against `x`."""
    p = Plotter(runs, out)
    for axis in ("step", "time"):
        p.line("loss", axis, "training loss", "Training loss")
    for metric in dict.fromkeys(r.metric for r in runs if r.metric):
        runs_m = [r for r in runs if r.metric == metric]
        targets = {r.target for r in runs_m}
        ref = next(iter(targets)) if len(targets) == 1 else None
        for axis in ("step", "time"):
            p.line(f"eval/{metric}", axis, f"eval {metric}", f"Eval {metric}", ref=ref,
                   ref_label=None if ref is None else f"target {ref:g}", runs=runs_m)
    p.throughput(x)
    p.line("estimation_quality", x, r"$\hat{k}/k$ (selected / target elements)",
           "Estimation quality", ref=1.0, ref_label=r"$\hat{k} = k$")
    p.line("density", x, "density |∪ indices| / d", "Actual density of the aggregate")
    p.line("bytes_sent", x, "bytes sent per worker per step (B)", "Bytes sent")
    p.time_breakdown()
    drawn = {plot.file for plot in p.plots}
    for key in metrics:
        if f"{safe_file(key)}_vs_{x}.png" not in drawn:
            p.line(key, x, f"{key} (W&B: {wandb_name(key)})", key)
    return p


# -- output ------------------------------------------------------------------------------
def write_csv(path: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def write(f) -> None:
        w = csv.writer(f)
        w.writerow(headers)
        for row in rows:
            w.writerow(["" if v is None else (v.value if isinstance(v, ByteCount) else v)
                        for v in row])

    write_file(path, write)


def header_html(header: str) -> str:
    """A column header, escaped, that may break after each "/" or "_" as well as at its
    spaces ("sent/worker/step"), so that the table fits the page without cutting words."""
    return "".join(html.escape(c) + ("<wbr>" if c in "/_" else "") for c in header)


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    e = html.escape
    head = "".join(f"<th>{header_html(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="{"text" if isinstance(v, str) else "num"}">'
                                    f"{e(fmt(v))}</td>" for v in row) + "</tr>\n" for row in rows)
    return f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table></div>'


def write_html(path: str, runs: Sequence[Run], headers: Sequence[str], rows: Sequence[Sequence[Any]],
               plotter: Plotter, seeds: tuple[list[str], list[list[Any]]] | None = None,
               warnings: Sequence[str] = ()) -> None:
    e = html.escape
    extra = "".join(f"<p><strong>{e(w)}</strong></p>\n" for w in warnings)
    if seeds is not None and seeds[1]:
        extra += "<h2>Over seeds (mean ± std)</h2>\n" + html_table(*seeds) + "\n"
    figures = "".join(f'<figure><img src="{e(p.file)}" alt="{e(p.title)}"><figcaption>{e(p.title)}'
                      f"</figcaption></figure>\n" for p in plotter.plots)
    skipped = ""
    if plotter.skipped:
        items = "".join(f"<li>{e(s)}</li>" for s in plotter.skipped)
        skipped = f"<h2>Plots not drawn</h2><ul>{items}</ul>"
    sources = "".join(f"<li><code>{e(r.name)}</code>: <code>{e(os.path.abspath(r.path))}</code></li>"
                      for r in runs)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>repro compare — {e(title_suffix(runs))}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; overflow-wrap: break-word; }}
.table {{ max-width: 100%; overflow-x: auto; }}
table {{ border-collapse: collapse; font-size: 0.8em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.35em; text-align: right; }}
th {{ background: #f0f0f0; }} td.num {{ white-space: nowrap; }}
td:first-child {{ text-align: left; overflow-wrap: anywhere; min-width: 8em; }}
figure {{ display: inline-block; vertical-align: top; margin: 1em; max-width: calc(100% - 2em); }}
img {{ display: block; max-width: 100%; height: auto; }}
</style></head><body>
<h1>Run comparison — {e(title_suffix(runs))}</h1>
<p>Generated {e(time.strftime("%Y-%m-%d %H:%M:%S"))} by <code>repro compare</code>. Means are over
logged steps; "projected" values come from the cost model, not from a measurement.</p>
{html_table(headers, rows)}
{extra}{figures}{skipped}
<h2>Runs</h2><ul>{sources}</ul>
</body></html>
"""
    write_text(path, page)


def default_out(runs: Sequence[Run]) -> str:
    """Where a comparison goes when no --out is given: compare/<time>/ beside the runs'
    folders, in their group (runs/<group>/compare/...; runs of several groups: the folder
    above them), never inside a run folder that `repro train --restart` deletes."""
    from repro.config import COMPARE_FOLDER

    parents = [os.path.dirname(os.path.abspath(os.path.normpath(r.path))) for r in runs]
    base = os.path.commonpath(parents)
    if len(set(parents)) > 1 and base in parents:  # a run's own folder holds the others
        base = os.path.dirname(base)
    return os.path.join(base, COMPARE_FOLDER, time.strftime("%Y%m%d-%H%M%S"))


# What may differ between the runs of one config repeated over seeds.
SEED_FREE = ("seed", "name", "run_dir", "runs_root", "group")


def seed_groups(runs: Sequence[Run]) -> list[list[Run]]:
    """The runs in groups of the same config but for the seed (and where they live, how
    they are shown: repro.config.RESULT_NEUTRAL_KEYS), in first-seen order; only groups
    of two or more runs."""
    from repro.config import RESULT_NEUTRAL_KEYS, flatten_config, within

    def key(r: Run) -> str:
        flat = flatten_config(r.config)
        skip = (*SEED_FREE, *RESULT_NEUTRAL_KEYS)
        return repr(sorted((k, repr(v)) for k, v in flat.items() if not within(k, skip)))

    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    return [g for g in groups.values() if len(g) > 1]


def mean_std(values: Sequence[float | None]) -> str:
    """"mean ± std (n)" of the values that are numbers (std over the runs, n − 1)."""
    import statistics

    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return "—"
    if len(nums) == 1:
        return f"{fmt(nums[0])} (n=1)"
    return f"{fmt(statistics.fmean(nums))} ± {fmt(statistics.stdev(nums), '.2g')} (n={len(nums)})"


def seed_rows(runs: Sequence[Run]) -> tuple[list[str], list[list[Any]]]:
    """One row per config run with several seeds: mean ± std over its seeds of the final
    loss, the best quality metric and the throughput."""
    headers = ["config (runs)", "seeds", "final loss", "best eval metric", "samples/s"]
    rows = []
    for group in seed_groups(runs):
        label = f"{group[0].name} + {len(group) - 1} more"
        seeds = ", ".join(str(r.cfg("seed")) for r in group)
        rows.append([label, seeds, mean_std([r.last("loss") for r in group]),
                     mean_std([best_and_target(r)[0] for r in group]),
                     mean_std([r.throughput().samples_per_s for r in group])])
    return headers, rows


# Settings that make throughputs (and the time axes) of runs incomparable.
COMPARABILITY = (("cluster.workers", "workers"), ("cluster.mode", "mode"),
                 ("cluster.network", "network"), ("cluster.device", "device"))


def comparability_warnings(runs: Sequence[Run]) -> list[str]:
    """A warning for each setting the runs differ in that makes their throughputs and
    times not comparable (workers, launch mode, network, device)."""
    out = []
    for key, what in COMPARABILITY:
        values = {str(r.cfg(key)) for r in runs if r.cfg(key) is not None}
        if len(values) > 1:
            out.append(f"warning: the runs differ in {what} ({key}: {', '.join(sorted(values))}): "
                       "their samples/s and wall times are not comparable")
    return out


def compare(paths: Sequence[str], out: str | None = None, x: str = "step", stream=None,
            metrics: Sequence[str] = ()) -> str:
    """Print the table, write the plots, table.csv and index.html into `out` (default:
    `default_out`); return the out folder. `metrics`: further metrics to tabulate and
    plot, each by its metrics.jsonl key or its W&B name."""
    if x not in X_LABELS:
        raise ValueError(f"x={x!r} is not allowed; choose step or time")
    stream = sys.stdout if stream is None else stream
    notes: list[str] = []
    runs = load_runs(paths, notes=notes)
    for note in notes:
        print(note, file=stream)
    keys = selected_keys(runs, metrics)
    out = out or default_out(runs)
    os.makedirs(out, exist_ok=True)
    mark_compare_folder(out)
    headers, rows = table_rows(runs, keys)
    print(format_table(headers, rows), file=stream)
    seeds = seed_rows(runs)
    if seeds[1]:
        print("\nover seeds (mean ± std):", file=stream)
        print(format_table(*seeds), file=stream)
        write_csv(os.path.join(out, "seeds.csv"), *seeds)
    warnings = comparability_warnings(runs)
    for w in warnings:
        print(w, file=stream)
    plotter = make_plots(runs, out, x, keys)
    for s in plotter.skipped:
        print(f"skipped {s}", file=stream)
    write_csv(os.path.join(out, "table.csv"), headers, rows)
    write_html(os.path.join(out, "index.html"), runs, headers, rows, plotter, seeds=seeds,
               warnings=warnings)
    print(f"wrote {len(plotter.plots)} plots, table.csv and index.html to {out}", file=stream)
    return out


def mark_compare_folder(out: str) -> None:
    """Mark `out` as a comparison (repro.runs.load_runs passes over it in runs/<group>/*)."""
    from repro.runs import COMPARE_MARKER

    marker = os.path.join(out, COMPARE_MARKER)
    if not os.path.exists(marker):
        write_text(marker, "written by repro compare\n")
