"""The figure registry, the verdict rules and the pipeline every paper figure goes through.

A figure is a function `produce(ctx) -> list[Row]` registered with `@figure(...)`. It
runs what it needs through the suite's own machinery (`repro.measure`, `repro.bench`,
`ctx.train(...)` for training runs, which skips runs already finished), writes its data
with `ctx.write_csv` and its plot with `ctx.save_plot`, and returns comparison rows made
by `judge`: the paper's value (from results/reference/<paper>.csv via `ctx.reference`),
the reproduced value (with its interval when it is timed) and a verdict that one rule
table (`RULES`) gives, the rule named in the row. A row that does not hold names why, one
of a few causes (`CAUSES`: the paper's hardware, scale or stand-in, a limitation of the
suite, a genuine refutation); `judge` refuses one without.

Where things go. A run writes into the outputs root (`outputs/` of the clone, ignored by
git; `--out` or $GRADCOMP_OUTPUTS elsewhere): `outputs/<id>/` for the full variant,
`outputs/smoke/<id>/` for the smoke variant, the figure's training runs and scratch
files under its `runs/` there. The published reference outputs are results/<id>/
(committed; $GRADCOMP_RESULTS elsewhere): a run reads them to put the published value and
verdict beside its own, and writes them only when asked to publish (`publish`,
`repro figure ID --publish`), then file by file and only where the content changed, so
republishing a bit-identical figure leaves the tree clean.

`run_figure` times the call, writes comparison.csv, comparison.md and status.json (size,
verdict counts, rows, and under "run": the machine, when, how long, the load average and
a timing calibration), and `run_figures` runs a list of figures with one progress line
each ("figure 3/13: sidco-fig16 (estimated 70 s, 212 s elapsed)"), the estimates taken
from recorded run times on this kind of machine (`estimate_seconds`).

Sizes: "full" is the figure as this suite reproduces it on a 2-core CPU; "smoke" is a
tiny variant run by CI (seconds) so the pipeline cannot rot; "long" (training figures
only, the extended set) trains long enough for the convergence claims to be judged on
the stand-ins: at least a tenth of the paper's steps. A long run writes to
outputs/long/<id>/ and publishes to results/long/<id>/.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from repro.durable import write_bytes, write_file, write_text
from repro.runs import fmt

SIZES = ("smoke", "full", "long")
REQUIRED_SIZES = ("smoke", "full")  # every figure has these; "long" only the extended set
VERDICTS = ("holds", "does not hold", "inconclusive", "not comparable")
KINDS = ("benchmark", "training", "analysis")
PAPERS = ("sidco", "dragonn", "deft", "thc")


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent.parent


def default_results_root() -> Path:
    """The published reference outputs: results/ of the clone, or $GRADCOMP_RESULTS."""
    return Path(os.environ.get("GRADCOMP_RESULTS", repo_root() / "results"))


def default_outputs_root() -> Path:
    """Where a run writes: outputs/ of the clone (ignored by git), or $GRADCOMP_OUTPUTS."""
    return Path(os.environ.get("GRADCOMP_OUTPUTS", repo_root() / "outputs"))


def outputs_dir(figure_id: str, size: str, out_root: Path | str | None = None) -> Path:
    """The folder a run of `figure_id` writes to: <out_root>/<id>/ when a root is given,
    else outputs/<id>/ (full), outputs/smoke/<id>/ or outputs/long/<id>/."""
    if out_root is not None:
        return Path(out_root) / figure_id
    root = default_outputs_root()
    return (root if size == "full" else root / size) / figure_id


def published_root(root: Path | str | None, size: str) -> Path:
    """Where the published results of a size live: <root>/ for full (and smoke, which
    only reads the full ones), <root>/long/ for the extended set's long runs."""
    base = Path(root) if root is not None else default_results_root()
    return base / "long" if size == "long" else base


# -- the verdict rules ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One line of the rule table: when it applies, and the label it gives."""

    name: str
    verdict: str  # the label; "holds / does not hold" for the rule that checks the data
    when: str  # the condition, one sentence


CHECKED = "checked"
WITHIN_NOISE = "within noise"
NO_VALUE = "no value"

