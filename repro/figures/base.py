"""The figure registry and the pipeline every paper figure goes through.

A figure is a function `produce(ctx) -> list[Row]` registered with `@figure(...)`. It
runs what it needs through the suite's own machinery (`repro.measure`, `repro.bench`,
`ctx.train(...)` for training runs, which skips runs already finished), writes its data
with `ctx.write_csv` and its plot with `ctx.save_plot`, and returns comparison rows:
the paper's value (from results/reference/<paper>.csv via `ctx.reference`), the
reproduced value, and a verdict computed from the data (`holds`, `does not hold`,
`not comparable`) with its reason.

`run_figure` wraps that: it times the call, writes results/<id>/comparison.csv and
comparison.md and status.json (size, machine, torch version, elapsed, verdict counts), and
`write_results_readme` regenerates results/README.md from every status.json.

Sizes: "full" is the figure as this suite reproduces it on a 2-core CPU (outputs go to
results/<id>/ and are committed); "smoke" is a tiny variant run by CI (seconds) so the
pipeline cannot rot (outputs go wherever the caller points `out_root`, a temp folder in
the tests).
"""

from __future__ import annotations

import csv
import fnmatch
import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from repro.runs import fmt

SIZES = ("smoke", "full")
VERDICTS = ("holds", "does not hold", "not comparable")
KINDS = ("benchmark", "training", "analysis")
PAPERS = ("sidco", "dragonn", "deft", "thc")


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent.parent


def default_results_root() -> Path:
    return Path(os.environ.get("GRADCOMP_RESULTS", repo_root() / "results"))


@dataclass(frozen=True)
class Row:
    """One line of a figure's paper-vs-reproduced comparison."""

    setting: str  # e.g. "VGG-16 gradients, δ=0.001"
    metric: str  # e.g. "speed-up over topk"
    paper: float | None  # None when the paper gives no number for this setting
    reproduced: float | None
    verdict: str  # one of VERDICTS
    reason: str  # why: the claim checked, and what differs (CPU vs V100, stand-in data, …)
    unit: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")

    @property
    def ratio(self) -> float | None:
        """reproduced / paper, when both exist and the paper value is non-zero."""
        if self.paper in (None, 0) or self.reproduced is None:
            return None
        return self.reproduced / self.paper


def verdict(holds: bool | None) -> str:
    """The verdict for a claim checked on the data (None: it cannot be checked here)."""
    if holds is None:
        return "not comparable"
    return "holds" if holds else "does not hold"


@dataclass
class Figure:
    id: str
    paper: str
    title: str
    kind: str  # one of KINDS
    hardware: str  # what the paper ran it on
    expected: str  # the paper's claim, one sentence
    est_seconds: dict[str, float]  # estimated run time on a 2-core CPU, per size
    produce: Callable[[Context], list[Row]]
    experiment: str | None = None  # conf/experiment/<name>.yaml when it trains

    def __post_init__(self) -> None:
        if self.paper not in PAPERS:
            raise ValueError(f"figure {self.id!r}: paper {self.paper!r} not in {PAPERS}")
        if self.kind not in KINDS:
            raise ValueError(f"figure {self.id!r}: kind {self.kind!r} not in {KINDS}")
        missing = [s for s in SIZES if s not in self.est_seconds]
        if missing:
            raise ValueError(f"figure {self.id!r}: est_seconds lacks {missing}")


_FIGURES: dict[str, Figure] = {}


def figure(*, id: str, paper: str, title: str, kind: str, hardware: str, expected: str,
           est_seconds: Mapping[str, float], experiment: str | None = None):
    """Register `produce(ctx) -> list[Row]` as figure `id` (duplicate ids are refused)."""

    def deco(fn: Callable[[Context], list[Row]]):
        if id in _FIGURES and _FIGURES[id].produce is not fn:
            raise ValueError(f"figure id {id!r} is already registered")
        _FIGURES[id] = Figure(id, paper, title, kind, hardware, expected, dict(est_seconds), fn,
                              experiment)
        return fn

    return deco


def registered(pattern: str = "*") -> list[str]:
    return sorted(n for n in _FIGURES if fnmatch.fnmatchcase(n, pattern))


def get(figure_id: str) -> Figure:
    try:
        return _FIGURES[figure_id]
    except KeyError:
        raise KeyError(
            f"unknown figure {figure_id!r}; known figures: {', '.join(registered())} "
            "(`repro figure --list` shows them with their status)"
        ) from None


