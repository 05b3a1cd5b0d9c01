"""One throughput everywhere: total samples / total measured step time, never the mean
of per-step rates (which is biased upward whenever step times vary)."""

from __future__ import annotations

import os
import time

import pytest

from repro.logging import MetricsWriter, read_metrics, read_summary, run_summary_lines
from repro.throughput import percentile, throughput


def records(step_times, samples=10, **extra):
    return [{"step": i, "step_s": t, "samples": samples, "samples_per_s": samples / t, **extra}
            for i, t in enumerate(step_times)]


def test_rate_is_total_samples_over_total_time_not_the_mean_of_rates():
    # 20 samples in 4 s: 5 samples/s. The mean of the per-step rates (10/1, 10/3) is 6.67.
    rate = throughput(records([1.0, 3.0]))
    assert rate.samples_per_s == pytest.approx(5.0)
    assert rate.steps == 2 and rate.samples == 20 and rate.step_s_total == pytest.approx(4.0)


def test_older_records_without_a_sample_count_use_rate_times_time():
    old = [{"step": i, "step_s": t, "samples_per_s": 10 / t} for i, t in enumerate([0.5, 2.0, 1.5])]
    assert throughput(old).samples_per_s == pytest.approx(30 / 4.0)


def test_median_and_interval_of_the_step_time():
    times = [0.1 * (i + 1) for i in range(10)]
    rate = throughput(records(times))
    assert rate.step_s_median == pytest.approx(0.55)
    assert rate.step_s_p10 == pytest.approx(percentile(times, 10)) == pytest.approx(0.19)
    assert rate.step_s_p90 == pytest.approx(0.91)


def test_projected_rate_is_projected_samples_over_projected_time():
    recs = records([1.0, 1.0])
    recs[0].update({"projected/step_s": 0.1, "projected/samples_per_s": 1600.0})  # 160 samples
    recs[1].update({"projected/step_s": 0.3, "projected/samples_per_s": 160 / 0.3})
    assert throughput(recs).projected_samples_per_s == pytest.approx(320 / 0.4)


def test_skip_steps_and_records_without_a_time():
    recs = records([5.0, 1.0, 1.0]) + [{"step": 3, "loss": 1.0}]
    assert throughput(recs, skip_steps=1).samples_per_s == pytest.approx(10.0)
    assert throughput([{"step": 0, "loss": 1.0}]).samples_per_s is None


def test_summary_line_prints_the_total_rate(tmp_path):
    run = str(tmp_path / "run")
    w = MetricsWriter(run)
    for step, t in enumerate([0.5, 0.5, 4.0]):
        w.log(step, loss=1.0, step_s=t, samples=64, samples_per_s=64 / t)
    w.write_summary({"steps": 3, "wall_time_s": 5.0})
    w.close()
    line = run_summary_lines(run)[1]
    # 192 samples in 5 s; the mean of the rates would print 90.7
    assert line.split()[:3] == ["38.4", "samples/s", "measured"]
    assert "step 0.5 s median" in line


@pytest.mark.slow
def test_a_runs_reported_rate_is_total_samples_over_total_step_time(tmp_path, monkeypatch, capsys):
    """Through the trainer: summary.json, the summary line and `repro compare` report
    the rate metrics.jsonl gives as total samples / total step time (within 0.5%), on a
    run whose step times vary (one slow step), where a mean of rates is far off."""
    import repro.train
    from repro import launch
    from repro.compare import table_rows
    from repro.runs import load_run

    original = repro.train.SimulatedTrainer.exchange_step

    def one_slow_step(self, batches):
        if self.step == 2:  # slow next to any step of a busy machine, so the two differ
            time.sleep(2.0)
        return original(self, batches)

    monkeypatch.setattr(repro.train.SimulatedTrainer, "exchange_step", one_slow_step)
    printed = []
    (run_dir,) = launch.train(
        ["compressor=topk", "compressor.ratio=0.05", "task=cifar10_mixer", "steps=6",
         "eval_every=0", "eval_batches=1", "cluster=simulated", "cluster.workers=2",
         "logger=local", "logger.progress=false", f"runs_root={tmp_path}"], out=printed.append)
    recs = [r for r in read_metrics(run_dir) if "step_s" in r]
    assert len(recs) == 6
    total = sum(r["samples"] for r in recs) / sum(r["step_s"] for r in recs)
    mean_of_rates = sum(r["samples_per_s"] for r in recs) / len(recs)
    assert mean_of_rates > 1.2 * total  # the slow step makes the two differ
    summary = read_summary(run_dir)
    assert summary["samples_per_s"] == pytest.approx(total, rel=0.005)
    assert summary["step_s_p10"] <= summary["step_s_median"] <= summary["step_s_p90"]
    line = next(s for s in printed if "samples/s measured" in s)
    assert float(line.split()[0]) == pytest.approx(total, rel=0.005)
    headers, rows = table_rows([load_run(run_dir)])
    assert rows[0][headers.index("samples/s")] == pytest.approx(total, rel=0.005)
    assert os.path.exists(os.path.join(run_dir, "DONE"))
    # topk's allgathers at 2 workers: the link carries the other worker's payload
    assert all(r["wire_bytes"] == pytest.approx(r["bytes_sent"]) for r in recs)
    assert rows[0][headers.index("wire/worker/step")].value == pytest.approx(recs[0]["wire_bytes"])


def test_wire_bytes_per_worker_by_ring_algorithms():
    from repro.costmodel import wire_bytes_per_worker

    payload = [("allgather", 1000)]
    dense = [("allreduce", 4000)]
    assert wire_bytes_per_worker(payload, 2) == wire_bytes_per_worker(dense, 2) / 4 == 1000
    # at 8 workers the allgather's link carries 7 payloads, the allreduce 1.75x the tensor:
    # a 4x smaller payload no longer means 4x less traffic
    assert wire_bytes_per_worker(payload, 8) == 7000
    assert wire_bytes_per_worker(dense, 8) == pytest.approx(7000)
    assert wire_bytes_per_worker([("broadcast", 800), *payload], 4) == pytest.approx(600 + 3000)
    assert wire_bytes_per_worker(payload, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        wire_bytes_per_worker([("gather", 1)], 4)