# Every verdict of every figure comes from this table (through `decide`). The
# not-comparable rules come first: a figure names the one that applies to a row, and it
# wins over the data. Then a missing value; then, for a timed quantity, the noise rule;
# only then is the claim checked on the data.
RULES: tuple[Rule, ...] = (
    Rule("not run", "not comparable",
         "the setting is not run here: it does not fit this machine's memory or the "
         "figure's time budget"),
    Rule("unknown input", "not comparable",
         "the paper does not say which input its number was measured on, so a value "
         "measured here on any input has nothing to match"),
    Rule("stand-in", "not comparable",
         "the size of the paper's number comes from its model, data set or cluster scale "
         "(e.g. a 126.7M-parameter layer on 16 GPUs), and here a much smaller stand-in "
         "runs, so neither the number nor its direction carries over"),
    Rule("too few steps", "not comparable",
         "the claim is about where training ends up (final accuracy, convergence point, "
         "accuracy drop, steps to the paper's target), and the runs here are shorter than "
         "a tenth of the paper's training"),
    Rule("CPU vs GPU", "not comparable",
         "the claim is an absolute time, or a property of the paper's GPU kernels, and "
         "here it is timed on a CPU"),
    Rule("projected vs measured", "not comparable",
         "the paper's number is measured on its testbed, including costs the cost model "
         "leaves out, and here the quantity is projected by the cost model"),
    Rule(NO_VALUE, "not comparable",
         "the run gave no value for the quantity (e.g. no run reached the target)"),
    Rule(WITHIN_NOISE, "inconclusive",
         "the quantity is timed, and its interval (10th–90th percentile of its value "
         "round by round over interleaved rounds, or step by step between two training "
         "runs) reaches across the claim's threshold"),
    Rule(CHECKED, "holds / does not hold",
         "the claim is checked on the data; a timed quantity only when its whole interval "
         "is on one side of the threshold"),
)
RULE_NAMES = tuple(r.name for r in RULES)
NOT_COMPARABLE_RULES = tuple(r.name for r in RULES if r.verdict == "not comparable")

# "too few steps": a run shorter than this fraction of the paper's training.
MIN_STEP_FRACTION = 0.1


# -- why a claim does not hold ----------------------------------------------------------------


@dataclass(frozen=True)
class Cause:
    """Why a row does not hold: one of a few named causes, each row adding its specifics."""

    name: str
    when: str  # one sentence


# Every "does not hold" row names exactly one of these (judge refuses a row without one),
# written "<cause>: <what differs here>", e.g. "hardware: DGC's sampling and selection are
# one fused pass here, two kernels on the paper's V100".
CAUSES: tuple[Cause, ...] = (
    Cause("hardware",
          "the paper's hardware or software differs and the claim rests on it: its GPU "
          "kernels, its CPU and PyTorch version, its network, against this CPU and this "
          "torch (e.g. DGC's sampling and selection are one fused pass here)"),
    Cause("scale",
          "scale or stand-in: the claim rests on what is much smaller here than in the "
          "paper (model, data set or a stand-in for it, workers, steps)"),
    Cause("suite",
          "a limitation of the suite: what its cost model, simulated workers or emulated "
          "link leave out of the paper's system (e.g. the parameter server, waits on a "
          "leader)"),
    Cause("refuted",
          "a genuine refutation: the setting matches what the paper states, and the claim "
          "fails on the data"),
)
CAUSE_NAMES = tuple(c.name for c in CAUSES)


def cause_name(cause: str) -> str:
    """The cause's name in "<cause>: <specifics>", checked: one of CAUSE_NAMES, with the
    specifics written out."""
    name, sep, specifics = cause.partition(":")
    if not sep or name.strip() not in CAUSE_NAMES or not specifics.strip():
        raise ValueError(f"cause {cause!r} must read '<cause>: <what differs here>' with "
                         f"<cause> one of {', '.join(CAUSE_NAMES)} (`repro figure --rules`)")
    return name.strip()


def rule(name: str) -> Rule:
    for r in RULES:
        if r.name == name:
            return r
    raise ValueError(f"unknown verdict rule {name!r}; the rules are: {', '.join(RULE_NAMES)}")


