"""The verdict rules (repro/figures/verdicts.py: RULES, decide, judge): the table in its
order of precedence, one case per rule where it applies and one where it just does not,
the interval rule for timed quantities, the causes of a row that does not hold, that every
figure goes through the table, and the intervals the noise rule reads (repro.bench's
interleaved rounds, the Spread helpers of repro/figures/common.py). Fast: no figure runs
here."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from repro import bench, figures
from repro.cli import main
from repro.figures import records, verdicts
from repro.figures.common import (
    Spread,
    claim_row,
    highest,
    lowest,
    paired,
    step_ratio,
)

# -- the table ---------------------------------------------------------------------------------


def test_the_table_holds_every_rule_in_its_order_of_precedence_with_its_label():
    """The order is the precedence (a rule wins over every rule after it) and the label is
    the verdict: changing either changes published verdicts."""
    assert [(r.name, r.verdict) for r in verdicts.RULES] == [
        ("not run", "not comparable"),
        ("unknown input", "not comparable"),
        ("stand-in", "not comparable"),
        ("too few steps", "not comparable"),
        ("CPU vs GPU", "not comparable"),
        ("projected vs measured", "not comparable"),
        ("no value", "not comparable"),
        ("within noise", "inconclusive"),
        ("checked", "holds / does not hold"),
    ]
    assert verdicts.RULE_NAMES == tuple(r.name for r in verdicts.RULES)
    assert verdicts.VERDICTS == ("holds", "does not hold", "inconclusive", "not comparable")
    assert verdicts.MIN_STEP_FRACTION == 0.1
    assert all(r.when for r in verdicts.RULES)


@pytest.mark.parametrize("name", verdicts.NOT_COMPARABLE_RULES)
def test_each_not_comparable_rule_gives_not_comparable_and_wins_over_the_data(name):
    for holds in (True, False, None):
        for timed in (True, False):
            assert verdicts.decide(holds, rule_name=name, timed=timed) == ("not comparable", name)


def test_data_rules():
    assert verdicts.decide(True) == ("holds", "checked")
    assert verdicts.decide(False) == ("does not hold", "checked")
    assert verdicts.decide(None) == ("not comparable", "no value")
    assert verdicts.decide(None, timed=True) == ("inconclusive", "within noise")
    assert verdicts.decide(True, timed=True) == ("holds", "checked")
    with pytest.raises(ValueError, match="not-comparable rule"):
        verdicts.decide(True, rule_name="within noise")
    with pytest.raises(ValueError, match="unknown verdict rule"):
        verdicts.rule("because I say so")


def test_a_row_must_carry_the_verdict_its_rule_gives():
    verdicts.Row("s", "m", 1.0, 2.0, "holds", "r", rule="checked")
    verdicts.Row("s", "m", 1.0, 2.0, "not comparable", "r", rule="stand-in")
    verdicts.Row("s", "m", 1.0, 2.0, "inconclusive", "r", rule="within noise")
    with pytest.raises(ValueError, match="does not follow from rule"):
        verdicts.Row("s", "m", 1.0, 2.0, "not comparable", "r")  # default rule: checked
    with pytest.raises(ValueError, match="does not follow from rule"):
        verdicts.Row("s", "m", 1.0, 2.0, "holds", "r", rule="too few steps")
    with pytest.raises(ValueError, match="verdict"):
        verdicts.Row("s", "m", 1.0, 2.0, "maybe", "r")


def test_too_few_steps():
    assert verdicts.too_few_steps(20, 2503) == "too few steps"
    assert verdicts.too_few_steps(None, 100) == "too few steps"
    assert verdicts.too_few_steps(300, 2503) is None


def test_row_ratio_and_verdict_validation():
    r = verdicts.Row("s", "m", 2.0, 3.0, "holds", "because")
    assert r.ratio == pytest.approx(1.5)
    assert verdicts.Row("s", "m", None, 3.0, "not comparable", "x", rule="stand-in").ratio is None
    with pytest.raises(ValueError, match="verdict"):
        verdicts.Row("s", "m", 1.0, 1.0, "maybe", "x")
    assert verdicts.verdict(True) == "holds" and verdicts.verdict(False) == "does not hold"
    assert verdicts.verdict(None) == "not comparable"


# -- each rule's decision: where it applies, and where it just does not ------------------------------

WHY = "refuted: the setting is the paper's"
NAN, INF = float("nan"), float("inf")
NC = "not comparable"
CLEAR = {"interval": (1.2, 1.6), "threshold": 1.0}  # a timed value clear above its threshold
BELOW = {"interval": (0.5, 0.9), "threshold": 1.0}  # ... and clear below it


def case(tested: str, applies: bool, what: str, verdict: str, given: str, /, **judged):
    """One row through judge (paper 1.0 and reproduced 1.5 unless `judged` says otherwise):
    the rule `tested` applies to it or just does not; it gets `verdict` by the rule `given`."""
    return pytest.param(tested, applies, judged, verdict, given,
                        id=f"{tested}: {'applies' if applies else 'near miss'}, {what}")


# Each rule where it applies, winning over what the data or a later rule would say, and a
# near miss: the same row just outside the rule, decided by another.
RULE_CASES = [
    case("not run", True, "data that hold", NC, "not run", rule_name="not run", holds=True),
    case("not run", True, "no value", NC, "not run", rule_name="not run", reproduced=None),
    case("not run", False, "data that hold", "holds", "checked", holds=True),
    case("unknown input", True, "a clear interval", NC, "unknown input",
         rule_name="unknown input", **CLEAR),
    case("unknown input", True, "a projected value", NC, "unknown input",
         rule_name="unknown input", projected=True),
    case("unknown input", False, "a clear interval", "holds", "checked", **CLEAR),
    case("stand-in", True, "data that do not hold", NC, "stand-in", rule_name="stand-in",
         holds=False, cause=WHY),
    case("stand-in", True, "a projected value", NC, "stand-in", rule_name="stand-in",
         projected=True),
    case("stand-in", False, "data that do not hold", "does not hold", "checked", holds=False,
         cause=WHY),
    # Shorter than a tenth of the paper's steps (249 of 2500), or of unknown length.
    case("too few steps", True, "249 of 2500 steps", NC, "too few steps",
         rule_name=verdicts.too_few_steps(249, 2500), holds=True),
    case("too few steps", True, "unknown steps", NC, "too few steps",
         rule_name=verdicts.too_few_steps(None, 2500), holds=True),
    case("too few steps", True, "a projected value", NC, "too few steps",
         rule_name="too few steps", projected=True),
    case("too few steps", False, "250 of 2500 steps", "holds", "checked",
         rule_name=verdicts.too_few_steps(250, 2500), holds=True),
    case("CPU vs GPU", True, "an interval below", NC, "CPU vs GPU", rule_name="CPU vs GPU",
         cause=WHY, **BELOW),
    case("CPU vs GPU", True, "a projected value", NC, "CPU vs GPU", rule_name="CPU vs GPU",
         projected=True),
    case("CPU vs GPU", False, "an interval below", "does not hold", "checked", cause=WHY,
         **BELOW),
    # A projected value against the paper's measurement, whatever the data say.
    case("projected vs measured", True, "a clear interval", NC, "projected vs measured",
         projected=True, **CLEAR),
    case("projected vs measured", True, "no value", NC, "projected vs measured",
         projected=True, reproduced=None),
    case("projected vs measured", True, "a later rule named", NC, "projected vs measured",
         projected=True, rule_name="no value"),
    case("projected vs measured", True, "named without a paper value", NC,
         "projected vs measured", projected=True, paper=None, rule_name="projected vs measured"),
    case("projected vs measured", False, "no paper value", "holds", "checked", projected=True,
         paper=None, **CLEAR),
    case("projected vs measured", False, "a measured value", "holds", "checked", **CLEAR),
    case("no value", True, "none", NC, "no value", reproduced=None, holds=True),
    case("no value", True, "NaN", NC, "no value", reproduced=NAN, **CLEAR),
    case("no value", True, "infinite", NC, "no value", reproduced=INF, holds=False, cause=WHY),
    case("no value", True, "undecided, untimed", NC, "no value", holds=None),
    case("no value", True, "a NaN interval", NC, "no value", interval=(NAN, 1.6),
         threshold=1.0),
    case("no value", False, "decided without one", "holds", "checked", reproduced=None,
         holds=True, missing_ok=True),
    # A timed quantity whose interval reaches across the claim's threshold.
    case("within noise", True, "across", "inconclusive", "within noise", interval=(0.9, 1.2),
         threshold=1.0),
    case("within noise", True, "touching a strict threshold", "inconclusive", "within noise",
         interval=(1.0, 1.2), threshold=1.0, op=">"),
    case("within noise", True, "undecided on intervals", "inconclusive", "within noise",
         holds=None, timed=True),
    case("within noise", True, "undecided, decided without a value", "inconclusive",
         "within noise", reproduced=None, holds=None, timed=True, missing_ok=True),
    case("within noise", False, "touching an inclusive threshold", "holds", "checked",
         interval=(1.0, 1.2), threshold=1.0, op=">="),
    case("within noise", False, "undecided without a value", NC, "no value", reproduced=None,
         holds=None, timed=True),
    case("checked", True, "holds", "holds", "checked", holds=True),
    case("checked", True, "does not hold", "does not hold", "checked", holds=False, cause=WHY),
    case("checked", True, "holds on intervals", "holds", "checked", holds=True, timed=True),
    case("checked", True, "an interval below, claim <", "holds", "checked", op="<", **BELOW),
    case("checked", True, "an interval below, claim >", "does not hold", "checked", cause=WHY,
         **BELOW),
    case("checked", False, "an interval across", "inconclusive", "within noise",
         interval=(0.5, 1.1), threshold=1.0, op="<"),
]


@pytest.mark.parametrize("name, applies, judged, expected_verdict, expected_rule", RULE_CASES)
def test_each_rule_gives_its_decision(name, applies, judged, expected_verdict, expected_rule):
    args = {"paper": 1.0, "reproduced": 1.5, **judged}
    row = verdicts.judge("s", "m", args.pop("paper"), args.pop("reproduced"), claim="c", **args)
    assert (row.verdict, row.rule) == (expected_verdict, expected_rule)
    assert (expected_rule == name) is applies
    assert row.reason.startswith(f"[rule: {expected_rule}] claim: c; ")
    assert (row.cause is not None) is (row.verdict == "does not hold")
    if row.rule in verdicts.NOT_COMPARABLE_RULES and row.rule != "no value":
        assert verdicts.rule(row.rule).when in row.reason


def test_every_rule_has_cases_where_it_applies_and_where_it_just_does_not():
    """A rule added to the table, or one whose cases are dropped, fails here."""
    applying = {c.values[0] for c in RULE_CASES if c.values[1]}
    near_misses = {c.values[0] for c in RULE_CASES if not c.values[1]}
    assert applying == near_misses == set(verdicts.RULE_NAMES)


# -- the interval rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("interval, threshold, op, expected", [
    ((1.2, 1.5), 1.0, ">", True), ((0.5, 0.9), 1.0, ">", False), ((0.9, 1.2), 1.0, ">", None),
    ((1.0, 1.2), 1.0, ">", None), ((1.0, 1.2), 1.0, ">=", True), ((0.5, 1.0), 1.0, ">", False),
    ((0.5, 0.9), 1.0, "<", True), ((1.1, 2.0), 1.0, "<", False), ((0.9, 1.1), 1.0, "<", None),
    ((1.0, 1.4), 1.5, "<=", True), ((1.4, 1.6), 1.5, "<=", None), ((1.6, 1.4), 1.5, "<=", None),
    (None, 1.0, ">", None),
])
def test_side_of_an_interval(interval, threshold, op, expected):
    assert verdicts.side(interval, threshold, op) is expected


def test_all_of_and_any_of():
    assert verdicts.all_of([True, True]) is True
    assert verdicts.all_of([True, None]) is None
    assert verdicts.all_of([None, False, True]) is False
    assert verdicts.all_of([]) is None
    assert verdicts.any_of([False, True, None]) is True
    assert verdicts.any_of([False, None]) is None
    assert verdicts.any_of([False, False]) is False


def test_a_timed_claim_holds_only_when_its_interval_is_clear_of_the_threshold():
    clear = verdicts.judge("s", "speed-up", 1.0, 1.4, claim="A is faster than B",
                       interval=(1.2, 1.6), threshold=1.0, unit="×")
    assert (clear.verdict, clear.rule, clear.interval) == ("holds", "checked", (1.2, 1.6))
    below = verdicts.judge("s", "speed-up", 1.0, 0.8, claim="A is faster than B",
                       interval=(0.7, 0.95), threshold=1.0, cause="hardware: a CPU, not a GPU")
    assert below.verdict == "does not hold"
    noisy = verdicts.judge("s", "speed-up", 1.0, 1.17, claim="A is faster than B",
                       interval=(0.9, 9.6), threshold=1.0, unit="×")
    assert (noisy.verdict, noisy.rule) == ("inconclusive", "within noise")
    # The reason names the rule and shows the interval.
    assert noisy.reason.startswith("[rule: within noise]")
    assert "0.9–9.6×" in noisy.reason
    # The median alone would have said "holds": the interval decides.
    assert noisy.reproduced > 1


def test_claim_rows_compute_their_verdicts():
    assert claim_row("s", "m", 1.0, 2.0, True, "c", "x").verdict == "holds"
    assert claim_row("s", "m", 1.0, 0.5, False, "c", "x",
                     cause="scale: a small model").verdict == "does not hold"
    missing = claim_row("s", "m", 1.0, None, True, "c", "x")
    assert missing.verdict == "not comparable" and missing.reproduced is None
    assert claim_row("s", "m", 1.0, None, True, "c", "x", missing_ok=True).verdict == "holds"
    assert "does NOT hold" in claim_row("s", "m", 1.0, 0.5, False, "c", "x",
                                        cause="scale: a small model").reason


def test_a_claim_decided_on_several_intervals_is_inconclusive_when_one_is_undecided():
    row = claim_row("sizes", "crossover", None, 2.0**21, verdicts.all_of([True, None]), "c", "",
                    timed=True)
    assert (row.verdict, row.rule) == ("inconclusive", "within noise")
    row = claim_row("sizes", "crossover", None, 2.0**21, verdicts.all_of([True, False]), "c", "",
                    timed=True, cause="hardware: a CPU, not a GPU")
    assert (row.verdict, row.cause) == ("does not hold", "hardware")


def test_no_value_and_named_rules_in_judge():
    missing = verdicts.judge("s", "m", 2.0, None, claim="c", holds=True)
    assert (missing.verdict, missing.rule) == ("not comparable", "no value")
    decided = verdicts.judge("s", "m", 2.0, None, claim="c", holds=True, missing_ok=True)
    assert decided.verdict == "holds"
    nan = verdicts.judge("s", "m", 2.0, float("nan"), claim="c", interval=(1.0, 2.0), threshold=0.5)
    assert nan.rule == "no value" and nan.reproduced is None
    short = verdicts.judge("s", "final accuracy", 0.0, -0.05, claim="c", holds=False,
                       rule_name="too few steps")
    assert (short.verdict, short.rule) == ("not comparable", "too few steps")
    assert short.reason.startswith("[rule: too few steps]")
    assert verdicts.rule("too few steps").when in short.reason


# -- causes: why a row does not hold -------------------------------------------------------------


def test_the_causes_are_few_named_and_described():
    assert verdicts.CAUSE_NAMES == ("hardware", "scale", "suite", "refuted")
    assert all(c.when for c in verdicts.CAUSES)
    assert verdicts.cause_name("hardware: DGC's selection is fused here") == "hardware"
    for bad in ("hardware", "hardware:  ", "weather: it rained", "scale DGC"):
        with pytest.raises(ValueError, match="one of hardware, scale, suite, refuted"):
            verdicts.cause_name(bad)


def test_a_row_that_does_not_hold_is_refused_without_a_cause():
    with pytest.raises(ValueError, match="'VGG-16, CPU' / 'DGC speed-up' does not hold and "
                                         "names no cause"):
        verdicts.judge("VGG-16, CPU", "DGC speed-up", 1.0, 39.0, claim="DGC is slower than Top-k",
                   interval=(31.0, 51.0), threshold=1.0, op="<")
    with pytest.raises(ValueError, match="names no cause"):
        claim_row("s", "m", None, 0.5, False, "c", "")
    with pytest.raises(ValueError, match="names no cause"):
        verdicts.Row("s", "m", 1.0, 2.0, "does not hold", "r")
    with pytest.raises(ValueError, match="only a row that does not hold carries a cause"):
        verdicts.Row("s", "m", 1.0, 2.0, "holds", "r", cause="scale")
    # A misspelt cause fails on every run, also where the claim holds.
    with pytest.raises(ValueError, match="must read"):
        verdicts.judge("s", "m", None, 2.0, claim="c", holds=True, cause="hardwear: a CPU")


def test_the_cause_is_named_in_the_row_and_its_specifics_in_the_reason():
    why = "hardware: DGC's sampling and selection are one fused pass here"
    bad = verdicts.judge("VGG-16, CPU", "DGC speed-up", 1.0, 39.0, claim="DGC is slower than Top-k",
                     interval=(31.0, 51.0), threshold=1.0, op="<", cause=why)
    assert (bad.verdict, bad.rule, bad.cause) == ("does not hold", "checked", "hardware")
    assert why in bad.reason
    # Any other verdict carries no cause, and its reason does not give one.
    for row in (verdicts.judge("s", "m", None, 0.5, claim="c", holds=True, cause=why),
                verdicts.judge("s", "m", None, 1.1, claim="c", interval=(0.9, 1.3), threshold=1.0,
                           cause=why),
                verdicts.judge("s", "m", 1.0, 0.5, claim="c", holds=False,
                           rule_name="too few steps", cause=why)):
        assert row.verdict != "does not hold" and row.cause is None
        assert why not in row.reason


def test_repro_figure_rules_lists_the_rules_and_the_causes(capsys):
    assert main(["figure", "--rules"]) == 0
    out = capsys.readouterr().out
    for r in verdicts.RULES:
        assert f"| {r.name} | {r.verdict} | {r.when} |" in out
    for c in verdicts.CAUSES:
        assert f"| {c.name} | {c.when} |" in out
    readme = records.results_readme(Path("/nonexistent"))
    assert verdicts.causes_markdown() in readme and verdicts.rules_markdown() in readme


# -- projected against measured: one rule, applied in judge ------------------------------------------


def test_a_projected_value_against_a_paper_measurement_is_not_comparable():
    # thc-fig4's case: a projected time-to-accuracy speed-up against the paper's measured 1.32×.
    row = verdicts.judge("THC (software PS)", "projected TTA speed-up", 1.32, 0.54, claim="faster",
                     interval=(0.39, 0.71), threshold=1.0, projected=True)
    assert (row.verdict, row.rule, row.cause) == ("not comparable", "projected vs measured", None)
    assert row.paper == 1.32 and row.interval == (0.39, 0.71)
    assert claim_row("s", "m", 5.0, 0.58, False, "c", "", projected=True).rule == \
        "projected vs measured"
    # Without a paper number the projected value is checked on its claim.
    checked = verdicts.judge("s", "projected throughput", None, 0.64, claim="faster",
                         interval=(0.58, 0.70), threshold=1.0, projected=True,
                         cause="scale: a small model")
    assert (checked.verdict, checked.rule) == ("does not hold", "checked")
    # A not-comparable rule before it in the table wins; one after it does not.
    for earlier in ("stand-in", "too few steps", "CPU vs GPU"):
        assert verdicts.judge("s", "m", 22.4, 0.6, claim="c", rule_name=earlier,
                          projected=True).rule == earlier
    # A measured value (on an emulated link) against the paper's number stays checked.
    measured = verdicts.judge("s", "measured throughput", 1.43, 0.8, claim="faster",
                          interval=(0.7, 0.9), threshold=1.0, cause="hardware: a CPU")
    assert measured.rule == "checked"


def test_projected_vs_measured_is_named_only_for_a_projected_value():
    with pytest.raises(ValueError, match="'s' / 'm': rule 'projected vs measured' is for a "
                                         "projected value"):
        verdicts.judge("s", "m", None, 0.6, claim="c", rule_name="projected vs measured")
    row = verdicts.judge("s", "m", None, 0.6, claim="context: the PS's work is not modelled",
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
    """Paper modules build rows through verdicts.judge (or common.claim_row), never Row(...)
    with a label of their own, and never call verdicts.verdict."""
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
