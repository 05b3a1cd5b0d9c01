"""Sweeps keyed on the resolved config: each distinct config gets its own folder; a run
directory that holds a config.yaml different from the run's config (a fixed name=, fewer
steps) is refused (never skipped, resumed or overwritten) unless the caller restarts it;
an identical config is skipped when DONE and resumed otherwise; more steps extend it.

Runs are the smoke ResNet-20 on one simulated worker for two or three steps.
"""

from __future__ import annotations

import os
import shutil

import pytest
import yaml
from omegaconf import OmegaConf

from repro import launch
from repro.logging import read_metrics, read_summary

COMMON = ["cluster=simulated", "cluster.workers=1", "task=cifar10_resnet20", "task.size=smoke",
          "eval_every=0", "eval_batches=1", "logger=local", "logger.progress=false"]


def status(lines: list[str]) -> list[str]:
    """The launcher's per-run status lines ("[running] DIR", "[done, skipped] DIR", ...),
    without the summary each finished run prints after them."""
    return [line for line in lines if line.startswith("[")]


SWEEP = ["compressor=topk,dgc", *COMMON]


def snapshot(root) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes)."""
    files = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def steps(run_dir: str) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


def saved_config(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


def no_training(monkeypatch) -> None:
    """Make any attempt to start a run fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(launch, "launch", refuse)


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """topk and dgc, 2 steps, a checkpoint after every step, both DONE."""
    root = tmp_path_factory.mktemp("finished")
    lines: list[str] = []
    dirs = launch.train([*SWEEP, "steps=2", "checkpoint_every=1", f"runs_root={root}"],
                        multirun=True, out=lines.append)
    assert status(lines) == [f"[running] {d}" for d in dirs]
    return root, [os.path.relpath(d, root) for d in dirs]


@pytest.fixture
def runs(finished_sweep, tmp_path):
    """A private copy of the finished sweep: (runs_root, [run directories])."""
    src, rel = finished_sweep
    root = tmp_path / "runs"
    shutil.copytree(src, root)
    return root, [str(root / r) for r in rel]


