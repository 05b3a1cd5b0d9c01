"""The verdict rules: one table (`RULES`) gives every verdict of every figure.

A figure builds each comparison row with `judge`: the paper's value, the reproduced value
(with its interval when it is timed) and the claim, checked on the data or found not
comparable by a named rule. The rules apply in the table's order of precedence: a
not-comparable rule the figure names (the setting is not run, the paper's input is
unknown, a stand-in, too few steps, CPU vs GPU), a projected value against the paper's
measurement, no value, then for a timed quantity the noise rule (its 10th–90th percentile
interval reaches across the claim's threshold), and only then the claim checked on the
data. A row that does not hold names why, one of a few causes (`CAUSES`: the paper's
hardware, scale or stand-in, a limitation of the suite, a genuine refutation); `judge`
refuses one without. `Row` refuses a verdict its rule does not give, so no figure can
pick a label itself. `repro figure --rules` prints the two tables (`rules_markdown`,
`causes_markdown`), as results/README.md does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from repro.runs import fmt

VERDICTS = ("holds", "does not hold", "inconclusive", "not comparable")

@dataclass(frozen=True)
class Rule:
    """One line of the rule table: when it applies, and the label it gives."""

    name: str
    verdict: str  # the label; "holds / does not hold" for the rule that checks the data
    when: str  # the condition, one sentence


CHECKED = "checked"
WITHIN_NOISE = "within noise"
NO_VALUE = "no value"
PROJECTED_VS_MEASURED = "projected vs measured"

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
    Rule(PROJECTED_VS_MEASURED, "not comparable",
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


# -- deciding a row ------------------------------------------------------------------------------


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