# -- reference values ---------------------------------------------------------------------

REFERENCE_COLUMNS = ("paper", "figure", "setting", "metric", "value", "unit", "source", "note")
REFERENCE_SOURCES = ("text", "table", "plot-estimate")


def read_reference(paper: str, root: Path | None = None) -> list[dict[str, Any]]:
    """results/reference/<paper>.csv as dicts (value as float); the columns are
    REFERENCE_COLUMNS; `source` says whether the value is read from the paper's text or
    a table, or estimated from a plot."""
    path = (root or default_results_root()) / "reference" / f"{paper}.csv"
    if not path.exists():
        raise FileNotFoundError(f"no reference values at {path}")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for i, r in enumerate(rows, start=2):
        if tuple(r) != REFERENCE_COLUMNS:
            raise ValueError(f"{path}: columns must be {','.join(REFERENCE_COLUMNS)}")
        if r["source"] not in REFERENCE_SOURCES:
            raise ValueError(f"{path}:{i}: source {r['source']!r} not in {REFERENCE_SOURCES}")
        r["value"] = float(r["value"])
    return rows


# -- the context a figure runs in ---------------------------------------------------------


@dataclass
class Context:
    figure: Figure
    size: str  # "smoke" | "full"
    out_dir: Path  # results/<id>/ (full) or <out_root>/<id>/ (smoke)
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for ctx.train
    reference_root: Path | None = None
    say: Callable[[str], None] = print

    @property
    def smoke(self) -> bool:
        return self.size == "smoke"

    @property
    def runs_root(self) -> Path:
        return self.out_dir / "runs"

    def reference(self, **match: Any) -> list[dict[str, Any]]:
        """This figure's reference rows, filtered by exact column matches."""
        rows = [r for r in read_reference(self.figure.paper, self.reference_root)
                if r["figure"] == self.figure.id]
        return [r for r in rows if all(r.get(k) == v for k, v in match.items())]

    def reference_value(self, setting: str, metric: str) -> float | None:
        rows = self.reference(setting=setting, metric=metric)
        return rows[0]["value"] if rows else None

    def train(self, overrides: Sequence[str], multirun: bool = False,
              note: str | None = None) -> list[str]:
        """Training runs through `repro train` (runs already DONE are skipped), grouped
        under this figure's runs/ folder; the run directories in order. The figure owns
        that folder, so a run whose config changed is re-run rather than refused. `note`
        is appended, in parentheses, to each run's status line."""
        from repro import launch

        args = [*overrides, f"runs_root={self.runs_root}", f"group={self.figure.id}",
                *self.overrides]
        if self.figure.experiment:
            args.insert(0, f"experiment={self.figure.experiment}")
        say = self.say if note is None else (lambda line: self.say(f"{line} ({note})"))
        return launch.train(args, multirun=multirun, out=say, on_change="restart")

    def write_csv(self, name: str, rows: Iterable[Mapping[str, Any]]) -> Path:
        """Write data rows (dicts with the same keys) to out_dir/<name>.csv atomically."""
        rows = list(rows)
        path = self.out_dir / f"{name}.csv"
        tmp = path.with_suffix(".csv.tmp")
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, path)
        return path

    def save_plot(self, fig, name: str = "figure") -> Path:
        """Save a matplotlib figure as out_dir/<name>.png (title should say what is
        stand-in, projected or CPU-measured) and close it."""
        import matplotlib.pyplot as plt

        path = self.out_dir / f"{name}.png"
        tmp = self.out_dir / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        plt.close(fig)
        os.replace(tmp, path)
        return path


