"""The pipeline every paper figure goes through: the context a figure runs in, and running it.

A figure is a function `produce(ctx) -> list[Row]` registered with `@figure(...)`
(repro/figures/registry.py). It runs what it needs through the suite's own machinery
(`repro.measure`, `repro.bench`, `ctx.train(...)` for training runs, which skips runs
already finished), writes its data with `ctx.write_csv` and its plot with
`ctx.save_plot`, and returns comparison rows made by `judge`
(repro/figures/verdicts.py): the paper's value (from results/reference/<paper>.csv via
`ctx.reference`), the reproduced value (with its interval when it is timed) and a verdict
that one rule table gives, the rule named in the row, and the cause of a row that does not
hold.

Where things go. A run writes into the outputs root (`outputs/` of the clone, ignored by
git; `--out` or $GRADCOMP_OUTPUTS elsewhere): `outputs/<id>/` for the full variant,
`outputs/smoke/<id>/` for the smoke variant, the figure's training runs and scratch
files under its `runs/` there. The published reference outputs are results/<id>/
(committed; $GRADCOMP_RESULTS elsewhere): a run reads them to put the published value and
verdict beside its own, and writes them only when asked to publish (`publish`,
`repro figure ID --publish`), then file by file and only where the content changed, so
republishing a bit-identical figure leaves the tree clean (repro/figures/records.py).

`run_figure` times the call, writes comparison.csv, comparison.md and status.json (size,
verdict counts, rows, and under "run": the machine, when, how long, the load average and
a timing calibration), and `run_figures` runs a list of figures with one progress line
each ("figure 3/13: sidco-fig16 (estimated 70 s, 212 s elapsed)"), the estimates taken
from recorded run times on this kind of machine (repro/figures/machine.py).

Sizes: "full" is the figure as this suite reproduces it on a 2-core CPU; "smoke" is a
tiny variant run by CI (seconds) so the pipeline cannot rot; "long" (training figures
only, the extended set) trains long enough for the convergence claims to be judged on
the stand-ins: at least a tenth of the paper's steps. A long run writes to
outputs/long/<id>/ and publishes to results/long/<id>/.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from repro.durable import write_file, write_text
from repro.figures.machine import busy_reasons, estimate_seconds, load_average, machine
from repro.figures.records import (
    SMOKE_VERDICT,
    comparison_csv_text,
    comparison_markdown,
    publish,
    read_status,
    results_readme,
    run_info,
    shown_verdict,
    status_line,
    status_of,
    value_text,
    verdict_changes,
    write_results_readme,
)
from repro.figures.registry import (
    SIZES,
    Figure,
    check_size,
    default_results_root,
    extended_set,
    figure,
    get,
    outputs_dir,
    published_root,
    registered,
)
from repro.figures.verdicts import (
    CAUSES,
    RULE_NAMES,
    RULES,
    VERDICTS,
    Row,
    causes_markdown,
    judge,
    rules_markdown,
)

# The names `repro figure` (repro/commands/figure.py) reaches through this module, beside
# its own pipeline: the verdict rules, the registry, the records and the machine.
__all__ = [
    "CAUSES", "RULES", "RULE_NAMES", "SIZES", "VERDICTS", "Context", "Figure", "Row",
    "causes_markdown", "default_results_root", "estimate_seconds", "experiment_header",
    "extended_set", "figure", "get", "judge", "machine", "progress_line", "publish",
    "read_reference", "read_status", "registered", "results_readme", "rules_markdown",
    "run_figure", "run_figures", "status_line", "write_results_readme",
]


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
    out_dir: Path  # outputs/<id>/ (or <out_root>/<id>/): this run's files
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for ctx.train
    reference_root: Path | None = None
    say: Callable[[str], None] = print
    # Training runs this figure started, and runs it found finished and skipped: a run
    # time only estimates a fresh run when nothing was skipped.
    runs_started: int = 0
    runs_skipped: int = 0

    @property
    def smoke(self) -> bool:
        return self.size == "smoke"

    @property
    def runs_root(self) -> Path:
        """The figure's training runs and scratch files (never published)."""
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
              note: str | None = None, repeat: int = 0) -> list[str]:
        """Training runs through `repro train` (runs already DONE are skipped), grouped
        under this figure's runs/ folder; the run directories in order. The figure owns
        that folder, so a run whose config changed is re-run rather than refused. `note`
        is appended, in parentheses, to each run's status line. `repeat` > 0: the same
        run again, for its timing, under runs/<id>-repeat<repeat>/. W&B is off for
        figure runs (the figure reads metrics.jsonl; an offline W&B run costs seconds a
        run): `-o logger.wandb=true` turns it back on."""
        from repro import launch

        group = self.figure.id if not repeat else f"{self.figure.id}-repeat{repeat}"
        args = [*overrides, f"runs_root={self.runs_root}", f"group={group}",
                "logger.wandb=false", "checkpoint_at_end=false", *self.overrides]
        if self.figure.experiment:
            args.insert(0, f"experiment={self.figure.experiment}")
        return launch.train(args, multirun=multirun, out=self.train_out(note),
                            on_change="restart")

    def train_out(self, note: str | None = None) -> Callable[[str], None]:
        """What a figure passes as `out` to repro.launch.train: each run's status line
        (with `note` appended) and the first line of its summary, through `say`."""

        def out(line: str) -> None:
            if line.startswith(" "):  # a run summary's detail lines: the "done:" line is enough
                return
            if line.startswith("[done, skipped]"):
                self.runs_skipped += 1
            elif line.startswith("["):
                self.runs_started += 1
            self.say(line if note is None or not line.startswith("[") else f"{line} ({note})")

        return out

    def write_csv(self, name: str, rows: Iterable[Mapping[str, Any]]) -> Path:
        """Write data rows (dicts with the same keys) to out_dir/<name>.csv atomically."""
        rows = list(rows)
        path = self.out_dir / f"{name}.csv"
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]

        def write(f) -> None:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)

        write_file(path, write)
        return path

    def save_plot(self, fig, name: str = "figure") -> Path:
        """Save a matplotlib figure as out_dir/<name>.png (title should say what is
        stand-in, projected or CPU-measured) and close it."""
        import matplotlib.pyplot as plt

        path = self.out_dir / f"{name}.png"
        try:
            write_file(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight",
                                                   metadata={"Software": None}), binary=True)
        finally:
            plt.close(fig)
        return path


