"""The throughput figures' rows measured on an emulated link: the ratios they take from
real-rank runs, the projection check, and what they say where no link can be built."""

from __future__ import annotations

import pytest

from repro.figures import common
from repro.runs import Run


def run(step_times, samples=32, projected=None, **series):
    metrics = []
    for i, t in enumerate(step_times):
        rec = {"step": i, "step_s": t, "samples": samples, "samples_per_s": samples / t}
        if projected is not None:
            rec["projected/step_s"] = projected[i]
        for key, values in series.items():
            rec[key] = values[i]
        metrics.append(rec)
    return Run(path="/x", name="r", config={"cluster": {"workers": 2}}, metrics=metrics,
               summary=None, done=True)


def test_measured_throughput_ratio_is_a_ratio_of_totals_after_the_warm_up():
    fast = run([9.0, 1.0, 1.0, 4.0])  # step 0 is the warm-up: left out
    slow = run([9.0, 2.0, 2.0, 2.0])
    r = common.measured_throughput_ratio(fast, slow)
    # samples/s: 96/6 over 96/6 -> 1.0, though the mean of the per-step ratios is 1.5
    assert r.median == pytest.approx(1.0)
    assert r.lo == pytest.approx(0.5) and r.hi == pytest.approx(2.0)


def test_projection_check_and_its_verdict():
    good = run([1.0, 1.0, 1.0, 1.0], projected=[5.0, 0.9, 1.0, 1.1])
    check = common.projection_check(good)
    assert check.median == pytest.approx(1.0)
    assert common.within(check) is True
    low = run([1.0] * 4, projected=[1.0, 0.5, 0.6, 0.55])
    assert common.within(common.projection_check(low)) is False
    wide = run([1.0] * 4, projected=[1.0, 0.5, 1.0, 1.5])
    assert common.within(common.projection_check(wide)) is None
    assert common.within(None) is None


def test_measured_part_ratio():
    a = run([1.0] * 3, comm_s=[5.0, 0.2, 0.4])
    b = run([1.0] * 3, comm_s=[5.0, 0.1, 0.1])
    assert common.measured_part_ratio(a, b, "comm_s").median == pytest.approx(3.0)


def test_link_overrides_project_onto_the_link_itself():
    o = common.link_overrides(2.5, 2)
    assert "cluster.network=emulated" in o and "cluster.bandwidth_gbps=2.5" in o
    assert "cluster.target_workers=2" in o and "cluster.mode=spawn" in o


@pytest.mark.parametrize("module,call", [
    ("thc", lambda m, ctx: m._fig4_link_rows(ctx, batch=8, steps=3)),
    ("sidco", lambda m, ctx: m._fig3_link_rows(ctx, "ptb_lstm", ["sidco_e"], 0.01, 3)),
    ("deft", lambda m, ctx: m._fig7_link_rows(ctx, "movielens_ncf", ("topk", "deft"), 64, 3)),
    ("dragonn", lambda m, ctx: m._fig1b_link_rows(ctx, m._fig1b_link(ctx, ["none"], [1024], 1),
                                                  [], "sizes")),
])
def test_without_a_link_each_figure_says_why_and_trains_nothing(monkeypatch, tmp_path, module, call):
    import importlib

    from repro.figures.base import Context

    mod = importlib.import_module(f"repro.figures.{module}")
    reason = "cluster.network=emulated needs root (test)"
    monkeypatch.setattr(common, "link_unavailable", lambda: reason)
    if hasattr(mod, "link_unavailable"):
        monkeypatch.setattr(mod, "link_unavailable", lambda: reason)

    class NoTraining(Context):
        def train(self, *args, **kwargs):
            raise AssertionError("a run was started without a link")

    fig = type("F", (), {"id": f"{module}-x", "paper": module, "experiment": None})()
    ctx = NoTraining(figure=fig, size="smoke", out_dir=tmp_path, say=lambda s: None)
    (row,) = call(mod, ctx)
    assert row.verdict == "not comparable" and row.rule == "not run"
    assert reason in row.reason and "emulated" in row.setting