def decide(holds: bool | None = None, *, rule_name: str | None = None,
           timed: bool = False) -> tuple[str, str]:
    """(verdict, rule name) by the rule table, in its order of precedence.

    rule_name: a not-comparable rule the figure finds applies to this row (it wins);
    holds: the claim checked on the data, None when undecided; timed: the claim was
    decided on an interval, so undecided means within noise (else: no value)."""
    if rule_name is not None:
        if rule_name not in NOT_COMPARABLE_RULES:
            raise ValueError(f"rule {rule_name!r} is not a not-comparable rule; choose one of "
                             f"{', '.join(NOT_COMPARABLE_RULES)} (the others follow from data)")
        return "not comparable", rule_name
    if holds is None:
        return ("inconclusive", WITHIN_NOISE) if timed else ("not comparable", NO_VALUE)
    return ("holds" if holds else "does not hold"), CHECKED


def verdict(holds: bool | None) -> str:
    """The verdict of a claim checked on the data (None: no value to check)."""
    return decide(holds)[0]


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
}


def side(interval: tuple[float, float] | None, threshold: float, op: str = ">") -> bool | None:
    """Whether a quantity known to lie in `interval` = (low, high) satisfies `value op
    threshold`: True when the whole interval does, False when none of it does, None
    when the interval reaches across the threshold (within noise)."""
    if op not in _OPS:
        raise ValueError(f"op {op!r}; choose one of {', '.join(_OPS)}")
    if interval is None:
        return None
    lo, hi = interval
    if lo > hi:
        lo, hi = hi, lo
    test = _OPS[op]
    if test(lo, threshold) and test(hi, threshold):
        return True
    if not test(lo, threshold) and not test(hi, threshold):
        return False
    return None


def all_of(states: Iterable[bool | None]) -> bool | None:
    """Every part holds: False when one part does not, True when all do, else None."""
    states = list(states)
    if any(s is False for s in states):
        return False
    return True if states and all(s is True for s in states) else None


def any_of(states: Iterable[bool | None]) -> bool | None:
    """Some part holds: True when one does, False when none can, else None."""
    states = list(states)
    if any(s is True for s in states):
        return True
    return False if all(s is False for s in states) else None


def too_few_steps(steps: int | None, paper_steps: float) -> str | None:
    """The "too few steps" rule's name when a run of `steps` steps is shorter than
    MIN_STEP_FRACTION of the paper's `paper_steps`; None otherwise."""
    if steps is None or steps < MIN_STEP_FRACTION * paper_steps:
        return "too few steps"
    return None


@dataclass(frozen=True)
class Row:
    """One line of a figure's paper-vs-reproduced comparison."""

    setting: str  # e.g. "VGG-16 gradients, δ=0.001"
    metric: str  # e.g. "speed-up over topk"
    paper: float | None  # None when the paper gives no number for this setting
    reproduced: float | None
    verdict: str  # one of VERDICTS, as the rule gives it
    reason: str  # the rule, the claim checked and what differs (CPU vs V100, stand-in, …)
    unit: str = ""
    rule: str = CHECKED  # the RULES entry that gave the verdict
    low: float | None = None  # interval of a timed reproduced value (10th–90th percentile)
    high: float | None = None
    cause: str | None = None  # one of CAUSE_NAMES, on a row that does not hold (only there)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")
        r = rule(self.rule)
        allowed = ("holds", "does not hold") if r.name == CHECKED else (r.verdict,)
        if self.verdict not in allowed:
            raise ValueError(f"verdict {self.verdict!r} does not follow from rule {r.name!r} "
                             f"(it gives {r.verdict}); build rows with judge()")
        if self.verdict == "does not hold" and self.cause not in CAUSE_NAMES:
            raise ValueError(
                f"row {self.setting!r} / {self.metric!r} does not hold and names no cause "
                f"(got {self.cause!r}): pass judge(..., cause='<cause>: <what differs here>') "
                f"with <cause> one of {', '.join(CAUSE_NAMES)}")
        if self.verdict != "does not hold" and self.cause is not None:
            raise ValueError(f"row {self.setting!r} / {self.metric!r} is {self.verdict!r}: "
                             "only a row that does not hold carries a cause")

    @property
    def ratio(self) -> float | None:
        """reproduced / paper, when both exist and the paper value is non-zero."""
        if self.paper in (None, 0) or self.reproduced is None:
            return None
        return self.reproduced / self.paper

    @property
    def interval(self) -> tuple[float, float] | None:
        return None if self.low is None or self.high is None else (self.low, self.high)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def interval_text(interval: tuple[float, float] | None, unit: str = "") -> str:
    if interval is None:
        return ""
    u = unit if unit in ("×", "x", "%") else (f" {unit}" if unit else "")
    return f"{fmt(interval[0], '.3g')}–{fmt(interval[1], '.3g')}{u}"


