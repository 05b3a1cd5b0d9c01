"""The verdict rule table (repro/figures/base.py RULES, decide, judge), the interval rule
for timed quantities, and the pieces the figures time with (repro.bench.interleaved, the
Spread helpers of repro/figures/common.py). Fast: no figure runs here."""

from __future__ import annotations

import ast
import csv
import io
from pathlib import Path

import numpy as np
import pytest

from repro import bench, figures
from repro.cli import main
from repro.figures import base
from repro.figures.common import (
    Spread,
    claim_row,
    highest,
    lowest,
    paired,
    step_ratio,
)

# -- the table ---------------------------------------------------------------------------------


def test_the_table_holds_every_rule_the_figures_need():
    names = {r.name for r in base.RULES}
    assert {"unknown input", "stand-in", "too few steps", "CPU vs GPU", "projected vs measured",
            "not run", "no value", "within noise", "checked"} == names
    assert base.rule("within noise").verdict == "inconclusive"
    assert "inconclusive" in base.VERDICTS
    assert all(r.when for r in base.RULES)


@pytest.mark.parametrize("name", base.NOT_COMPARABLE_RULES)
def test_each_not_comparable_rule_gives_not_comparable_and_wins_over_the_data(name):
    for holds in (True, False, None):
        for timed in (True, False):
            assert base.decide(holds, rule_name=name, timed=timed) == ("not comparable", name)


def test_data_rules():
    assert base.decide(True) == ("holds", "checked")
    assert base.decide(False) == ("does not hold", "checked")
    assert base.decide(None) == ("not comparable", "no value")
    assert base.decide(None, timed=True) == ("inconclusive", "within noise")
    assert base.decide(True, timed=True) == ("holds", "checked")
    with pytest.raises(ValueError, match="not-comparable rule"):
        base.decide(True, rule_name="within noise")
    with pytest.raises(ValueError, match="unknown verdict rule"):
        base.rule("because I say so")


def test_a_row_must_carry_the_verdict_its_rule_gives():
    base.Row("s", "m", 1.0, 2.0, "holds", "r", rule="checked")
    base.Row("s", "m", 1.0, 2.0, "not comparable", "r", rule="stand-in")
    base.Row("s", "m", 1.0, 2.0, "inconclusive", "r", rule="within noise")
    with pytest.raises(ValueError, match="does not follow from rule"):
        base.Row("s", "m", 1.0, 2.0, "not comparable", "r")  # default rule: checked
    with pytest.raises(ValueError, match="does not follow from rule"):
        base.Row("s", "m", 1.0, 2.0, "holds", "r", rule="too few steps")
    with pytest.raises(ValueError, match="verdict"):
        base.Row("s", "m", 1.0, 2.0, "maybe", "r")


def test_too_few_steps():
    assert base.too_few_steps(20, 2503) == "too few steps"
    assert base.too_few_steps(None, 100) == "too few steps"
    assert base.too_few_steps(300, 2503) is None


# -- the interval rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("interval, threshold, op, expected", [
    ((1.2, 1.5), 1.0, ">", True), ((0.5, 0.9), 1.0, ">", False), ((0.9, 1.2), 1.0, ">", None),
    ((1.0, 1.2), 1.0, ">", None), ((1.0, 1.2), 1.0, ">=", True), ((0.5, 1.0), 1.0, ">", False),
    ((0.5, 0.9), 1.0, "<", True), ((1.1, 2.0), 1.0, "<", False), ((0.9, 1.1), 1.0, "<", None),
    ((1.0, 1.4), 1.5, "<=", True), ((1.4, 1.6), 1.5, "<=", None), ((1.6, 1.4), 1.5, "<=", None),
    (None, 1.0, ">", None),
])
def test_side_of_an_interval(interval, threshold, op, expected):
    assert base.side(interval, threshold, op) is expected


def test_all_of_and_any_of():
    assert base.all_of([True, True]) is True
    assert base.all_of([True, None]) is None
    assert base.all_of([None, False, True]) is False
    assert base.all_of([]) is None
    assert base.any_of([False, True, None]) is True
    assert base.any_of([False, None]) is None
    assert base.any_of([False, False]) is False


