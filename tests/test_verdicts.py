"""The verdict rule table (repro/figures/base.py RULES, decide, judge), the interval rule
for timed quantities, and the pieces the figures time with (repro.bench.interleaved, the
Spread helpers of repro/figures/common.py). Fast: no figure runs here."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from repro import bench, figures
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
                       interval=(0.7, 0.95), threshold=1.0)
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
                    timed=True)
    assert row.verdict == "does not hold"


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
