"""Run-directory metrics (crash-safe resume, atomic summary), the rank-0 gate, W&B and
progress bars (repro/logging.py)."""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from repro import logging as rlog
from repro.logging import MetricsWriter, WandbLogger, is_main, read_metrics, read_summary


def metrics_path(run_dir) -> str:
    return os.path.join(run_dir, "metrics.jsonl")


def steps_in_file(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


# -- the rank-0 gate ---------------------------------------------------------------------
def test_is_main_without_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert is_main()


def test_is_main_reads_the_rank_of_an_initialised_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        assert is_main()
        assert not rlog.progress(range(3), desc="x", enabled=True).disable
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # as seen on rank 1
        assert not is_main()
        bar = rlog.progress(range(3), desc="x", enabled=True)
        assert bar.disable and list(bar) == [0, 1, 2]  # silent but still iterates
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert is_main()


# -- metrics.jsonl -----------------------------------------------------------------------
def test_log_writes_durable_lines_with_clean_values(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.log(0, loss=torch.tensor(1.5), lr=np.float32(0.1), bytes_sent=np.int64(4096), nmse=float("nan"),
          density=None, ef_norm=float("inf"))
    w.log(1, loss=1.25)
    # Readable before close(): each line is flushed as it is logged.
    with open(metrics_path(tmp_path)) as f:
        lines = f.read().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 0 and first["loss"] == 1.5 and first["bytes_sent"] == 4096
    assert isinstance(first["bytes_sent"], int)
    assert math.isclose(first["lr"], 0.1, rel_tol=1e-6)
    assert first["nmse"] is None and first["density"] is None and first["ef_norm"] is None
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    second = json.loads(lines[1])
    assert second["wall_time"] >= first["wall_time"] >= 0
    w.close()


def test_log_refuses_non_scalars_and_reserved_names(tmp_path):
    with MetricsWriter(str(tmp_path)) as w:
        with pytest.raises(TypeError, match="'grad'.*3 elements"):
            w.log(0, grad=torch.ones(3))
        with pytest.raises(TypeError, match="'cfg'"):
            w.log(0, cfg={"a": 1})
        with pytest.raises(ValueError, match="'wall_time' is reserved"):
            w.log(0, wall_time=1.0)
    assert read_metrics(str(tmp_path)) == []


def test_resume_drops_steps_after_checkpoint_and_torn_line(tmp_path):
    run = str(tmp_path)
    w = MetricsWriter(run)
    for s in range(10):
        w.log(s, loss=10.0 - s)
    w.close()
    last_wall = read_metrics(run)[-1]["wall_time"]
    with open(metrics_path(run), "a") as f:  # a rank killed mid-write
        f.write('{"step": 10, "loss": 0.')
    assert steps_in_file(run) == list(range(10))  # the reader skips the torn line

    # Relaunch from the checkpoint taken after step 6: steps 7.. are recomputed.
    w = MetricsWriter(run, resume_step=6)
    assert steps_in_file(run) == list(range(7))
    with open(metrics_path(run)) as f:
        assert f.read().endswith("}\n")  # the torn fragment is gone, not just skipped
    for s in range(7, 12):
        w.log(s, loss=10.0 - s)
    w.close()
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(12))  # no step twice, none missing
    assert [r["loss"] for r in records] == [10.0 - s for s in range(12)]
    times = [r["wall_time"] for r in records]
    assert times == sorted(times)  # time keeps increasing across the relaunch
    kept_last = [r for r in records if r["step"] == 6][0]["wall_time"]
    assert kept_last <= last_wall and records[7]["wall_time"] >= kept_last
    assert not glob.glob(os.path.join(run, "*.tmp"))


def test_resume_twice_and_explicit_wall_offset(tmp_path):
    run = str(tmp_path)
    with MetricsWriter(run) as w:
        for s in range(5):
            w.log(s, loss=1.0)
    with MetricsWriter(run, resume_step=4, wall_offset=100.0) as w:  # nothing to drop
        w.log(5, loss=1.0)
    with MetricsWriter(run, resume_step=5) as w:
        w.log(6, loss=1.0)
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(7))
    assert records[5]["wall_time"] >= 100.0 and records[6]["wall_time"] >= records[5]["wall_time"]