# -- running -----------------------------------------------------------------------------------


def run_figure(figure_id: str, size: str = "full", out_root: Path | str | None = None,
               overrides: Sequence[str] = (), say: Callable[[str], None] = print,
               results_root: Path | str | None = None, publish_to: Path | str | None = None,
               calibrate: bool = True) -> list[Row]:
    """Run one figure into its outputs folder (`outputs_dir`): its data, plot, comparison
    (beside the published values of results_root, default the published results) and
    status.json. Nothing under the published results is written unless `publish_to` is
    given: then the run is published there (`publish`)."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not allowed; use one of {SIZES}")
    fig = get(figure_id)
    check_size(fig, size)
    out_dir = outputs_dir(fig.id, size, out_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    published = read_status(fig.id, published_root(results_root, size))
    if published is not None and published.get("size") != size:
        published = None
    load_before = load_average()
    calibration = None
    if calibrate:
        from repro.bench import floor_calibration

        calibration = floor_calibration(threads=2)
    busy = busy_reasons(load_before, calibration)
    if busy and fig.kind != "analysis":
        say(f"  warning: this machine is busy ({'; '.join(busy)}): timings are noisier, and "
            "more timed verdicts will be inconclusive")
    ctx = Context(fig, size, out_dir, list(overrides), reference_root=None,
                  say=lambda line: say(f"  {line}"))
    started = time.time()
    rows = fig.produce(ctx)
    elapsed = time.time() - started
    if not rows:
        raise RuntimeError(f"figure {fig.id} produced no comparison rows")
    write_text(out_dir / "comparison.csv", comparison_csv_text(rows, published))
    write_text(out_dir / "comparison.md", comparison_markdown(fig, rows, published, smoke=ctx.smoke))
    run = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": round(elapsed, 1),
           "machine": machine(), "load_before": load_before, "load_after": load_average(),
           "calibration": calibration, "busy": busy, "runs_started": ctx.runs_started,
           "runs_skipped": ctx.runs_skipped}
    status = status_of(fig, size, rows, run)
    write_text(out_dir / "status.json", json.dumps(status, indent=1) + "\n")
    if ctx.smoke:
        say(f"{fig.id}: {SMOKE_VERDICT}: {len(rows)} comparison rows computed at smoke size, "
            f"none a verdict on the paper's claim ({elapsed:.0f} s) -> {out_dir}")
    else:
        say(f"{fig.id}: {status['summary']} ({elapsed:.0f} s) -> {out_dir}")
    if published is not None:
        changes = verdict_changes(rows, published)
        flips = [(r, p) for r, p in changes
                 if {r.verdict, p} == {"holds", "does not hold"}]
        say(f"  vs published ({run_info(published).get('finished', '?')}): "
            f"{len(rows) - len(changes)} of {len(rows)} rows with the same verdict"
            + (f"; {len(flips)} flipped between holds and does not hold" if flips else ""))
        for r, p in changes:
            say(f"    {r.setting} / {r.metric}: published {p}, here "
                f"{shown_verdict(r.verdict, ctx.smoke)} ({value_text(asdict(r))})")
    if publish_to is not None:
        to = published_root(publish_to, size)
        written = publish(fig.id, out_dir, to)
        say(f"  published to {to / fig.id}: "
            + (f"{len(written)} file(s) changed" if written else "nothing changed"))
    return rows


def progress_line(i: int, n: int, figure_id: str, estimate_s: float, elapsed_s: float,
                  remaining_s: float | None = None) -> str:
    """"figure 3/13: sidco-fig16 (estimated 70 s, 212 s elapsed, about 300 s to go)"."""
    text = f"figure {i}/{n}: {figure_id} (estimated {estimate_s:.0f} s, {elapsed_s:.0f} s elapsed"
    if remaining_s is not None:
        text += f", about {remaining_s:.0f} s to go"
    return text + ")"


def run_figures(ids: Sequence[str], size: str = "full", out_root: Path | str | None = None,
                overrides: Sequence[str] = (), say: Callable[[str], None] = print,
                results_root: Path | str | None = None, publish_to: Path | str | None = None,
                clock: Callable[[], float] = time.time) -> list[str]:
    """Run several figures, one progress line before each; a figure that fails does not
    stop the rest. Returns the ids that failed."""
    for fid in ids:  # before any work: a figure without this size stops the whole set
        check_size(get(fid), size)
    estimates = [estimate_seconds(fid, size, out_root, results_root)[0] for fid in ids]
    started = clock()
    failed = []
    for i, fid in enumerate(ids):
        elapsed = clock() - started
        say(progress_line(i + 1, len(ids), fid, estimates[i], elapsed, sum(estimates[i:])))
        try:
            run_figure(fid, size=size, out_root=out_root, overrides=overrides, say=say,
                       results_root=results_root, publish_to=publish_to)
        except Exception as exc:  # noqa: BLE001 (one broken figure must not stop the rest)
            say(f"{fid}: FAILED: {type(exc).__name__}: {exc}")
            failed.append(fid)
    say(f"{len(ids) - len(failed)} of {len(ids)} figure(s) done in {clock() - started:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    return failed


# -- experiment headers ---------------------------------------------------------------------


def experiment_path(name: str) -> Path:
    from repro.config import conf_dir

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