def test_a_timed_claim_holds_only_when_its_interval_is_clear_of_the_threshold():
    clear = base.judge("s", "speed-up", 1.0, 1.4, claim="A is faster than B",
                       interval=(1.2, 1.6), threshold=1.0, unit="×")
    assert (clear.verdict, clear.rule, clear.interval) == ("holds", "checked", (1.2, 1.6))
    below = base.judge("s", "speed-up", 1.0, 0.8, claim="A is faster than B",
                       interval=(0.7, 0.95), threshold=1.0, cause="hardware: a CPU, not a GPU")
    assert below.verdict == "does not hold"
    noisy = base.judge("s", "speed-up", 1.0, 1.17, claim="A is faster than B",
                       interval=(0.9, 9.6), threshold=1.0, unit="×")
    assert (noisy.verdict, noisy.rule) == ("inconclusive", "within noise")
    # The reason names the rule and shows the interval.
    assert noisy.reason.startswith("[rule: within noise]")
    assert "0.9–9.6×" in noisy.reason
    # The median alone would have said "holds": the interval decides.
    assert noisy.reproduced > 1


def test_a_claim_decided_on_several_intervals_is_inconclusive_when_one_is_undecided():
    row = claim_row("sizes", "crossover", None, 2.0**21, base.all_of([True, None]), "c", "",
                    timed=True)
    assert (row.verdict, row.rule) == ("inconclusive", "within noise")
    row = claim_row("sizes", "crossover", None, 2.0**21, base.all_of([True, False]), "c", "",
                    timed=True, cause="hardware: a CPU, not a GPU")
    assert (row.verdict, row.cause) == ("does not hold", "hardware")


def test_no_value_and_named_rules_in_judge():
    missing = base.judge("s", "m", 2.0, None, claim="c", holds=True)
    assert (missing.verdict, missing.rule) == ("not comparable", "no value")
    decided = base.judge("s", "m", 2.0, None, claim="c", holds=True, missing_ok=True)
    assert decided.verdict == "holds"
    nan = base.judge("s", "m", 2.0, float("nan"), claim="c", interval=(1.0, 2.0), threshold=0.5)
    assert nan.rule == "no value" and nan.reproduced is None
    short = base.judge("s", "final accuracy", 0.0, -0.05, claim="c", holds=False,
                       rule_name="too few steps")
    assert (short.verdict, short.rule) == ("not comparable", "too few steps")
    assert short.reason.startswith("[rule: too few steps]")
    assert base.rule("too few steps").when in short.reason


# -- causes: why a row does not hold -------------------------------------------------------------


def test_the_causes_are_few_named_and_described():
    assert base.CAUSE_NAMES == ("hardware", "scale", "suite", "refuted")
    assert all(c.when for c in base.CAUSES)
    assert base.cause_name("hardware: DGC's selection is fused here") == "hardware"
    for bad in ("hardware", "hardware:  ", "weather: it rained", "scale DGC"):
        with pytest.raises(ValueError, match="one of hardware, scale, suite, refuted"):
            base.cause_name(bad)


def test_a_row_that_does_not_hold_is_refused_without_a_cause():
    with pytest.raises(ValueError, match="'VGG-16, CPU' / 'DGC speed-up' does not hold and "
                                         "names no cause"):
        base.judge("VGG-16, CPU", "DGC speed-up", 1.0, 39.0, claim="DGC is slower than Top-k",
                   interval=(31.0, 51.0), threshold=1.0, op="<")
    with pytest.raises(ValueError, match="names no cause"):
        claim_row("s", "m", None, 0.5, False, "c", "")
    with pytest.raises(ValueError, match="names no cause"):
        base.Row("s", "m", 1.0, 2.0, "does not hold", "r")
    with pytest.raises(ValueError, match="only a row that does not hold carries a cause"):
        base.Row("s", "m", 1.0, 2.0, "holds", "r", cause="scale")
    # A misspelt cause fails on every run, also where the claim holds.
    with pytest.raises(ValueError, match="must read"):
        base.judge("s", "m", None, 2.0, claim="c", holds=True, cause="hardwear: a CPU")


def test_the_cause_is_named_in_the_row_and_its_specifics_in_the_reason():
    why = "hardware: DGC's sampling and selection are one fused pass here"
    bad = base.judge("VGG-16, CPU", "DGC speed-up", 1.0, 39.0, claim="DGC is slower than Top-k",
                     interval=(31.0, 51.0), threshold=1.0, op="<", cause=why)
    assert (bad.verdict, bad.rule, bad.cause) == ("does not hold", "checked", "hardware")
    assert why in bad.reason
    # Any other verdict carries no cause, and its reason does not give one.
    for row in (base.judge("s", "m", None, 0.5, claim="c", holds=True, cause=why),
                base.judge("s", "m", None, 1.1, claim="c", interval=(0.9, 1.3), threshold=1.0,
                           cause=why),
                base.judge("s", "m", 1.0, 0.5, claim="c", holds=False,
                           rule_name="too few steps", cause=why)):
        assert row.verdict != "does not hold" and row.cause is None
        assert why not in row.reason