def test_fresh_start_truncates_a_stale_file(tmp_path):
    run = str(tmp_path)
    with MetricsWriter(run) as w:
        for s in range(4):
            w.log(s, loss=1.0)
    # Crash before the first checkpoint: the relaunch starts again at step 0.
    with MetricsWriter(run, resume_step=None) as w:
        w.log(0, loss=2.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(run)] == [(0, 2.0)]


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
    run = str(tmp_path)
    with open(metrics_path(run), "w") as f:
        f.write('{"step": 0, "loss": 1}\n{"step": 1, "lo\n{"step": 2, "loss": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: corrupt"):
        read_metrics(run)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        MetricsWriter(run, resume_step=2)


def test_read_metrics_on_a_non_run_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl is missing"):
        read_metrics(str(tmp_path))


def test_bad_resume_step(tmp_path):
    with pytest.raises(ValueError, match="resume_step"):
        MetricsWriter(str(tmp_path), resume_step=2.5)


# -- summary.json ------------------------------------------------------------------------
def test_summary_roundtrip_and_clean_values(tmp_path):
    run = str(tmp_path)
    assert read_summary(run) is None
    with MetricsWriter(run) as w:
        w.write_summary({"steps": 3, "eval/accuracy": torch.tensor(0.5), "nmse": float("nan"),
                         "nested": {"a": [1, np.float64(2.5)]}, "metric": "accuracy"})
    assert read_summary(run) == {"steps": 3, "eval/accuracy": 0.5, "nmse": None,
                                 "nested": {"a": [1, 2.5]}, "metric": "accuracy"}


def test_summary_write_is_atomic(tmp_path):
    run = str(tmp_path)
    with MetricsWriter(run) as w:
        w.write_summary({"steps": 10, "loss": 0.5})
        # Serialisation fails part way through (keys are sorted: "a_loss" is written first).
        with pytest.raises(TypeError, match="not JSON-serialisable"):
            w.write_summary({"a_loss": 0.25, "z_unserialisable": object()})
    assert read_summary(run) == {"steps": 10, "loss": 0.5}  # the old file survives intact
    assert sorted(os.listdir(run)) == ["metrics.jsonl", "summary.json"]  # no temp left behind


def test_summary_write_failing_at_replace_keeps_old_file(tmp_path, monkeypatch):
    run = str(tmp_path)
    rlog.write_summary(run, {"steps": 1})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(rlog.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        rlog.write_summary(run, {"steps": 2})
    monkeypatch.undo()
    assert read_summary(run) == {"steps": 1}
    assert os.listdir(run) == ["summary.json"]


# -- W&B ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_wandb_offline_writes_an_offline_run_under_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # a declared dependency; absent only in a broken env
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = str(tmp_path)
    cfg = {"compressor": {"name": "topk", "ratio": 0.01}, "seed": 0}
    logger = WandbLogger(cfg, project="gradcomp-test", group="g", name="topk-test", run_dir=run)
    assert logger.active
    run_id = logger.run.id
    logger.log(0, {"loss": torch.tensor(2.0), "nmse": float("nan"), "eval/accuracy": 0.1})
    logger.log(1, {"loss": 1.5})
    logger.finish()
    logger.finish()  # idempotent
    offline = glob.glob(os.path.join(run, "wandb", f"offline-run-*-{run_id}"))
    assert offline, os.listdir(os.path.join(run, "wandb"))
    data = glob.glob(os.path.join(offline[0], f"run-{run_id}.wandb"))
    assert data and os.path.getsize(data[0]) > 0
    # A relaunch in the same run directory continues the same W&B run id.
    again = WandbLogger(cfg, project="gradcomp-test", group="g", name="topk-test", run_dir=run)
    assert again.run.id == run_id
    again.finish()


def test_wandb_mode_defaults_to_offline_through_the_environment(tmp_path, monkeypatch, capsys):
    calls = []

    class FakeRun:
        id = "fake"

        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", os.environ.get("WANDB_MODE"), kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = WandbLogger({"seed": 1}, project="p", group=None, name="n", run_dir=str(tmp_path))
    logger.log(3, {"loss": 1.0, "nmse": float("nan"), "eval/accuracy": torch.tensor(0.25)})
    logger.finish()
    (_, mode, kwargs), log, fin = calls
    assert mode == "offline" and os.environ["WANDB_MODE"] == "offline"
    assert "mode" not in kwargs  # the environment decides, never an argument
    assert kwargs["dir"] == str(tmp_path) and kwargs["config"] == {"seed": 1}
    assert kwargs["project"] == "p" and kwargs["name"] == "n"
    assert log == ("log", 3, {"step": 3, "train/loss": 1.0, "eval/accuracy": 0.25})  # NaN dropped, tensor .item(), W&B names
    assert fin == ("finish",)
    # The environment wins over the default.
    calls.clear()
    monkeypatch.setenv("WANDB_MODE", "online")
    WandbLogger({}, project="p", group=None, name="n", run_dir=str(tmp_path))
    assert calls[0][1] == "online"


def test_wandb_disabled_is_a_noop_with_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    fake = types.SimpleNamespace(init=lambda **kw: pytest.fail("wandb.init called while disabled"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = WandbLogger({"a": 1}, project="p", group="g", name="n", run_dir=str(tmp_path))
    assert not logger.active
    logger.log(0, {"loss": 1.0})
    logger.finish()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WANDB_MODE=disabled" in err
    assert not os.path.exists(os.path.join(tmp_path, "wandb"))


def test_wandb_not_importable_is_a_noop_with_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    logger = WandbLogger({}, project="p", group="g", name="n", run_dir=str(tmp_path))
    assert not logger.active
    logger.log(0, {"loss": 1.0})
    logger.finish()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be imported" in err and "pip install wandb" in err


def test_wandb_init_failure_is_a_noop_with_the_reason(tmp_path, monkeypatch, capsys):
    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_MODE", "online")
    logger = WandbLogger({}, project="p", group="g", name="n", run_dir=str(tmp_path))
    assert not logger.active
    err = capsys.readouterr().err
    assert "api_key not configured" in err and "WANDB_MODE=offline" in err


def test_wandb_off_rank_zero_and_when_not_enabled(tmp_path, monkeypatch):
    fake = types.SimpleNamespace(init=lambda **kw: pytest.fail("wandb.init called off rank 0"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert not WandbLogger({}, "p", "g", "n", str(tmp_path), enabled=False).active
    monkeypatch.setattr(rlog, "is_main", lambda: False)
    assert not WandbLogger({}, "p", "g", "n", str(tmp_path)).active
    assert os.listdir(tmp_path) == []


def _fake_wandb(calls: list):
    class FakeRun:
        id = "fake"

        def log(self, data, step):
            pass

        def finish(self):
            calls.append(("finish",))

    class Settings:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    return types.SimpleNamespace(init=init, Settings=Settings)


def test_wandb_console_output_is_silenced_unless_verbose(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.setenv("WANDB_MODE", "offline")
    WandbLogger({"logger": {"verbose": False}}, "p", "g", "n", str(tmp_path)).finish()
    (_, kwargs), _ = calls
    assert kwargs["settings"].kwargs == {"silent": True} and "mode" not in kwargs
    err = capsys.readouterr().err
    # One line of ours instead of W&B's banner: where the run went and how to upload it.
    assert err.count("\n") == 1 and "wandb sync" in err and str(tmp_path) in err
    calls.clear()
    WandbLogger({"logger": {"verbose": True}}, "p", "g", "n", str(tmp_path)).finish()
    (_, kwargs), _ = calls
    assert "settings" not in kwargs  # W&B prints as it likes
    assert capsys.readouterr().err == ""
    calls.clear()
    WandbLogger({}, "p", "g", "n", str(tmp_path), verbose=True).finish()
    assert "settings" not in calls[0][1]


def test_logger_config_has_the_verbose_key():
    from repro.config import LoggerConfig

    assert LoggerConfig().verbose is False


def test_run_summary_lines_read_the_run(tmp_path):
    run = str(tmp_path / "run")
    assert rlog.run_summary_lines(str(tmp_path)) == []  # no summary: not finished
    w = MetricsWriter(run)
    for step in range(3):
        w.log(step, loss=2.0 - step, samples=110.0, step_s=1.0, samples_per_s=110.0,
              **{"projected/samples_per_s": 1000.0, "projected/step_s": 0.1,
                 "estimation_quality": 0.9, "density": 0.01})
    w.log(2, **{"eval/accuracy": 0.75})
    w.write_summary({"steps": 3, "wall_time_s": 12.34, "metric": "accuracy", "target": 0.7,
                     "eval/accuracy": 0.75, "time_to_target_s": 11.0})
    w.close()
    first, second, third = rlog.run_summary_lines(run)
    assert first == ("done: 3 steps in 12.3 s, loss 0, accuracy 0.75 (target 0.7 reached "
                     "after 11.0 s)")
    assert second.split() == ["110.0", "samples/s", "measured", "(step", "1", "s", "median,",
                              "10-90%", "1-1", "s),", "1000.0", "projected", "onto",
                              "the", "target", "cluster,", "k̂/k", "0.9,", "density", "0.01"]
    assert third.strip() == f"run dir {run}"


@pytest.mark.heavy  # a `repro train` process with W&B offline, end to end: 7-8 s
def test_repro_train_prints_a_bar_and_its_own_summary_not_wandbs(tmp_path):
    import subprocess

    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("WANDB_SILENT", None)
    cmd = [sys.executable, "-m", "repro.cli", "train", "compressor=topk", "compressor.ratio=0.01",
           "task=cifar10_mixer", "steps=3", "eval_every=0", "eval_batches=1", "cluster=simulated",
           "cluster.workers=2", f"runs_root={tmp_path}", "group=g"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    assert "wandb:" not in out + err  # no banner, no sparklines
    assert "W&B run" in err and "3/3" in err  # our one W&B line, and the progress bar
    (run_dir,) = glob.glob(os.path.join(tmp_path, "g", "*"))
    assert "done: 3 steps in" in out and "samples/s measured" in out and "k̂/k" in out
    assert f"run dir {run_dir}" in out


# -- progress and names ------------------------------------------------------------------
def test_progress_bar(capsys):
    assert list(rlog.progress(range(4), desc="off", enabled=False)) == [0, 1, 2, 3]
    assert "off" not in capsys.readouterr().err
    assert list(rlog.progress(range(4), desc="shown", enabled=True)) == [0, 1, 2, 3]
    assert "shown" in capsys.readouterr().err
    bar = rlog.progress(5, desc="manual", enabled=True)
    bar.update(5)
    bar.close()
    assert "5/5" in capsys.readouterr().err


# -- W&B as its users set it up ------------------------------------------------------------
def test_wandb_takes_its_environment_and_the_logger_keys(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.setenv("WANDB_MODE", "offline")
    for key in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR", "WANDB_TAGS", "WANDB_NOTES"):
        monkeypatch.delenv(key, raising=False)
    config = {"task": {"name": "t"}, "compressor": {"name": "topk"}}
    WandbLogger(config, None, None, "n", str(tmp_path / "run")).finish()
    kwargs = calls[0][1]
    assert kwargs["project"] == "gradcomp-repro" and kwargs["entity"] is None
    assert kwargs["dir"] == str(tmp_path / "run") and kwargs["tags"] == ["task:t"]
    assert kwargs["notes"] is None and kwargs["group"] is None

    calls.clear()
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_ENTITY", "env-team")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_TAGS", "nightly, ablation")
    monkeypatch.setenv("WANDB_NOTES", "from the environment")
    WandbLogger(config, None, "sweep-a", "n", str(tmp_path / "run")).finish()
    kwargs = calls[0][1]
    assert (kwargs["project"], kwargs["entity"]) == ("env-project", "env-team")
    assert kwargs["dir"] == str(tmp_path / "wandb-files") and kwargs["group"] == "sweep-a"
    assert kwargs["tags"] == ["task:t", "nightly", "ablation"]
    assert kwargs["notes"] == "from the environment"
    # The run's id stays in its own folder, wherever W&B writes its files.
    assert os.path.exists(tmp_path / "run" / "wandb" / "run_id")

    calls.clear()  # logger.project / entity / tags / notes win over the environment
    WandbLogger(config, "cfg-project", None, "n", str(tmp_path / "run"), entity="cfg-team",
                tags=["mine"], notes="from the config").finish()
    kwargs = calls[0][1]
    assert (kwargs["project"], kwargs["entity"]) == ("cfg-project", "cfg-team")
    assert kwargs["tags"] == ["task:t", "mine", "nightly", "ablation"]
    assert kwargs["notes"] == "from the config"
    from repro.config import LoggerConfig

    assert {"entity", "tags", "notes", "group"} <= set(LoggerConfig.__dataclass_fields__)


class RecordingWandb:
    """A wandb module that records each run's init arguments and logged steps by run id."""

    def __init__(self):
        self.inits: dict[str, list[dict]] = {}
        self.steps: dict[str, list[int]] = {}

    def init(self, **kwargs):
        run_id = kwargs["id"]
        self.inits.setdefault(run_id, []).append(kwargs)
        steps = self.steps.setdefault(run_id, [])
        return types.SimpleNamespace(
            id=run_id, summary={}, define_metric=lambda *a, **k: None,
            log=lambda row, step: steps.append(step), finish=lambda: None)


@pytest.mark.slow
def test_wandb_groups_a_sweep_and_a_resumed_run_logs_no_step_twice(tmp_path, monkeypatch):
    from repro import launch, sweep

    fake = RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    common = ["cluster=simulated", "cluster.workers=1", "task.size=smoke", "eval_every=0",
              "eval_batches=1", "logger=wandb_offline", "logger.progress=false",
              "checkpoint_every=1", f"runs_root={tmp_path}"]
    given = ["task.hparams.lr=0.1,0.05", "steps=2", *common]
    first, second = launch.train(given, multirun=True, out=lambda s: None)
    groups = {kw["group"] for inits in fake.inits.values() for kw in inits}
    assert groups == {sweep.wandb_group(given)} and "task.hparams.lr=0.1,0.05" in groups.pop()

    def steps_of(run_dir):
        with open(os.path.join(run_dir, "wandb", "run_id")) as f:
            return fake.steps[f.read().strip()]

    assert steps_of(first) == [0, 1]
    # Killed after its last step was logged, before it finished: it resumes from the
    # checkpoint at step 1 and trains step 1 again; W&B does not get step 1 twice.
    for name in ("DONE", "summary.json"):
        os.remove(os.path.join(first, name))
    import shutil

    shutil.rmtree(os.path.join(first, "checkpoints", "step_00000002"))
    launch.train(["task.hparams.lr=0.1", "steps=2", *common], out=lambda s: None)
    assert read_summary(first)["resumed_from_step"] == 1
    assert steps_of(first) == [0, 1] and steps_in_file(first) == [0, 1]
    # Extended to 3 steps alone, it stays in its sweep's group and logs step 2 only.
    launch.train(["task.hparams.lr=0.1", "steps=3", *common], out=lambda s: None)
    assert steps_of(first) == [0, 1, 2]
    with open(os.path.join(first, "wandb", "run_id")) as f:
        inits = fake.inits[f.read().strip()]
    assert len(inits) == 3 and {kw["group"] for kw in inits} == {sweep.wandb_group(given)}
    assert steps_of(second) == [0, 1]


def test_a_bar_in_a_log_writes_a_few_whole_lines():
    import io

    log = io.StringIO()  # not a terminal: SLURM's .err, a pipe
    assert sum(rlog.progress(range(500), desc="train", stream=log)) == sum(range(500))
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and 1 <= len(lines) <= 3 and len(set(lines)) == len(lines)
    assert lines[-1].startswith("train: 100%") and "500/500" in lines[-1]