def machine() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def comparison_markdown(fig: Figure, rows: Sequence[Row]) -> str:
    lines = [f"# {fig.id}: {fig.title}", "", f"Paper claim: {fig.expected}", "",
             "| setting | metric | paper | reproduced | ratio | verdict | reason |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = f" {r.unit}" if r.unit else ""
        lines.append(f"| {r.setting} | {r.metric}{unit} | {fmt(r.paper)} | {fmt(r.reproduced)} "
                     f"| {fmt(r.ratio)} | {r.verdict} | {r.reason} |")
    return "\n".join(lines) + "\n"


def summary_verdict(rows: Sequence[Row]) -> str:
    """One line: the counts, and the first row that does not hold (if any)."""
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    text = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    bad = [r for r in rows if r.verdict == "does not hold"]
    if bad:
        text += f"; e.g. does not hold: {bad[0].setting}, {bad[0].metric}"
    return text or "no comparison rows"


def run_figure(figure_id: str, size: str = "full", out_root: Path | str | None = None,
               overrides: Sequence[str] = (), say: Callable[[str], None] = print) -> list[Row]:
    """Run one figure: produce its data, plot and comparison; write status.json."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not allowed; use one of {SIZES}")
    fig = get(figure_id)
    if out_root is not None:
        root = Path(out_root)
    elif size == "smoke":  # smoke outputs never overwrite the committed full results
        root = repo_root() / "runs" / "figures-smoke"
    else:
        root = default_results_root()
    out_dir = root / fig.id
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(fig, size, out_dir, list(overrides), reference_root=None, say=say)
    started = time.time()
    rows = fig.produce(ctx)
    elapsed = time.time() - started
    if not rows:
        raise RuntimeError(f"figure {fig.id} produced no comparison rows")
    with open(out_dir / "comparison.csv.tmp", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setting", "metric", "unit", "paper", "reproduced", "ratio", "verdict", "reason"])
        for r in rows:
            w.writerow([r.setting, r.metric, r.unit, r.paper, r.reproduced, r.ratio, r.verdict, r.reason])
    os.replace(out_dir / "comparison.csv.tmp", out_dir / "comparison.csv")
    (out_dir / "comparison.md").write_text(comparison_markdown(fig, rows))
    status = {"id": fig.id, "size": size, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "elapsed_s": round(elapsed, 1), "machine": machine(),
              "verdicts": {v: sum(r.verdict == v for r in rows) for v in VERDICTS},
              "summary": summary_verdict(rows), "rows": [asdict(r) for r in rows]}
    tmp = out_dir / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1))
    os.replace(tmp, out_dir / "status.json")
    say(f"{fig.id}: {status['summary']} ({elapsed:.0f} s) -> {out_dir}")
    return rows


def experiment_path(name: str) -> Path:
    from repro.launch import conf_dir

    return Path(conf_dir()) / "experiment" / f"{name}.yaml"


EXPERIMENT_HEADER_FIELDS = ("command", "hardware", "expected", "run time")


def experiment_header(name: str) -> dict[str, str]:
    """The `# key: value` header of conf/experiment/<name>.yaml (every figure has one:
    command, hardware the paper used, expected result, run time here)."""
    path = experiment_path(name)
    if not path.exists():
        raise FileNotFoundError(f"figure experiment file {path} is missing")
    header: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line.lstrip("# ").partition(":")
        if sep and key.strip().lower() in EXPERIMENT_HEADER_FIELDS:
            header[key.strip().lower()] = value.strip()
    return header


def read_status(figure_id: str, root: Path | None = None) -> dict[str, Any] | None:
    path = (root or default_results_root()) / figure_id / "status.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def status_line(figure_id: str, root: Path | None = None) -> str:
    st = read_status(figure_id, root)
    if st is None:
        return "not run"
    return f"{st['size']} run {st['finished']} ({st['elapsed_s']:.0f} s)"


def results_readme(root: Path | None = None) -> str:
    """results/README.md: every registered figure, its status and one-line verdict."""
    lines = [
        "# Results",
        "",
        "Generated by `repro figure --readme` from each figure's status.json: do not edit.",
        "",
        "Each figure's folder holds its data (CSV), plot (PNG), comparison.csv/.md (paper",
        "value, reproduced value, ratio, verdict with reason) and status.json. The papers'",
        "values are in reference/<paper>.csv (source: text, table or plot-estimate).",
        "Machine-specific micro-benchmarks are in bench/.",
        "",
        "| figure | paper | what | status | verdict |",
        "|---|---|---|---|---|",
    ]
    for fid in registered():
        fig = get(fid)
        st = read_status(fid, root)
        verdict_text = st["summary"] if st else "—"
        lines.append(f"| [{fid}]({fid}/comparison.md) | {fig.paper} | {fig.title} | "
                     f"{status_line(fid, root)} | {verdict_text} |")
    return "\n".join(lines) + "\n"


def write_results_readme(root: Path | None = None) -> Path:
    root = root or default_results_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / "README.md"
    tmp = root / "README.md.tmp"
    tmp.write_text(results_readme(root))
    os.replace(tmp, path)
    return path