PROJECTED_VS_MEASURED = "projected vs measured"


def judge(setting: str, metric: str, paper: float | None, reproduced: float | None, *,
          claim: str, holds: bool | None = None,
          interval: tuple[float, float] | None = None, threshold: float | None = None,
          op: str = ">", rule_name: str | None = None, detail: str = "", unit: str = "",
          missing_ok: bool = False, timed: bool = False, cause: str | None = None,
          projected: bool = False) -> Row:
    """A comparison row whose verdict the rule table gives (`decide`).

    claim: what the paper claims, as checked here. Then one of: `rule_name`, a
    not-comparable rule that applies; `interval` (low, high) of a timed value, with
    `threshold` and `op` (the claim holds when value op threshold) or a tri-state
    `holds` already decided on intervals (`side`, `all_of`); or `holds` for an untimed
    claim. `timed`: `holds` was decided on intervals without one interval to show
    (a claim over several sizes), so None means within noise. Without a reproduced value
    the rule is "no value" unless `missing_ok` (the claim was decided without a number,
    e.g. a baseline that never reached the target). detail: what differs from the paper
    (CPU vs GPU, stand-in data, ...).

    cause: why the claim would not hold, "<cause>: <what differs here>" with <cause> one
    of CAUSE_NAMES; a row that does not hold without one is refused (ValueError naming
    the row), and a row with any other verdict drops it.

    projected: the reproduced value is projected by the cost model. Against a paper value
    (a measurement on the paper's testbed) the rule is then "projected vs measured",
    whatever the data say (a not-comparable rule before it in the table still wins);
    without a paper value the claim is checked. The rule can be named only for a
    projected value (for a claim about a cost the cost model leaves out)."""
    if cause is not None:
        cause_name(cause)  # a misspelt cause fails on every run, not only when it is needed
    if rule_name == PROJECTED_VS_MEASURED and not projected:
        raise ValueError(f"row {setting!r} / {metric!r}: rule {PROJECTED_VS_MEASURED!r} is for "
                         "a projected value: pass projected=True (with the paper's value the "
                         "rule then follows)")
    # The rule applies unless a not-comparable rule before it in the table already does.
    before = rule_name is not None and (RULE_NAMES.index(rule_name)
                                        < RULE_NAMES.index(PROJECTED_VS_MEASURED))
    if projected and paper is not None and not before:
        rule_name = PROJECTED_VS_MEASURED
    if not _finite(reproduced):
        reproduced = None
    if interval is not None and not all(_finite(v) for v in interval):
        interval = None
    timed = timed or interval is not None
    if timed and threshold is not None and holds is None:
        holds = side(interval, threshold, op)
    if reproduced is None and not missing_ok and rule_name is None:
        holds, timed = None, False
    v, r = decide(holds, rule_name=rule_name, timed=timed)
    if v == "does not hold" and cause is None:
        raise ValueError(
            f"row {setting!r} / {metric!r} does not hold and names no cause: pass "
            f"cause='<cause>: <what differs here>' with <cause> one of "
            f"{', '.join(CAUSE_NAMES)} (`repro figure --rules`)")
    if r == CHECKED:
        state = "holds here" if holds else f"does NOT hold here ({cause.strip()})"
    elif r == WITHIN_NOISE:
        state = "within noise here"
    elif r == NO_VALUE:
        state = "no value here"
    else:
        state = rule(r).when
    parts = [f"[rule: {r}] claim: {claim}; {state}"]
    if interval is not None:
        bound = "" if threshold is None else f" (threshold {op} {fmt(threshold, '.3g')})"
        parts.append(f"interval {interval_text(interval, unit)}{bound}")
    if detail:
        parts.append(detail)
    low, high = interval if interval is not None else (None, None)
    return Row(setting, metric, paper, reproduced, v, "; ".join(parts), unit, r, low, high,
               cause_name(cause) if v == "does not hold" else None)


# -- the registry -----------------------------------------------------------------------------