@pytest.mark.slow
def test_changed_sweep_is_refused_then_restarted_then_skipped(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    lines: list[str] = []
    dirs = launch.train([*SWEEP, "steps=3", f"runs_root={root}"], multirun=True,
                        out=lines.append)
    assert len(dirs) == 2 and status(lines) == [f"[running] {d}" for d in dirs]
    assert all(steps(d) == [0, 1, 2] for d in dirs)
    before = snapshot(root)

    with monkeypatch.context() as m:  # fewer steps: the finished runs cannot be cut back
        no_training(m)
        lines.clear()
        with pytest.raises(ValueError) as info:
            launch.train([*SWEEP, "steps=2", f"runs_root={root}"], multirun=True,
                         out=lines.append)
    message = str(info.value)
    assert message.count("steps: 3 -> 2") == 2
    for d in dirs:
        assert d in message
    for way_out in ("--restart", "name=", "group="):
        assert way_out in message
    assert status(lines) == []  # refused while planning, before any run was announced
    assert snapshot(root) == before  # config, DONE, metrics, summary: byte for byte

    lines.clear()
    again = launch.train([*SWEEP, "steps=2", f"runs_root={root}"], multirun=True,
                         restart=True, out=lines.append)
    assert again == dirs and status(lines) == [f"[restarting] {d}" for d in dirs]
    for d in dirs:
        assert steps(d) == [0, 1]
        assert saved_config(d)["steps"] == 2
        assert os.path.exists(os.path.join(d, "DONE"))
    after = snapshot(root)

    with monkeypatch.context() as m:
        no_training(m)
        lines.clear()
        launch.train([*SWEEP, "steps=2", f"runs_root={root}"], multirun=True,
                     out=lines.append)
    assert status(lines) == [f"[done, skipped] {d}" for d in dirs]
    assert snapshot(root) == after


@pytest.mark.slow
def test_unfinished_run_with_changed_config_is_refused_and_same_config_resumes(
        runs, monkeypatch):
    root, (topk, _) = runs
    os.remove(os.path.join(topk, "DONE"))  # as if killed after its last checkpoint
    assert os.path.exists(os.path.join(topk, "checkpoints", "LATEST"))
    before = snapshot(root)
    same_folder = f"name={os.path.basename(topk)}"  # a fixed name: one folder whatever the config
    with monkeypatch.context() as m:
        no_training(m)
        for changed, shown in ((["steps=1", "checkpoint_every=1"], "steps: 2 -> 1"),
                               (["steps=2", "checkpoint_every=1", "eval_batches=2"],
                                "eval_batches: 1 -> 2")):
            with pytest.raises(ValueError) as info:
                launch.train(["compressor=topk", *COMMON, *changed, same_folder,
                              f"runs_root={root}"], out=lambda s: None)
            message = str(info.value)
            assert topk in message and shown in message and "--restart" in message
    assert snapshot(root) == before

    lines: list[str] = []
    launch.train(["compressor=topk", *COMMON, "steps=2", "checkpoint_every=1",
                  f"runs_root={root}"], out=lines.append)
    assert status(lines) == [f"[running] {topk}"]
    assert read_summary(topk)["resumed_from_step"] == 2
    assert steps(topk) == [0, 1] and os.path.exists(os.path.join(topk, "DONE"))


@pytest.mark.slow
def test_result_neutral_keys_do_not_count_as_a_change(runs, monkeypatch):
    root, dirs = runs  # copied: the saved run_dir and runs_root point elsewhere
    assert all(saved_config(d)["runs_root"] != str(root) for d in dirs)
    before = snapshot(root)
    no_training(monkeypatch)
    same = [*SWEEP, "steps=2", "checkpoint_every=1", f"runs_root={root}"]
    lines: list[str] = []
    launch.train([*same, "logger.progress=true", "logger.wandb=true", "logger.project=elsewhere",
                  "logger.tags=[a,b]", "logger.notes=why", "logger.entity=team"],
                 multirun=True, out=lines.append)
    assert status(lines) == [f"[done, skipped] {d}" for d in dirs]
    # The other logger keys change what a run records: another run, in its own folder.
    other = launch.plan([*same, "logger.progress=true", "logger.log_every=2"], multirun=True)
    assert not {p.run_dir for p in other} & set(dirs)
    assert all(not p.done and not p.changes for p in other)
    assert snapshot(root) == before


@pytest.mark.slow
def test_on_change_restart_reruns_changed_and_skips_unchanged(runs):
    root, (topk, dgc) = runs
    topk_before = snapshot(topk)
    lines: list[str] = []
    launch.train(["compressor=dgc", "compressor.params.sample_ratio=0.02", *COMMON, "steps=2",
                  "checkpoint_every=1", f"name={os.path.basename(dgc)}", f"runs_root={root}"],
                 out=lines.append, on_change="restart")
    assert status(lines) == [f"[config changed, restarting] {dgc}"]
    assert saved_config(dgc)["compressor"]["params"]["sample_ratio"] == 0.02
    assert read_summary(dgc)["resumed_from_step"] is None  # afresh, not from the old checkpoint
    assert steps(dgc) == [0, 1] and os.path.exists(os.path.join(dgc, "DONE"))

    lines.clear()
    launch.train([*SWEEP, "steps=2", "checkpoint_every=1", f"runs_root={root}"],
                 multirun=True, out=lines.append, on_change="restart")
    assert status(lines) == [f"[done, skipped] {topk}", f"[config changed, restarting] {dgc}"]
    assert snapshot(topk) == topk_before
    assert saved_config(dgc)["compressor"]["params"]["sample_ratio"] == 0.01


def test_config_from_another_schema_reports_absent_keys(tmp_path, monkeypatch):
    (p,) = launch.plan(["compressor=topk", *COMMON, "steps=2", f"runs_root={tmp_path}"],
                       multirun=False)
    os.makedirs(p.run_dir)
    old = OmegaConf.to_container(p.cfg, resolve=True)
    del old["compressor"]["efficiency_aware"]  # a key added to the schema since
    old["retired_option"] = 7  # a key removed from it
    old["logger"]["progress"] = True  # result-neutral
    with open(os.path.join(p.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(old, f)
    with open(os.path.join(p.run_dir, "DONE"), "w"):
        pass
    no_training(monkeypatch)
    with pytest.raises(ValueError) as info:
        launch.train(["compressor=topk", *COMMON, "steps=2", f"runs_root={tmp_path}"],
                     out=lambda s: None)
    message = str(info.value)
    assert "compressor.efficiency_aware: (absent) -> false" in message
    assert "retired_option: 7 -> (absent)" in message
    assert "logger.progress" not in message and "steps:" not in message
