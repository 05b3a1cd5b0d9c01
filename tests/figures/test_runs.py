"""repro.runs: one reader of a run directory (config.yaml, metrics.jsonl, summary.json,
DONE) and the statistics repro compare and the figures take from it, on run directories
written with the trainer's own MetricsWriter."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from repro import runs
from repro.logging import MetricsWriter


def write_config(run: str, config: dict) -> None:
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)


CONFIG = {"compressor": {"name": "topk", "ratio": 0.01}, "task": {"name": "cifar10_resnet20"},
          "cluster": {"workers": 4, "target_workers": 8}, "steps": 6, "name": None}


def timed_step(step_s: float, compress_s: float, comm_s: float, workers: int = 4) -> dict:
    """A step's timing as the simulated trainer logs it (compute_s is one worker's)."""
    compute_s = (step_s - workers * compress_s) / workers
    return {"step_s": step_s, "compress_s": compress_s, "compute_s": compute_s,
            "projected/step_s": compute_s + compress_s + comm_s,
            "samples_per_s": 32 * workers / step_s}


def finished_run(root, name="run", config=CONFIG, summary=True, done=True) -> str:
    """Six steps, evaluations after steps 2 and 5, the final one in the summary."""
    run = os.path.join(str(root), name)
    write_config(run, config)
    with MetricsWriter(run) as w:
        for s in range(6):
            m = {"loss": 3.0 - 0.25 * s, "estimation_quality": 0.9 + 0.05 * s,
                 **timed_step(1.0 + 0.1 * s, 0.01 * (s + 1), 0.002 * (s + 1))}
            if s in (2, 5):
                m["eval/accuracy"] = 0.2 + 0.1 * s
            w.log(s, **m)
        if summary:
            w.write_summary({"metric": "accuracy", "higher_is_better": True, "target": 0.5,
                             "data_source": "stand-in", "eval/accuracy": 0.7})
    if done:
        Path(run, "DONE").write_text("6\n")
    return run


def test_fmt_prints_numbers_one_way():
    assert runs.fmt(0.123456) == "0.1235"
    assert runs.fmt(0.123456, ".3g", "n/a") == "0.123"
    assert runs.fmt(None) == "—" and runs.fmt(None, ".3g", "n/a") == "n/a"
    assert runs.fmt(12345) == "12345" and runs.fmt(True) == "True"
    assert runs.fmt(float("inf")) == "inf" and runs.fmt(float("nan")) == "nan"
    assert runs.fmt(np.float32(0.123456)) == "0.1235" and runs.fmt(np.int64(7)) == "7"
    assert runs.fmt("a label") == "a label"


def test_a_finished_run_reads_whole(tmp_path):
    r = runs.load_run(finished_run(tmp_path))
    assert (r.compressor, r.ratio, r.workers, r.target_workers, r.steps) == ("topk", 0.01, 4, 8, 6)
    assert r.name == "run" and r.done and not r.torn
    assert r.metric == "accuracy" and r.eval_key == "eval/accuracy" and r.higher_is_better
    assert r.target == 0.5 and r.data_source == "stand-in"
    steps, losses = r.series("loss")
    assert steps == list(range(6)) and all(isinstance(s, int) for s in steps)
    assert losses == [3.0 - 0.25 * s for s in range(6)]
    times, _ = r.series("loss", "time")
    assert times == sorted(times) and all(isinstance(t, float) for t in times)
    assert r.series("loss", skip_steps=4) == ([4, 5], [2.0, 1.75])
    assert r.mean("loss") == statistics.fmean(losses) and r.last("loss") == 1.75
    assert r.mean("density") is None and r.series("density") == ([], [])
    with pytest.raises(ValueError, match="step or time"):
        r.series("loss", "epoch")


def test_the_evaluation_curve_and_what_follows_from_it(tmp_path):
    r = runs.load_run(finished_run(tmp_path))
    assert r.eval_curve == [(3, pytest.approx(0.4)), (6, pytest.approx(0.7))]  # steps done
    assert r.final_eval == 0.7 and r.best() == 0.7
    assert r.steps_to(0.4) == 3 and r.steps_to(0.5) == 6 and r.steps_to(0.8) is None
    km, k5, k95 = r.k_ratio_stats()
    ks = [0.9 + 0.05 * s for s in range(6)]
    assert km == pytest.approx(np.mean(ks)) and k5 == pytest.approx(np.percentile(ks, 5))
    assert k95 == pytest.approx(np.percentile(ks, 95))


def test_lower_is_better_metric_without_summary(tmp_path):
    """A run still going: no summary, no DONE; the metric is the one evaluated key, its
    direction from its name, the target from the config, the final value the last logged."""
    run = os.path.join(tmp_path, "lm")
    write_config(run, {"task": {"name": "ptb", "target": 150.0}})
    with MetricsWriter(run) as w:
        for s, ppl in enumerate([400.0, 140.0, 180.0]):
            w.log(s, **{"loss": 5.0, "eval/perplexity": ppl, "eval/loss": 5.0})
    r = runs.load_run(run)
    assert r.summary is None and not r.done
    assert r.metric == "perplexity" and not r.higher_is_better and r.target == 150.0
    assert r.final_eval == 180.0 and r.best() == 140.0 and r.steps_to(150.0) == 2
    assert r.compressor == "?" and r.workers is None and r.ratio is None


def test_torn_last_line_is_skipped_and_a_corrupt_one_is_refused(tmp_path):
    run = finished_run(tmp_path, done=False)
    path = Path(run, "metrics.jsonl")
    with open(path, "a") as f:
        f.write('{"step": 6, "loss": 99.0, "step_s": 1')  # the line a killed writer left
    r = runs.load_run(run)
    assert r.torn and [m["step"] for m in r.metrics] == list(range(6))
    assert 99.0 not in r.series("loss")[1] and r.last("loss") == 1.75

    lines = path.read_text().split("\n")
    lines[2] = lines[2][:10]  # not the last line: corruption, not a crash mid-write
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match="corrupt metrics line"):
        runs.load_run(run)


def test_a_resumed_run_holds_every_step_once(tmp_path):
    """Killed after step 4 with a checkpoint at step 2, relaunched: the writer keeps the
    lines up to the checkpoint and the relaunch logs the rest; the reader sees one record
    per step and wall time that keeps increasing."""
    run = os.path.join(tmp_path, "resumed")
    write_config(run, CONFIG)
    with MetricsWriter(run) as w:
        for s in range(5):
            w.log(s, loss=10.0 + s, **timed_step(1.0, 0.01, 0.001))
    with MetricsWriter(run, resume_step=2) as w:
        for s in range(3, 6):
            w.log(s, loss=float(s), **timed_step(2.0, 0.01, 0.001))
        w.log(5, **{"eval/accuracy": 0.3})  # a final evaluation logged on its own line
    r = runs.load_run(run)
    steps, losses = r.series("loss")
    assert steps == list(range(6)) and losses == [10.0, 11.0, 12.0, 3.0, 4.0, 5.0]
    times = [m["wall_time"] for m in r.metrics]
    assert times == sorted(times)
    assert r.eval_curve == [(6, 0.3)] and r.final_eval == 0.3
    # Timing means are over steps 1..5: two steps of the first launch, three of the second.
    assert r.projection().measured_step_s == pytest.approx((2 * 1.0 + 3 * 2.0) / 5)


def test_a_step_logged_twice_counts_once_in_the_evaluation_curve(tmp_path):
    run = os.path.join(tmp_path, "twice")
    write_config(run, CONFIG)
    with MetricsWriter(run) as w:
        w.log(0, **{"loss": 1.0, "eval/accuracy": 0.1})
        w.log(1, **{"loss": 0.9, "eval/accuracy": 0.2})
        w.log(1, **{"eval/accuracy": 0.25})
    r = runs.load_run(run)
    assert r.eval_curve == [(1, 0.1), (2, 0.25)]
    assert r.series("eval/accuracy")[0] == [0, 1, 1]  # the per-record series keeps both


def test_projection_of_a_simulated_run(tmp_path):
    """Each step after the warm-up projected onto one worker: its share of the compute,
    worker 0's compression and the projected communication, then averaged."""
    run = os.path.join(tmp_path, "proj")
    write_config(run, CONFIG)
    steps = [(50.0, 0.5, 0.5), (2.0, 0.1, 0.05), (3.0, 0.2, 0.15)]  # step 0: set-up costs
    with MetricsWriter(run) as w:
        for s, (step_s, compress_s, comm_s) in enumerate(steps):
            w.log(s, **timed_step(step_s, compress_s, comm_s))
        w.log(3, **{"eval/accuracy": 0.5})  # no step time: not a timed step
    p = runs.load_run(run).projection()
    per_worker = [(2.0 - 4 * 0.1) / 4 + 0.1 + 0.05, (3.0 - 4 * 0.2) / 4 + 0.2 + 0.15]
    assert p.step_s == pytest.approx(np.mean(per_worker))
    assert p.measured_step_s == pytest.approx(2.5) and p.compress_s == pytest.approx(0.15)
    assert p.per_worker_samples == pytest.approx(32)
    assert p.samples_per_s == pytest.approx(32 * 8 / p.step_s)
    assert p.time_at(10) == pytest.approx(10 * p.step_s)
    assert runs.load_run(run).projection(skip_steps=0).measured_step_s == pytest.approx(55 / 3)


