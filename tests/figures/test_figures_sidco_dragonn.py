"""The arithmetic the SIDCo/DRAGONN figures rest on: the projection of a simulated run onto
the paper's cluster, the smoothing of Fig. 9, the interval of a ratio of two runs (fast, no
training)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from repro.figures.common import smooth
from repro.figures.sidco import quality_per_time
from repro.runs import load_run


def test_smooth_is_a_running_mean():
    assert np.allclose(smooth([1, 3, 5, 7], 2), [1, 2, 4, 6])
    assert np.allclose(smooth([2.0], 10), [2.0])
    assert smooth([], 3).size == 0
    values = np.random.default_rng(0).lognormal(size=40)
    trailing = [values[max(0, i - 4): i + 1].mean() for i in range(40)]
    assert np.allclose(smooth(values, 5), trailing, rtol=1e-12)


def _fake_run(tmp_path, workers=4, step_s=2.0, compress_s=0.1, comm_s=0.05):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        "compressor: {name: sidco_e, ratio: 0.01}\n"
        f"cluster: {{workers: {workers}, target_workers: 8}}\nsteps: 3\n")
    compute_s = step_s - compress_s  # the trainer's compute_s holds all workers' passes
    recs = []
    for step in range(3):
        recs.append({"step": step, "wall_time": step, "loss": 1.0, "compress_s": compress_s,
                     "step_s": step_s, "compute_s": compute_s, "comm_s": 0.0,
                     "samples_per_s": 16 * workers / step_s, "estimation_quality": 1.0 + step / 10,
                     "projected/step_s": compute_s + compress_s + comm_s})
    recs.append({"step": 2, "wall_time": 3, "eval/accuracy": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(json.dumps(
        {"metric": "accuracy", "higher_is_better": True, "target": 0.9, "eval/accuracy": 0.5,
         "data_source": "stand-in"}))
    return str(run)


def test_projection_counts_one_workers_compute(tmp_path):
    r = load_run(_fake_run(tmp_path))
    p = r.projection(skip_steps=1)
    # per-worker compute (2.0 − 4·0.1)/4 = 0.4, + own compression 0.1 + projected comm 0.05
    assert p.step_s == pytest.approx(0.55)
    assert p.per_worker_samples == pytest.approx(16)
    assert p.samples_per_s == pytest.approx(16 * 8 / 0.55)
    assert r.k_ratio_stats()[0] == pytest.approx(1.1)
    assert r.eval_curve == [(3, 0.5)] and r.steps_to(0.5) == 3 and r.steps_to(0.6) is None
    assert quality_per_time(r) == pytest.approx(0.5 / (3 * 0.55))


def test_projected_steps_and_the_interval_of_a_ratio_of_two_runs(tmp_path):
    from repro.figures.common import pooled_steps, projected_steps, timing_ratio
    from repro.figures.sidco import _speedup

    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    fast = load_run(_fake_run(tmp_path / "a", step_s=2.0))
    slow = load_run(_fake_run(tmp_path / "b", step_s=4.0))
    # One projection per timed step after the warm-up step, each as projection() makes it.
    assert projected_steps(fast) == pytest.approx([0.55, 0.55])
    assert projected_steps(slow) == pytest.approx([1.05, 1.05])
    span = timing_ratio(2.0, slow, fast)
    assert span.median == pytest.approx(2.0) and span.interval == pytest.approx((2.0, 2.0))
    runs = {("sidco_e", 0.01): fast, ("none", None): slow}
    sp = _speedup(runs, 0.01, "sidco_e", "none")  # same quality, faster steps
    assert sp.median == pytest.approx(1.05 / 0.55) and sp.lo == pytest.approx(sp.median)
    # A timing repeat of the slow run that was twice as fast: pooled into the ratio, whose
    # interval now reaches from the one pass to the other.
    slow.timing_repeats = [load_run(_fake_run(tmp_path / "c", step_s=2.0))]
    assert pooled_steps(slow) == pytest.approx([1.05, 1.05, 0.55, 0.55])
    sp = _speedup(runs, 0.01, "sidco_e", "none")
    assert sp.median == pytest.approx(0.8 / 0.55)
    assert sp.interval == pytest.approx((1.0, 1.05 / 0.55))


def test_train_grid_repeats_runs_in_alternating_order(tmp_path):
    from types import SimpleNamespace

    from repro.figures.common import train_grid

    calls = []

    def train(overrides, repeat=0, note=None):
        calls.append((overrides[0], repeat))
        folder = tmp_path / f"{overrides[0]}-{repeat}"
        folder.mkdir()
        return [_fake_run(folder)]

    ctx = SimpleNamespace(train=train)
    runs = train_grid(ctx, [["A"], ["B"], ["C"]], repeats=3)
    assert calls == [("A", 0), ("B", 0), ("C", 0), ("C", 1), ("B", 1), ("A", 1),
                     ("A", 2), ("B", 2), ("C", 2)]
    assert [len(r.timing_repeats) for r in runs] == [2, 2, 2]
    assert runs[0].timing_repeats[0].path.startswith(str(tmp_path / "A-1"))
    assert not hasattr(train_grid(ctx, [["D"]])[0], "timing_repeats")