def test_the_comparison_has_a_cause_column(tmp_path):
    fig = base.Figure("x-fig", "sidco", "t", "benchmark", "hw", "claim", {"smoke": 1, "full": 1},
                      lambda ctx: [])
    rows = [base.judge("a", "m", None, 0.5, claim="c", holds=False,
                       cause="refuted: the paper's own setting"),
            base.judge("b", "m", None, 2.0, claim="c", holds=True, cause="scale: small")]
    table = list(csv.DictReader(io.StringIO(base.comparison_csv_text(rows))))
    assert [r["cause"] for r in table] == ["refuted", ""]
    assert [r["verdict"] for r in table] == ["does not hold", "holds"]
    md = base.comparison_markdown(fig, rows).splitlines()
    head = next(line for line in md if line.startswith("| setting"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    first = next(line for line in md if line.startswith("| a |"))
    values = [c.strip() for c in first.strip("|").split("|")]
    assert values[cells.index("cause")] == "refuted"
    assert values[cells.index("verdict")] == "does not hold"
    assert "1 does not hold (1 refuted)" in base.summary_verdict(rows)
    assert base.status_of(fig, "full", rows, {})["causes"] == {"refuted": 1}


def test_repro_figure_rules_lists_the_rules_and_the_causes(capsys):
    assert main(["figure", "--rules"]) == 0
    out = capsys.readouterr().out
    for r in base.RULES:
        assert f"| {r.name} | {r.verdict} | {r.when} |" in out
    for c in base.CAUSES:
        assert f"| {c.name} | {c.when} |" in out
    readme = base.results_readme(Path("/nonexistent"))
    assert base.causes_markdown() in readme and base.rules_markdown() in readme


# -- projected against measured: one rule, applied in judge ------------------------------------------


def test_a_projected_value_against_a_paper_measurement_is_not_comparable():
    # thc-fig4's case: a projected time-to-accuracy speed-up against the paper's measured 1.32×.
    row = base.judge("THC (software PS)", "projected TTA speed-up", 1.32, 0.54, claim="faster",
                     interval=(0.39, 0.71), threshold=1.0, projected=True)
    assert (row.verdict, row.rule, row.cause) == ("not comparable", "projected vs measured", None)
    assert row.paper == 1.32 and row.interval == (0.39, 0.71)
    assert claim_row("s", "m", 5.0, 0.58, False, "c", "", projected=True).rule == \
        "projected vs measured"
    # Without a paper number the projected value is checked on its claim.
    checked = base.judge("s", "projected throughput", None, 0.64, claim="faster",
                         interval=(0.58, 0.70), threshold=1.0, projected=True,
                         cause="scale: a small model")
    assert (checked.verdict, checked.rule) == ("does not hold", "checked")
    # A not-comparable rule before it in the table wins; one after it does not.
    for earlier in ("stand-in", "too few steps", "CPU vs GPU"):
        assert base.judge("s", "m", 22.4, 0.6, claim="c", rule_name=earlier,
                          projected=True).rule == earlier
    # A measured value (on an emulated link) against the paper's number stays checked.
    measured = base.judge("s", "measured throughput", 1.43, 0.8, claim="faster",
                          interval=(0.7, 0.9), threshold=1.0, cause="hardware: a CPU")
    assert measured.rule == "checked"


def test_projected_vs_measured_is_named_only_for_a_projected_value():
    with pytest.raises(ValueError, match="'s' / 'm': rule 'projected vs measured' is for a "
                                         "projected value"):
        base.judge("s", "m", None, 0.6, claim="c", rule_name="projected vs measured")
    row = base.judge("s", "m", None, 0.6, claim="context: the PS's work is not modelled",
                     rule_name="projected vs measured", projected=True)
    assert row.rule == "projected vs measured"


def _text(node: ast.AST) -> str:
    """The literal text of a string argument (an f-string's constant parts)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) for v in node.values)
    return ""


def test_every_figure_call_site_names_a_cause_and_marks_projected_values():
    """Every judge/claim_row call of a paper module that can give a checked verdict passes
    a cause (a call whose rule is a fixed not-comparable one never does not hold), and
    every call whose reproduced value is the cost model's says so (projected=True), so
    that the projected-vs-measured rule applies to it: a projected row is one whose
    metric or claim says "projected" or which the figure marks."""
    folder = Path(figures.__file__).parent
    missing, unmarked = [], []
    for path in sorted(folder.glob("*.py")):
        if path.stem in (*figures.SHARED_MODULES, "__init__"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(
                node.func, "attr", "")
            if name not in ("judge", "claim_row"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            fixed = isinstance(kw.get("rule_name"), ast.Constant)
            if "cause" not in kw and not fixed:
                missing.append(f"{path.name}:{node.lineno}")
            says_projected = any("projected" in _text(a) for a in node.args[:2])
            if says_projected and not (isinstance(kw.get("projected"), ast.Constant)
                                       and kw["projected"].value is True):
                unmarked.append(f"{path.name}:{node.lineno}")
    assert not missing, f"calls without a cause: {missing}"
    assert not unmarked, f"calls of a projected metric without projected=True: {unmarked}"


# -- every figure goes through the table ---------------------------------------------------------


def _calls(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            found.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return found


def test_no_figure_module_picks_a_label_itself():
    """Paper modules build rows through base.judge (or common.claim_row), never Row(...)
    with a label of their own, and never call base.verdict."""
    folder = Path(figures.__file__).parent
    paper_modules = [p for p in folder.glob("*.py")
                     if p.stem not in (*figures.SHARED_MODULES, "__init__")]
    assert len(paper_modules) == 4
    for path in paper_modules:
        calls = _calls(path)
        assert "Row" not in calls and "verdict" not in calls, path.name
        assert calls & {"judge", "claim_row"}, path.name
        assert '"not comparable"' not in path.read_text(), path.name


# -- timing: interleaved rounds and spreads ---------------------------------------------------------


def test_interleaved_rounds_rotate_the_order_and_respect_the_budget():
    calls: list[str] = []

    def sampler(name: str):
        return lambda: (calls.append(name), (0.001,))[1]

    samples, n = bench.interleaved([sampler("A"), sampler("B"), sampler("C")], 3, budget_s=10)
    assert n == 3 and [len(s) for s in samples] == [3, 3, 3]
    # warm-up A B C, then rounds A B C, B C A, C A B
    assert "".join(calls) == "ABC" + "ABC" + "BCA" + "CAB"
    calls.clear()
    _, n = bench.interleaved([sampler("A"), sampler("B")], 50, budget_s=0.01)
    assert n == 10 and len(calls) == 2 + 2 * 10  # 2 × 10 ms budget / 2 ms a round
    assert bench.interleaved([], 5, 1.0) == ([], 0)


def test_spread_and_percentiles():
    med, p10, p90 = bench.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (med, p10, p90) == (3.0, pytest.approx(1.4), pytest.approx(4.6))
    s = Spread.of([1.0, 2.0, 3.0])
    assert s.lo <= s.median <= s.hi and s.n == 3
    r = paired([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])  # round by round: 2, 2, 3
    assert r.median == 2.0 and r.hi == pytest.approx(2.8)
    a, b = Spread(1.0, 0.8, 1.5), Spread(2.0, 0.5, 3.0)
    assert lowest([a, b]) == Spread(1.0, 0.5, 1.5)
    assert highest([a, b]) == Spread(2.0, 0.8, 3.0)
    assert a.map(lambda v: 1 - v) == Spread(0.0, -0.5, pytest.approx(0.2))


def test_step_ratio_is_the_ratio_of_means_with_the_spread_of_single_step_ratios():
    num = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2]
    den = [2.0, 2.1, 1.9, 2.05, 1.95, 2.2]
    r = step_ratio(num, den)
    assert r.median == pytest.approx(sum(num) / sum(den))
    pairs = sorted(a / b for a in num for b in den)
    assert r.lo == pytest.approx(float(np.percentile(pairs, 10)))
    assert r.hi == pytest.approx(float(np.percentile(pairs, 90)))
    assert r.lo < r.median < r.hi
    # A run timed while the machine was twice as slow moves the ratio, and the interval
    # of two runs that overlap in their step times reaches across 1.
    assert step_ratio([1.0, 1.4], [1.2, 1.3]).interval[0] < 1 < step_ratio([1.0, 1.4], [1.2, 1.3]).hi
    with pytest.raises(ValueError, match="positive"):
        step_ratio([1.0], [0.0])