def test_mean_step_split_of_a_simulated_run(tmp_path):
    """The mean step after the warm-up, split into one worker's compute, compression and
    projected communication; a one-step run falls back to its only step."""
    run = os.path.join(tmp_path, "split")
    write_config(run, CONFIG)
    with MetricsWriter(run) as w:
        for s, (step_s, compress_s, comm_s) in enumerate([(50.0, 0.5, 0.5), (2.0, 0.1, 0.05),
                                                         (3.0, 0.2, 0.15)]):
            w.log(s, **timed_step(step_s, compress_s, comm_s))
    split = runs.load_run(run).mean_step_split()
    assert split.compress_s == pytest.approx(0.15)
    assert split.compute_s == pytest.approx((2.5 - 4 * 0.15) / 4)
    assert split.comm_s == pytest.approx(0.1)
    assert split.total_s == pytest.approx(split.compute_s + 0.15 + 0.1)

    one = os.path.join(tmp_path, "one")
    write_config(one, CONFIG)
    with MetricsWriter(one) as w:
        w.log(0, **timed_step(2.0, 0.1, 0.05))
    r = runs.load_run(one)
    assert r.mean_step_split().comm_s == pytest.approx(0.05)
    assert r.projection().step_s == pytest.approx((2.0 - 0.4) / 4 + 0.1 + 0.05)