@dataclass
class Figure:
    id: str
    paper: str
    title: str
    kind: str  # one of KINDS
    hardware: str  # what the paper ran it on
    expected: str  # the paper's claim, one sentence
    est_seconds: dict[str, float]  # run time on a 2-core CPU when nothing is recorded
    produce: Callable[[Context], list[Row]]
    experiment: str | None = None  # conf/experiment/<name>.yaml when it trains

    def __post_init__(self) -> None:
        if self.paper not in PAPERS:
            raise ValueError(f"figure {self.id!r}: paper {self.paper!r} not in {PAPERS}")
        if self.kind not in KINDS:
            raise ValueError(f"figure {self.id!r}: kind {self.kind!r} not in {KINDS}")
        missing = [s for s in REQUIRED_SIZES if s not in self.est_seconds]
        if missing:
            raise ValueError(f"figure {self.id!r}: est_seconds lacks {missing}")
        unknown = [s for s in self.est_seconds if s not in SIZES]
        if unknown:
            raise ValueError(f"figure {self.id!r}: est_seconds has unknown sizes {unknown}")

    @property
    def sizes(self) -> tuple[str, ...]:
        return tuple(s for s in SIZES if s in self.est_seconds)


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


def extended_set() -> list[str]:
    """The figures with a long variant (`repro figure --extended`)."""
    return [f for f in registered() if "long" in _FIGURES[f].est_seconds]


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


