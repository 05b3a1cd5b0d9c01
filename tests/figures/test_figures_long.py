"""The extended set: the training figures' long variants (size "long"), where they write,
what refuses them, and that their convergence claims are judged rather than left "too few
steps"."""

from __future__ import annotations

import json
import subprocess

import pytest

from repro import figures
from repro.figures import base, deft, machine, records, registry, verdicts

figures.load_all()


def _fake_figure(fid: str, sizes: dict[str, float]) -> registry.Figure:
    def produce(ctx):
        return [verdicts.judge("s", "m", 1.0, 1.0, claim="c", holds=True)]

    return registry.Figure(fid, "deft", "a test figure", "training", "none", "claim", sizes, produce)


def test_the_extended_set_is_the_figures_with_a_long_variant():
    ext = registry.extended_set()
    assert {"deft-fig3", "deft-fig4", "deft-fig5", "deft-fig10"} <= set(ext)
    for fid in ext:
        fig = figures.get(fid)
        assert fig.kind == "training" and fig.sizes == ("smoke", "full", "long")
    assert figures.get("sidco-fig16").sizes == ("smoke", "full")


@pytest.mark.parametrize("workload", sorted(deft.CONVERGENCE["long"]))
def test_long_runs_are_long_enough_for_the_step_rule(workload):
    steps = deft.CONVERGENCE["long"][workload]["steps"]
    assert verdicts.too_few_steps(steps, deft.PAPER_STEPS[workload]) is None
    # ... while the full variant's runs are not (that is why the extended set exists)
    assert verdicts.too_few_steps(deft.CONVERGENCE["full"][workload]["steps"],
                              deft.PAPER_STEPS[workload]) == "too few steps"


def test_a_set_with_a_figure_without_the_size_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"sidco-fig16 has no long variant.*extended set\): .*deft-fig3"):
        base.run_figures(["deft-fig4", "sidco-fig16"], size="long", out_root=tmp_path,
                         say=lambda m: None, results_root=tmp_path / "r")
    assert not any(tmp_path.iterdir())


def test_a_figure_without_a_smoke_or_full_variant_is_not_registered():
    with pytest.raises(ValueError, match="lacks"):
        _fake_figure("zz-x", {"full": 1.0, "long": 1.0})
    with pytest.raises(ValueError, match="unknown sizes"):
        _fake_figure("zz-x", {"smoke": 1.0, "full": 1.0, "huge": 1.0})