def test_missing_files_and_bad_configs_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        runs.load_run(str(tmp_path / "nope"))
    half = tmp_path / "half"
    write_config(str(half), CONFIG)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl is missing"):
        runs.load_run(str(half))
    group = tmp_path / "group"
    finished_run(group, "a")
    with pytest.raises(FileNotFoundError, match=r"config.yaml is missing \(it holds run dir"):
        runs.load_run(str(group))
    bad = finished_run(tmp_path, "bad")
    Path(bad, "config.yaml").write_text("compressor: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        runs.load_run(bad)
    Path(bad, "config.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="config mapping"):
        runs.load_run(bad)


def test_load_runs_tells_same_named_runs_apart(tmp_path):
    a = finished_run(tmp_path / "sweep_a", "topk")
    b = finished_run(tmp_path / "sweep_b", "topk")
    c = finished_run(tmp_path / "sweep_b", "dgc", config={**CONFIG, "name": "named"})
    names = [r.name for r in runs.load_runs([a, b, c])]
    assert names == ["sweep_a/topk", "sweep_b/topk", "named"]
    with pytest.raises(ValueError, match="at least one run directory"):
        runs.load_runs([])


def test_summary_values_win_over_the_log(tmp_path):
    run = finished_run(tmp_path, config={**CONFIG, "task": {"name": "x", "data": "standin"}})
    summary_path = Path(run, "summary.json")
    summary = json.loads(summary_path.read_text())
    summary.update({"eval/accuracy": 0.95, "target": 0.9})
    summary_path.write_text(json.dumps(summary))
    r = runs.load_run(run)
    assert r.final_eval == 0.95 and r.best() == 0.95 and r.target == 0.9
    os.remove(summary_path)
    r = runs.load_run(run)
    assert r.final_eval == pytest.approx(0.7) and r.data_source == "standin"
    assert math.isclose(r.best(), 0.7)
