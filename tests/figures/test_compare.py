"""`repro compare`: table, PNG plots and index.html from synthetic run directories written
with the real MetricsWriter (repro/compare.py, repro/commands/compare.py)."""

from __future__ import annotations

import os

import pytest
import yaml

from repro import compare as cmp
from repro.cli import main
from repro.logging import MetricsWriter, read_metrics
from repro.runs import fmt, load_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 12


def make_run(root, name, compressor, ratio, *, sparse: bool, speed: float, acc_gain: float,
             summary_ttt: bool, done: bool = True, seed: int = 0, workers: int = 2,
             mode: str = "simulated") -> str:
    """A run directory as the trainer writes it: config.yaml, metrics.jsonl, summary, DONE."""
    run = os.path.join(root, name)
    os.makedirs(run)
    config = {
        "compressor": {"name": compressor, "ratio": ratio},
        "task": {"name": "cifar10_resnet20", "size": "smoke", "data": "standin"},
        "cluster": {"workers": workers, "mode": mode, "target_workers": 16},
        "seed": seed, "steps": STEPS, "group": "g", "name": None,
    }
    with open(os.path.join(run, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    w = MetricsWriter(run)
    accuracy = []
    for s in range(STEPS):
        m = {"loss": 2.5 - 0.1 * s * (1 + acc_gain), "lr": 0.1, "samples_per_s": speed + s,
             "projected/samples_per_s": 8 * speed + s, "projected/step_s": 0.02 + 0.001 * s,
             "step_s": 0.05 + 0.01 * s, "compute_s": 0.03,
             "compress_s": 0.004 if sparse else 0.0, "comm_s": 0.01 + 0.001 * s,
             "bytes_sent": 1000.0 + s if sparse else 272474.0 * 4}
        if sparse:
            m["estimation_quality"] = 0.9 + 0.01 * s
        if s % 4 == 3:
            m["eval/accuracy"] = 0.1 + acc_gain * s
            accuracy.append(m["eval/accuracy"])
        w.log(s, **m)
    summary = {"steps": STEPS, "metric": "accuracy", "target": 0.5, "data_source": "CIFAR-10 stand-in",
               "eval/accuracy": accuracy[-1]}
    if summary_ttt:
        summary["time_to_target_s"] = 123.0
    w.log(STEPS - 1, **{"eval/accuracy": accuracy[-1]})  # the final evaluation line
    w.write_summary(summary)
    w.close()
    if done:
        with open(os.path.join(run, "DONE"), "w") as f:
            f.write(f"{STEPS}\n")
    return run


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    a = make_run(str(root), "topk-r0.01-w2-cifar10_resnet20", "topk", 0.01, sparse=True, speed=100.0,
                 acc_gain=0.05, summary_ttt=False)
    b = make_run(str(root), "none-w2-cifar10_resnet20", "none", None, sparse=False, speed=60.0,
                 acc_gain=0.01, summary_ttt=False, done=False)
    return a, b


def total_rate(run, rate_key, time_key):
    """Samples over time, as a run's throughput is defined: never the mean of the rates."""
    recs = [r for r in read_metrics(run) if r.get(rate_key) is not None]
    return sum(r[rate_key] * r[time_key] for r in recs) / sum(r[time_key] for r in recs)


def mean(run, key):
    vals = [r[key] for r in read_metrics(run) if r.get(key) is not None]
    return sum(vals) / len(vals)


@pytest.mark.slow
def test_compare_prints_table_and_writes_plots_and_html(runs, tmp_path, capsys):
    a, b = runs
    out = str(tmp_path / "cmp")
    assert main(["compare", a, b, "--out", out]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = lines[0]
    for col in ("run", "compressor", "ratio", "workers", "task", "final loss", "best eval/accuracy",
                "time to target (s)", "samples/s", "projected samples/s (16 workers)", "k̂/k", "density",
                "sent/worker/step", "compress (ms)", "comm (ms)"):
        assert col in header, col
    row_a = next(line for line in lines if line.startswith("topk-r0.01"))
    row_b = next(line for line in lines if line.startswith("none-w2"))
    records_a = read_metrics(a)
    # Values the table must show, computed here from what the run logged.
    final_loss_a = [r["loss"] for r in records_a if "loss" in r][-1]
    best_a = max(r["eval/accuracy"] for r in records_a if "eval/accuracy" in r)
    first_hit = next(r["wall_time"] for r in records_a if r.get("eval/accuracy", 0) >= 0.5)
    rate = total_rate(a, "samples_per_s", "step_s")
    assert abs(rate - mean(a, "samples_per_s")) > 1  # step times vary: not the mean of rates
    for value in (final_loss_a, best_a, first_hit, rate,
                  total_rate(a, "projected/samples_per_s", "projected/step_s"),
                  mean(a, "estimation_quality"),
                  mean(a, "compress_s") * 1e3, mean(a, "comm_s") * 1e3):
        assert fmt(value) in row_a.split(), (value, row_a)
    assert "1006 B" in row_a  # mean bytes sent per worker per step: 1000 + mean(0..11) = 1005.5
    assert "1.04 MiB" in row_b  # dense fp32 of 272474 elements
    assert "not yet" in row_b  # no DONE marker, target 0.5 not reached
    assert "running/incomplete" in row_b and " done " in row_a
    # Nothing logged density: the plot is skipped and the output says so.
    assert "skipped density_vs_step.png: no run logged 'density'" in text
    expected = ["loss_vs_step.png", "loss_vs_time.png", "eval_accuracy_vs_step.png",
                "eval_accuracy_vs_time.png", "throughput_vs_step.png", "estimation_quality_vs_step.png",
                "bytes_sent_vs_step.png", "step_time_breakdown.png"]
    html = open(os.path.join(out, "index.html"), encoding="utf-8").read()
    for name in expected:
        path = os.path.join(out, name)
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == PNG_MAGIC and os.path.getsize(path) > 5000, name
        assert f'src="{name}"' in html
    assert not os.path.exists(os.path.join(out, "density_vs_step.png"))
    assert "topk-r0.01-w2-cifar10_resnet20" in html and "none-w2-cifar10_resnet20" in html
    text = html.replace("<wbr>", "")  # headers may break after "/" and "_"
    assert "projected samples/s" in text and "no run logged &#x27;density&#x27;" in html
    assert os.path.getsize(os.path.join(out, "table.csv")) > 0


def test_time_to_target_prefers_summary_and_reports_not_reached(tmp_path):
    root = str(tmp_path)
    hit = make_run(root, "hit", "topk", 0.01, sparse=True, speed=1.0, acc_gain=0.05, summary_ttt=True)
    miss = make_run(root, "miss", "topk", 0.01, sparse=True, speed=1.0, acc_gain=0.01, summary_ttt=False)
    r_hit, r_miss = load_runs([hit, miss])
    best, ttt, status = cmp.best_and_target(r_hit)
    assert (ttt, status) == (123.0, "reached")
    best, ttt, status = cmp.best_and_target(r_miss)
    assert ttt is None and status == "not reached"
    assert best == pytest.approx(max(r["eval/accuracy"] for r in read_metrics(miss) if "eval/accuracy" in r))
    assert r_hit.data_source == "CIFAR-10 stand-in" and r_hit.metric == "accuracy"


def test_lower_is_better_metric_picks_the_minimum(tmp_path):
    run = os.path.join(tmp_path, "lm")
    os.makedirs(run)
    with open(os.path.join(run, "config.yaml"), "w") as f:
        yaml.safe_dump({"compressor": {"name": "dgc"}, "task": {"name": "ptb", "metric": "perplexity",
                                                                "target": 150.0}}, f)
    with MetricsWriter(run) as w:
        for s, ppl in enumerate([400.0, 180.0, 140.0, 160.0]):
            w.log(s, **{"loss": 5.0, "eval/perplexity": ppl})
    (r,) = load_runs([run])
    best, ttt, status = cmp.best_and_target(r)
    assert best == 140.0 and status == "reached"
    assert ttt == read_metrics(run)[2]["wall_time"]


@pytest.mark.slow
def test_x_time_plots_diagnostics_against_wall_time(runs, tmp_path, capsys):
    out = str(tmp_path / "cmp_time")
    assert main(["compare", *runs, "--out", out, "--x", "time"]) == 0
    capsys.readouterr()
    for name in ("throughput_vs_time.png", "estimation_quality_vs_time.png", "loss_vs_step.png"):
        assert os.path.getsize(os.path.join(out, name)) > 5000
    assert not os.path.exists(os.path.join(out, "throughput_vs_step.png"))


@pytest.mark.slow
def test_default_out_folder_is_beside_the_runs_in_their_group(runs, tmp_path, monkeypatch,
                                                              capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["compare", runs[1], runs[0]]) == 0
    printed = capsys.readouterr().out
    assert os.listdir(cwd) == []  # nothing written where the command ran
    group = os.path.dirname(runs[0])
    (folder,) = os.listdir(os.path.join(group, "compare"))  # runs/<group>/compare/<time>/
    out = os.path.join(group, "compare", folder)
    assert os.path.exists(os.path.join(out, "index.html")) and out in printed
    # Nothing inside a run folder, which `repro train --restart` would delete.
    assert not [name for run in runs for name in os.listdir(run) if "compare" in name]
    # The group's glob (runs/<group>/*) now holds the comparison too: it is left out, said.
    notes: list[str] = []
    again = load_runs(sorted(os.path.join(group, d) for d in os.listdir(group)), notes=notes)
    assert sorted(r.path for r in again) == sorted(runs)
    assert notes == [(f"left out {os.path.join(group, 'compare')}: comparisons written by "
                      "repro compare")]


def test_bad_paths_exit_2_naming_path_and_missing_file(runs, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["compare", runs[0], missing, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and missing in err and "no such directory" in err

    half = tmp_path / "half"
    half.mkdir()
    (half / "config.yaml").write_text("compressor: {name: topk}\n")
    assert main(["compare", str(half)]) == 2
    err = capsys.readouterr().err
    assert str(half) in err and "metrics.jsonl is missing" in err

    group = os.path.dirname(runs[0])  # a sweep folder, not a run
    assert main(["compare", group]) == 2
    err = capsys.readouterr().err
    assert "config.yaml is missing" in err and "pass them" in err


@pytest.mark.slow
def test_seeds_of_one_config_are_summarised_as_mean_and_std(tmp_path, capsys):
    root = str(tmp_path / "runs")
    seeds = [make_run(root, f"topk-s{seed}", "topk", 0.01, sparse=True, speed=100.0 + 10 * seed,
                      acc_gain=0.05 + 0.01 * seed, summary_ttt=False, seed=seed)
             for seed in (0, 1, 2)]
    other = make_run(root, "none-s0", "none", None, sparse=False, speed=60.0, acc_gain=0.01,
                     summary_ttt=False, workers=4)
    out = str(tmp_path / "cmp")
    assert main(["compare", *seeds, other, "--out", out]) == 0
    printed = capsys.readouterr().out
    runs = load_runs(seeds)
    import statistics

    losses = [r.last("loss") for r in runs]
    expected = (f"{fmt(statistics.fmean(losses))} ± {fmt(statistics.stdev(losses), '.2g')} "
                "(n=3)")
    at = printed.index("over seeds (mean ± std):")
    table = printed[at:].splitlines()
    assert "topk-s0 + 2 more" in table[3] and "0, 1, 2" in table[3] and expected in table[3]
    assert "none-s0" not in printed[at:].split("warning")[0]  # one seed: no row of its own
    with open(os.path.join(out, "seeds.csv")) as f:
        assert expected in f.read()
    with open(os.path.join(out, "index.html")) as f:
        assert "Over seeds (mean ± std)" in f.read()
    assert "warning: the runs differ in workers (cluster.workers: 2, 4)" in printed


def test_runs_that_differ_in_workers_or_mode_get_a_warning(tmp_path):
    root = str(tmp_path / "runs")
    a = make_run(root, "a", "topk", 0.01, sparse=True, speed=100.0, acc_gain=0.05,
                 summary_ttt=False, workers=2, mode="simulated")
    b = make_run(root, "b", "topk", 0.01, sparse=True, speed=100.0, acc_gain=0.05,
                 summary_ttt=False, workers=4, mode="spawn")
    c = make_run(root, "c", "dgc", 0.01, sparse=True, speed=90.0, acc_gain=0.05,
                 summary_ttt=False, workers=2, mode="simulated")
    assert cmp.comparability_warnings(load_runs([a, b])) == [
        ("warning: the runs differ in workers (cluster.workers: 2, 4): their samples/s and wall "
         "times are not comparable"),
        ("warning: the runs differ in mode (cluster.mode: simulated, spawn): their samples/s and "
         "wall times are not comparable")]
    assert cmp.comparability_warnings(load_runs([a, c])) == []


@pytest.mark.slow
def test_equal_curves_stay_visible_and_no_title_or_legend_is_cut(tmp_path, monkeypatch):
    """Runs with the same curves each get their own line style and marker; every plot,
    with run names of 80 characters, keeps its titles, labels and legend inside the image
    (no ink on its outermost pixels)."""
    import matplotlib.image as mpimg
    import numpy as np

    root = str(tmp_path / "runs")
    names = ["topk-ratio0.01-simulated-one-worker-cifar10_resnet20-smoke-long-name-for-wrapping",
             "dgc_ratio0.01_simulated_one_worker_cifar10_resnet20_smoke_name_without_hyphens",
             "densebaselinewithoutanyseparatorsatallcifar10resnet20smokerunnamethatmustwrap"]
    runs = [make_run(root, n, "topk", 0.01, sparse=True, speed=100.0, acc_gain=0.05,
                     summary_ttt=False, seed=i) for i, n in enumerate(names)]  # equal curves
    styles = []
    save = cmp.Plotter.save

    def spy(self, fig, file, title):
        if file == "loss_vs_step.png":
            styles.extend((line.get_linestyle(), line.get_marker())
                          for line in fig.axes[0].get_lines())
        save(self, fig, file, title)

    monkeypatch.setattr(cmp.Plotter, "save", spy)
    out = str(tmp_path / "cmp")
    with open(os.devnull, "w") as quiet:
        cmp.compare(runs, out=out, stream=quiet)
    assert len(styles) == 3 and len(set(styles)) == 3
    plots = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    assert "step_time_breakdown.png" in plots and len(plots) >= 8
    for name in plots:
        image = mpimg.imread(os.path.join(out, name))[..., :3]
        edge = np.concatenate([image[:2].reshape(-1, 3), image[-2:].reshape(-1, 3),
                               image[:, :2].reshape(-1, 3), image[:, -2:].reshape(-1, 3)])
        assert int((edge.min(axis=1) < 0.9).sum()) == 0, f"{name}: something is cut at its edge"