def test_long_runs_write_and_publish_beside_the_full_results(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADCOMP_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.setitem(registry._FIGURES, "zz-long",
                        _fake_figure("zz-long", {"smoke": 1, "full": 1, "long": 5}))
    assert registry.outputs_dir("zz-long", "long") == tmp_path / "outputs" / "long" / "zz-long"
    results = tmp_path / "results"
    base.run_figure("zz-long", size="long", say=lambda m: None, results_root=results,
                    publish_to=results, calibrate=False)
    status = json.loads((results / "long" / "zz-long" / "status.json").read_text())
    assert status["size"] == "long"
    assert not (results / "zz-long").exists()  # the full variant's published folder
    assert (tmp_path / "outputs" / "long" / "zz-long" / "comparison.md").exists()
    # the long run's estimate comes from its own record, not from the full variant's
    assert machine.estimate_seconds("zz-long", "long", results_root=results)[1].startswith(
        "this machine's last run")
    text = records.results_readme(results)
    assert "## The extended set" in text
    assert "[zz-long](long/zz-long/comparison.md)" in text


@pytest.mark.heavy  # trains a figure's runs end to end (CI's heavy lane)
def test_deft_fig3_judges_convergence_in_its_long_variant(tmp_path, monkeypatch):
    """With runs of at least a tenth of the paper's steps, "every sparsifier reaches the
    non-sparsified point" is checked on the data (holds or does not hold), where the full
    variant leaves it "not comparable: too few steps"."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(deft.CONVERGENCE, "long", {
        "movielens_ncf": {"steps": 12, "batch": 64, "eval_every": 6, "eval_batches": 1}})
    monkeypatch.setitem(deft.CONVERGENCE_WORKERS, "long", 2)
    monkeypatch.setitem(deft.PAPER_STEPS, "movielens_ncf", 100)
    rows = base.run_figure("deft-fig3", size="long", out_root=tmp_path, say=lambda m: None,
                           results_root=tmp_path / "none", calibrate=False)
    finals = [r for r in rows if r.metric.startswith("final eval")]
    assert len(finals) == len(deft.SPARSIFIERS)
    for r in finals:  # hr@10, higher is better: the ratio's interval against 0.9
        assert r.interval is not None and r.low <= r.reproduced <= r.high
        want = "holds" if r.low >= 0.9 else "does not hold" if r.high < 0.9 else "inconclusive"
        assert r.verdict == want and r.rule in (verdicts.CHECKED, verdicts.WITHIN_NOISE), r
    status = json.loads((tmp_path / "deft-fig3" / "status.json").read_text())
    assert status["size"] == "long"


@pytest.mark.parametrize("argv, message", [(["--set", "huge"], "unknown set 'huge'"),
                                           (["--set"], "--set needs a name")])
def test_the_script_refuses_an_unknown_set(argv, message):
    script = registry.repo_root() / "scripts" / "repro_figure.sh"
    done = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and message in done.stderr


def test_the_command_line_refuses_extended_with_smoke(capsys):
    from repro.cli import main

    assert main(["figure", "--extended", "--size", "smoke"]) != 0
    assert "--extended runs the long variants" in capsys.readouterr().err


def test_thc_fig8_long_runs_pass_the_step_rule_at_every_scale():
    from repro.figures import thc

    for n, paper in thc.FIG8_PAPER_STEPS.items():
        assert verdicts.too_few_steps(thc.FIG8_LONG_STEPS[n], paper) is None


@pytest.mark.heavy  # trains a figure's runs end to end (CI's heavy lane)
def test_thc_fig8_judges_final_accuracy_in_its_long_variant(tmp_path, monkeypatch):
    from repro.figures import thc

    monkeypatch.setenv("WANDB_MODE", "disabled")
    # two small scales instead of 4/10/30 workers: the same code path, a tenth of the time
    monkeypatch.setattr(thc, "FIG8_CONFIG", {2: (4, 38), 3: (4, 16)})
    monkeypatch.setattr(thc, "FIG8_LONG_STEPS", {2: 4, 3: 3})
    monkeypatch.setattr(thc, "FIG8_PAPER_STEPS", {2: 40, 3: 30})
    monkeypatch.setattr(base.Context, "reference_value", lambda self, setting, metric: None)
    rows = base.run_figure("thc-fig8", size="long", out_root=tmp_path, say=lambda m: None,
                           results_root=tmp_path / "none", calibrate=False)
    finals = [r for r in rows if r.metric == "final accuracy THC − no compression"]
    assert len(finals) == 2
    for r in finals:  # judged on the interval of the last evaluations' differences
        assert r.interval is not None and r.low <= r.reproduced <= r.high
        want = ("holds" if r.low >= -0.02 else "does not hold" if r.high < -0.02
                else "inconclusive")
        assert r.verdict == want and r.rule in (verdicts.CHECKED, verdicts.WITHIN_NOISE)


class _Evaluated:
    def __init__(self, points):
        self.points = points

    def series(self, key):
        return [s for s, _ in self.points], [v for _, v in self.points]


def test_last_evaluations_are_compared_paired_by_step():
    from repro.figures.common import last_evaluations

    a = _Evaluated([(10, 0.1), (20, 0.5), (30, 0.6), (40, 0.2), (50, 0.7), (60, 0.8), (70, 0.5)])
    b = _Evaluated([(20, 0.4), (30, 0.6), (40, 0.6), (50, 0.6), (60, 0.7), (70, 0.6), (80, 0.9)])
    gap, steps = last_evaluations(a, b, "acc", lambda x, y: x - y)
    assert steps == [30, 40, 50, 60, 70]  # the last five both runs evaluated
    # the differences 0.0, -0.4, 0.1, 0.1, -0.1: median 0, 10th-90th percentile -0.28-0.1
    assert gap.median == pytest.approx(0.0)
    assert gap.lo == pytest.approx(-0.28) and gap.hi == pytest.approx(0.1)
    ratio, _ = last_evaluations(a, b, "acc", lambda x, y: x / y)
    assert ratio.median == pytest.approx(1.0)
    assert last_evaluations(a, _Evaluated([(5, 0.1)]), "acc", lambda x, y: x - y) == (None, [])
