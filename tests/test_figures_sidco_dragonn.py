"""The arithmetic the SIDCo/DRAGONN figures rest on: the projection of a simulated run onto
the paper's cluster, the smoothing of Fig. 9, and verdict rows (fast, no training)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from repro.figures.common import claim_row, smooth
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


def test_claim_rows_compute_their_verdicts():
    assert claim_row("s", "m", 1.0, 2.0, True, "c", "x").verdict == "holds"
    assert claim_row("s", "m", 1.0, 0.5, False, "c", "x").verdict == "does not hold"
    missing = claim_row("s", "m", 1.0, None, True, "c", "x")
    assert missing.verdict == "not comparable" and missing.reproduced is None
    assert claim_row("s", "m", 1.0, None, True, "c", "x", missing_ok=True).verdict == "holds"
    assert "does NOT hold" in claim_row("s", "m", 1.0, 0.5, False, "c", "x").reason