# -- the machine, its load and its timing noise ---------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where a figure ran; `kind` (CPU model, core count, GPU) keys recorded run times."""
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = _cpu_model()
    kind = f"{cpu}, {os.cpu_count()} CPUs" + (f", {cuda}" if cuda else "")
    return {"kind": kind, "cpu": cpu, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cuda": cuda}


def load_average() -> list[float] | None:
    """os.getloadavg(): the 1, 5 and 15 minute load averages (None where unsupported)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# A machine counts as busy when, before a figure starts, the 1-minute load average is at
# least BUSY_LOAD_PER_CPU per CPU, or the one-pass floor's 90th percentile is more than
# BUSY_SPREAD times its 10th.
BUSY_LOAD_PER_CPU = 0.75
BUSY_SPREAD = 1.5


def busy_reasons(load: Sequence[float] | None, calibration: Mapping[str, Any] | None,
                 cpus: int | None = None) -> list[str]:
    """Why this machine looks busy for timing (empty when it does not)."""
    cpus = cpus or os.cpu_count() or 1
    out = []
    if load and load[0] >= BUSY_LOAD_PER_CPU * cpus:
        out.append(f"load average {load[0]:.2f} on {cpus} CPUs")
    if calibration and calibration.get("spread", 1.0) > BUSY_SPREAD:
        out.append(f"the one-pass floor's 90th percentile is {calibration['spread']:.2f}× its "
                   f"10th ({calibration['floor_p10_ms']:.3f}–{calibration['floor_p90_ms']:.3f} ms)")
    return out


# -- comparison files and status ---------------------------------------------------------------


def _value_text(r: Mapping[str, Any]) -> str:
    text = fmt(r.get("reproduced"))
    if r.get("low") is not None and r.get("high") is not None:
        text += f" [{fmt(r['low'], '.3g')}–{fmt(r['high'], '.3g')}]"
    return text


def row_key(r: Mapping[str, Any] | Row) -> tuple[str, str]:
    d = asdict(r) if isinstance(r, Row) else r
    return (d["setting"], d["metric"])


SMOKE_VERDICT = "pipeline check"  # what a smoke-size row shows in place of a verdict


def shown_verdict(verdict: str, smoke: bool) -> str:
    """A row's verdict as the console and comparison.md show it: at smoke size (a tiny
    run that checks the figure's pipeline) a pipeline check, its rule's verdict labelled
    as not comparable with the paper's."""
    return f"{SMOKE_VERDICT} (smoke size, not comparable: {verdict})" if smoke else verdict


def comparison_markdown(fig: Figure, rows: Sequence[Row],
                        published: Mapping[str, Any] | None = None, smoke: bool = False) -> str:
    """comparison.md: one table row per comparison row; with `published` (the published
    status.json) a column with the published value and verdict of the same row. smoke:
    the rows of a smoke-size run, each shown as a pipeline check (`shown_verdict`)."""
    lines = [f"# {fig.id}: {fig.title}", "", f"Paper claim: {fig.expected}", "",
             ("Reproduced values that are timed carry their interval in brackets (10th–90th "
              "percentile round by round over interleaved rounds, or step by step between two "
              "training runs); the rule that gave each verdict is in the rule column, and a "
              "row that does not hold names its cause in the cause column "
              "(`repro figure --rules`)."), ""]
    head = "| setting | metric | paper | reproduced | ratio | verdict |"
    sep = "|---|---|---|---|---|---|"
    pub_rows: dict[tuple[str, str], Mapping[str, Any]] = {}
    if published is not None:
        pub_rows = {row_key(r): r for r in published.get("rows", [])}
        run = published.get("run", published)
        lines.insert(4, f"Published reference: {published.get('size', '?')} run of "
                        f"{run.get('finished', '?')} on {(run.get('machine') or {}).get('kind', '?')}.")
        lines.insert(5, "")
        head += " published |"
        sep += "---|"
    if smoke:
        lines[4:4] = [(f"Smoke size: a {SMOKE_VERDICT} of this figure's code on a tiny run, not "
                       "a reproduction. Its numbers and the rules' verdicts are not comparable "
                       "with the paper's or the published ones; run the full size for those."),
                      ""]
    lines += [head + " rule | cause | reason |", sep + "---|---|---|"]
    for r in rows:
        unit = f" {r.unit}" if r.unit else ""
        cells = [r.setting, f"{r.metric}{unit}", fmt(r.paper), _value_text(asdict(r)),
                 fmt(r.ratio), shown_verdict(r.verdict, smoke)]
        if published is not None:
            p = pub_rows.get(row_key(r))
            cells.append("—" if p is None else f"{_value_text(p)}, {p['verdict']}")
        cells += [r.rule, r.cause or "", r.reason]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def comparison_csv_text(rows: Sequence[Row], published: Mapping[str, Any] | None = None) -> str:
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = ["setting", "metric", "unit", "paper", "reproduced", "low", "high", "ratio",
            "verdict", "rule", "cause", "reason"]
    pub_rows = {row_key(r): r for r in (published or {}).get("rows", [])}
    if published is not None:
        head += ["published_reproduced", "published_verdict"]
    w.writerow(head)
    for r in rows:
        line = [r.setting, r.metric, r.unit, r.paper, r.reproduced, r.low, r.high, r.ratio,
                r.verdict, r.rule, r.cause, r.reason]
        if published is not None:
            p = pub_rows.get(row_key(r))
            line += [None, None] if p is None else [p.get("reproduced"), p.get("verdict")]
        w.writerow(line)
    return buf.getvalue()


def cause_counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows that do not hold name each cause (causes none names left out)."""
    counts = {c: sum(r.cause == c for r in rows) for c in CAUSE_NAMES}
    return {c: n for c, n in counts.items() if n}


def summary_verdict(rows: Sequence[Row]) -> str:
    """One line: the counts (those that do not hold by cause), and the first row that
    does not hold (if any)."""
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    causes = ", ".join(f"{n} {c}" for c, n in cause_counts(rows).items())
    text = ", ".join(f"{n} {v}" + (f" ({causes})" if v == "does not hold" else "")
                     for v, n in counts.items() if n)
    bad = [r for r in rows if r.verdict == "does not hold"]
    if bad:
        text += f"; e.g. does not hold: {bad[0].setting}, {bad[0].metric}"
    return text or "no comparison rows"


def verdict_changes(rows: Sequence[Row], published: Mapping[str, Any] | None
                    ) -> list[tuple[Row, str]]:
    """The rows whose verdict differs from the published one: (row, published verdict)."""
    if not published:
        return []
    pub = {row_key(r): r["verdict"] for r in published.get("rows", [])}
    return [(r, pub[row_key(r)]) for r in rows
            if row_key(r) in pub and pub[row_key(r)] != r.verdict]


def _content(status: Mapping[str, Any]) -> dict[str, Any]:
    """A status.json without its "run" section (when, how long, which machine, load)."""
    return {k: v for k, v in status.items() if k != "run"}


def status_of(fig: Figure, size: str, rows: Sequence[Row], run: Mapping[str, Any]
              ) -> dict[str, Any]:
    return {"id": fig.id, "size": size,
            "verdicts": {v: sum(r.verdict == v for r in rows) for v in VERDICTS},
            "causes": cause_counts(rows),
            "summary": summary_verdict(rows), "rows": [asdict(r) for r in rows],
            "run": dict(run)}


def read_status(figure_id: str, root: Path | None = None,
                folder: Path | None = None) -> dict[str, Any] | None:
    """<root>/<id>/status.json (root: the published results), or folder/status.json."""
    path = (folder if folder is not None else (root or default_results_root()) / figure_id) \
        / "status.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def run_info(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The "run" section of a status.json (older files keep its keys at the top level)."""
    if not status:
        return {}
    return dict(status.get("run") or status)


def status_line(figure_id: str, root: Path | None = None) -> str:
    st = read_status(figure_id, root)
    if st is None:
        return "not run"
    run = run_info(st)
    return f"{st['size']} run {run.get('finished', '?')} ({run.get('elapsed_s', 0):.0f} s)"


# -- publishing -----------------------------------------------------------------------------

RENDERED = ("comparison.csv", "comparison.md", "status.json")


def _product_files(folder: Path) -> list[Path]:
    """A run's files that a publication copies: its top-level data and plots (runs/,
    hidden and temporary files and the rendered comparison/status stay behind)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in RENDERED
                  and not p.name.endswith(".tmp"))


def _write_if_changed(path: Path, data: bytes) -> bool:
    if path.exists() and path.read_bytes() == data:
        return False
    write_bytes(path, data)
    return True


def publish(figure_id: str, from_dir: Path, results_root: Path | None = None) -> list[Path]:
    """Copy a finished run of `figure_id` (its folder `from_dir`) into the published
    results <results_root>/<id>/: the data and plots, comparison.csv/.md without the
    published-value column, status.json. Each file is written only when its bytes
    differ, and status.json only when a product or the comparison changed (its "run"
    section alone, i.e. when and how long, does not count); files the run no longer makes
    are removed. Returns the paths written or removed."""
    fig = get(figure_id)
    status = read_status(figure_id, folder=from_dir)
    if status is None:
        raise FileNotFoundError(f"{from_dir} holds no status.json: run the figure first")
    rows = [Row(**{k: v for k, v in r.items() if k in Row.__dataclass_fields__})
            for r in status["rows"]]
    dest = (results_root or default_results_root()) / figure_id
    dest.mkdir(parents=True, exist_ok=True)
    changed: list[Path] = []
    products = _product_files(from_dir)
    for src in products:
        if _write_if_changed(dest / src.name, src.read_bytes()):
            changed.append(dest / src.name)
    keep = {p.name for p in products} | set(RENDERED)
    for old in _product_files(dest):
        if old.name not in keep:
            old.unlink()
            changed.append(old)
    for name, text in (("comparison.csv", comparison_csv_text(rows)),
                       ("comparison.md", comparison_markdown(fig, rows))):
        if _write_if_changed(dest / name, text.encode()):
            changed.append(dest / name)
    old_status = read_status(figure_id, folder=dest)
    if changed or old_status is None or _content(old_status) != _content(status):
        write_text(dest / "status.json", json.dumps(status, indent=1) + "\n")
        changed.append(dest / "status.json")
    return changed


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
                f"{shown_verdict(r.verdict, ctx.smoke)} ({_value_text(asdict(r))})")
    if publish_to is not None:
        to = published_root(publish_to, size)
        written = publish(fig.id, out_dir, to)
        say(f"  published to {to / fig.id}: "
            + (f"{len(written)} file(s) changed" if written else "nothing changed"))
    return rows


def check_size(fig: Figure, size: str) -> None:
    """Refuse a size the figure has no variant of, naming those it has."""
    if size not in fig.est_seconds:
        raise ValueError(
            f"figure {fig.id} has no {size} variant (it has: {', '.join(fig.sizes)}); "
            f"the figures with a long variant (the extended set): {', '.join(extended_set())}")


def estimate_seconds(figure_id: str, size: str, out_root: Path | str | None = None,
                     results_root: Path | str | None = None,
                     kind: str | None = None) -> tuple[float, str]:
    """(seconds, where from) a fresh run of the figure is expected to take: the last
    run recorded on this kind of machine (this clone's outputs, then the published
    results), else the last published run on any machine, else the figure's built-in
    estimate. A record whose run skipped finished training runs does not count."""
    fig = get(figure_id)
    if kind is None:
        kind = _machine_kind()
    candidates = []
    mine = read_status(figure_id, folder=outputs_dir(figure_id, size, out_root))
    pub = read_status(figure_id, published_root(results_root, size))
    for where, st in (("this machine's last run", mine), ("published run", pub)):
        info = run_info(st)
        # Older records do not say whether training runs were skipped: trust them only
        # for figures that train nothing.
        fresh = info.get("runs_skipped") == 0 or ("runs_skipped" not in info
                                                   and fig.kind != "training")
        if st and st.get("size") == size and info.get("elapsed_s") is not None and fresh:
            candidates.append((where, st))
    for where, st in candidates:
        if (run_info(st).get("machine") or {}).get("kind") == kind:
            return float(run_info(st)["elapsed_s"]), f"{where}, same machine kind"
    for where, st in candidates:
        return float(run_info(st)["elapsed_s"]), f"{where}, another machine"
    return float(fig.est_seconds[size]), "built-in estimate"


_KIND: str | None = None


def _machine_kind() -> str:
    global _KIND
    if _KIND is None:
        cuda = None
        try:
            import torch

            cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        except ImportError:
            pass
        _KIND = f"{_cpu_model()}, {os.cpu_count()} CPUs" + (f", {cuda}" if cuda else "")
    return _KIND


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
        except Exception as exc:  # one broken figure must not stop the rest of the set
            say(f"{fid}: FAILED: {type(exc).__name__}: {exc}")
            failed.append(fid)
    say(f"{len(ids) - len(failed)} of {len(ids)} figure(s) done in {clock() - started:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    return failed


# -- experiment headers and the results README ---------------------------------------------------


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


def rules_markdown() -> str:
    """The rule table as markdown (results/README.md, `repro figure --rules`)."""
    lines = ["| rule | verdict | when |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.verdict} | {r.when} |" for r in RULES]
    return "\n".join(lines)


def causes_markdown() -> str:
    """The causes a row that does not hold names, as markdown (results/README.md,
    `repro figure --rules`)."""
    lines = ["| cause | when |", "|---|---|"]
    lines += [f"| {c.name} | {c.when} |" for c in CAUSES]
    return "\n".join(lines)


def results_readme(root: Path | None = None) -> str:
    """results/README.md: every registered figure, its status and one-line verdict."""
    lines = [
        "# Results",
        "",
        "Generated by `repro figure --readme` (and by `repro figure ID --publish`) from each",
        "figure's status.json: do not edit.",
        "",
        "Each figure's folder holds its data (CSV), plot (PNG), comparison.csv/.md (paper",
        "value, reproduced value with its interval when timed, ratio, verdict, the rule that",
        "gave it, the cause of a row that does not hold, reason) and status.json. The papers'",
        "values are in reference/<paper>.csv (source: text, table or plot-estimate).",
        "Machine-specific micro-benchmarks are in bench/.",
        "",
        "Verdicts follow one rule table, in this order of precedence:",
        "",
        rules_markdown(),
        "",
        "Every row that does not hold names one cause, its specifics in the row's reason:",
        "",
        causes_markdown(),
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
    long_root = published_root(root, "long")
    lines += [
        "",
        "## The extended set (long training runs)",
        "",
        "`scripts/repro_figure.sh --set extended` runs the training figures' long variants,",
        "long enough (at least a tenth of the paper's steps) for the convergence claims to be",
        "judged on the stand-ins; published in long/<figure>/.",
        "",
        "| figure | status | verdict |",
        "|---|---|---|",
    ]
    for fid in extended_set():
        st = read_status(fid, long_root)
        lines.append(f"| [{fid}](long/{fid}/comparison.md) | {status_line(fid, long_root)} | "
                     f"{st['summary'] if st else '—'} |")
    return "\n".join(lines) + "\n"


def write_results_readme(root: Path | None = None) -> Path:
    """Regenerate <root>/README.md (the published results), only when its text changes."""
    root = root or default_results_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / "README.md"
    _write_if_changed(path, results_readme(root).encode())
    return path

