"""Runs at the edges a shared cluster reaches: run names that are not folder names, a
`--restart` aimed at a folder the suite did not make, two launches of one run, a
metrics file that lost lines, NaN-skipped steps across a resume, a planted data-cache
file, files written through links and with the wrong mode, signals to the launcher,
values that pass a type check but not a run (an infinite timeout, a million workers,
gradients too large to compress), a checkpoint the safe loader refuses, a failure's last
line, and cache folders others may write.

The runs train the smoke NCF on 2 simulated workers for 6 steps (a second each) with
random-k, whose indices come from the step's shared seed, so a step counted wrongly
after a resume shows in every later loss. Rank 1's gradient is NaN at step 1 and
nonfinite=skip skips that step on every worker.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from repro import checkpoints, launch
from repro.logging import parse_metrics, read_summary

COMMON = ["compressor=randomk", "compressor.ratio=0.05", "task=movielens_ncf", "task.size=smoke",
          "steps=6", "eval_every=0", "eval_batches=1", "checkpoint_every=2",
          "keep_checkpoints=0", "nonfinite=skip", "cluster=simulated", "cluster.workers=2",
          "cluster.threads_per_worker=1", "logger=local", "logger.progress=false"]
NAN_AT = "1:1"  # GRADCOMP_NAN_AT_STEP: rank 1's loss is NaN at step 1
TIMED = ("wall_time", "step_s", "comm_s", "compute_s", "compress_s", "samples_per_s")
ROOT = Path(__file__).resolve().parents[2]


class Killed(Exception):
    pass


def comparable(run_dir: str) -> list[dict]:
    """metrics.jsonl without the wall-clock values (they differ between any two runs)."""
    records, _ = parse_metrics(os.path.join(run_dir, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if k not in TIMED and not k.startswith("projected/")}
            for r in records]


def train(root, *extra: str, out=None, **kwargs) -> str:
    lines = [] if out is None else out
    (run_dir,) = launch.train([*COMMON, *extra, f"runs_root={root}"], out=lines.append, **kwargs)
    return run_dir


def killed_at(monkeypatch, step: int) -> None:
    """The next run dies (as if killed) when it reaches `step` (GRADCOMP_FAIL_AT_STEP)."""
    def die(code):
        raise Killed(code)

    monkeypatch.setenv("GRADCOMP_FAIL_AT_STEP", f"{step}:0")
    monkeypatch.setattr(os, "_exit", die)


def revive(monkeypatch) -> None:
    monkeypatch.delenv("GRADCOMP_FAIL_AT_STEP")
    monkeypatch.setattr(os, "_exit", _REAL_EXIT)


_REAL_EXIT = os._exit


@pytest.fixture(autouse=True)
def nan_at_step_one(monkeypatch):
    monkeypatch.setenv("GRADCOMP_NAN_AT_STEP", NAN_AT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of COMMON, simulated and replicas: (run dir, metrics)."""
    old = os.environ.get("GRADCOMP_NAN_AT_STEP")
    os.environ["GRADCOMP_NAN_AT_STEP"] = NAN_AT
    try:
        out = {}
        for mode in ("simulated", "replicas"):
            run_dir = train(tmp_path_factory.mktemp(f"reference-{mode}"), f"cluster.mode={mode}")
            out[mode] = (run_dir, comparable(run_dir))
    finally:
        if old is None:
            os.environ.pop("GRADCOMP_NAN_AT_STEP", None)
        else:
            os.environ["GRADCOMP_NAN_AT_STEP"] = old
    records = out["simulated"][1]
    assert records[1].get("skipped") == 1 and "skipped" not in records[2]
    return out


# -- 1. names and --restart -------------------------------------------------------------------
@pytest.mark.parametrize("override", ["name=..", "name=.", "group=.", "name=a/b", "group=/tmp",
                                      "name=../../outside"])
def test_names_are_single_folder_names(tmp_path, override):
    with pytest.raises(ValueError, match="must be one folder name"):
        launch.plan([*COMMON, f"runs_root={tmp_path / 'runs'}", override], multirun=False)


def test_restart_deletes_only_run_folders_and_says_what_it_deletes(tmp_path):
    """A folder the suite did not make (no marker) sits where a run would go: --restart
    refuses it, naming it, and deletes nothing; a real run's folder is listed by
    --dry-run --restart and deleted, named, by --restart."""
    root = tmp_path / "runs"
    foreign = root / "default" / "mine"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("not a run")
    with pytest.raises(ValueError, match=r"mine holds no \.gradcomp-run.*nothing was deleted"
                       r"|nothing was deleted.*mine holds no \.gradcomp-run"):
        train(root, "name=mine", restart=True)
    assert (foreign / "notes.txt").read_text() == "not a run"

    run_dir = Path(train(root, "name=run", "steps=2"))
    (run_dir / "error.log").write_text("from an earlier attempt")
    before = sorted(p.name for p in run_dir.iterdir())
    lines: list[str] = []
    train(root, "name=run", "steps=2", restart=True, dry_run=True, out=lines)
    assert lines[0] == f"[would restart] {run_dir}"
    assert lines[1].startswith(f"  would delete {run_dir} (") and "metrics.jsonl" in lines[1]
    assert sorted(p.name for p in run_dir.iterdir()) == before  # a dry run deletes nothing
    lines.clear()
    train(root, "name=run", "steps=2", restart=True, out=lines)
    assert lines[0].startswith(f"  deleting {run_dir} (") and lines[1] == f"[restarting] {run_dir}"
    assert not (run_dir / "error.log").exists()
    assert [r["step"] for r in comparable(str(run_dir))] == [0, 1]


# -- 2. one launch at a time ------------------------------------------------------------------
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"4242@otherhost")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold_lock(run_dir: Path, seconds: float) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir / ".lock"),
                               str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_launch_of_a_running_run_names_the_holder_or_waits(tmp_path, capsys):
    """While another process holds the run folder's lock, a launch stops with exit 1,
    naming it, and writes nothing; with --wait it waits (until a signal, or the lock is
    free) and then runs; a holder that was killed never blocks."""
    from repro import cli

    root = tmp_path / "runs"
    run_dir = root / "default" / "locked"
    holder = hold_lock(run_dir, 60)
    try:
        code = cli.main(["train", *COMMON, "steps=1", "name=locked", f"runs_root={root}"])
        err = capsys.readouterr().err
        assert code == 1
        assert f"{run_dir} is in use by process 4242@otherhost" in err and "--wait" in err
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
        # waiting (--wait) ends at a signal, having run nothing
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        with pytest.raises(RuntimeError, match="stopped waiting for .*4242@otherhost.*nothing "
                                               "was run"):
            train(root, "steps=1", "name=locked", wait=True)
        timer.join()
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    # killed holder: the kernel released its lock
    assert train(root, "steps=1", "name=locked") == str(run_dir)
    assert read_summary(str(run_dir))["steps"] == 1

    holder = hold_lock(root / "default" / "waits", 1.5)
    lines: list[str] = []
    t0 = time.monotonic()
    train(root, "steps=1", "name=waits", wait=True, out=lines)
    holder.wait()
    assert lines[0] == f"waiting: {root / 'default' / 'waits'} is in use by process 4242@otherhost"
    assert time.monotonic() - t0 >= 1.0
    assert os.path.exists(root / "default" / "waits" / "DONE")


def test_the_lock_file_names_this_launch_while_it_runs(tmp_path):
    from repro import runfolder

    run_dir = tmp_path / "run"
    with runfolder.locked(str(run_dir)):
        assert runfolder.holder(str(run_dir)) == f"{os.getpid()}@{socket.gethostname()}"
        with pytest.raises(runfolder.RunInUse, match=f"in use by process {os.getpid()}@"), \
                runfolder.locked(str(run_dir)):
            pass


# -- 3. metrics that miss steps ---------------------------------------------------------------
def test_resume_never_trusts_metrics_that_miss_steps(tmp_path, reference, monkeypatch):
    """An unfinished run (checkpoints at steps 2, 4, 6) whose metrics.jsonl lost its
    lines from step 3 on resumes from the checkpoint they still cover (step 2) and ends
    as the uninterrupted run; with metrics.jsonl deleted no checkpoint is covered: the
    run is refused, naming the file and the steps, and not marked done."""
    ref_dir, ref = reference["simulated"]
    run_dir = tmp_path / "runs" / "default" / os.path.basename(ref_dir)
    shutil.copytree(ref_dir, run_dir)
    for name in ("DONE", "summary.json"):
        (run_dir / name).unlink()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]))
    with pytest.warns(RuntimeWarning, match="resuming from .*step_00000002.*lacks the lines"):
        train(tmp_path / "runs")
    assert comparable(str(run_dir)) == ref
    assert read_summary(str(run_dir))["resumed_from_step"] == 2

    for name in ("DONE", "summary.json", "metrics.jsonl"):
        (run_dir / name).unlink()
    with pytest.raises(RuntimeError, match=r"metrics.jsonl lacks the lines of 6 step\(s\) "
                                         r"\(0, 1, 2, 3, 4, \.\.\.\)"):
        train(tmp_path / "runs")
    assert not (run_dir / "DONE").exists()


def test_a_run_whose_metrics_lost_a_line_is_not_marked_done(tmp_path, monkeypatch):
    """A line that never reached metrics.jsonl (another writer, a hand): no DONE."""
    from repro import logging as logging_mod

    real = logging_mod.MetricsWriter.log

    def lossy(self, step, **metrics):
        if step != 2:
            real(self, step, **metrics)

    monkeypatch.setattr(logging_mod.MetricsWriter, "log", lossy)
    with pytest.raises(RuntimeError, match=r"not marked finished: .*lacks the lines of 1 step"):
        run_dir = train(tmp_path, "steps=4")
    run_dir = launch.plan([*COMMON, "steps=4", f"runs_root={tmp_path}"], False)[0].run_dir
    assert not os.path.exists(os.path.join(run_dir, "DONE"))
    assert read_summary(run_dir) is None


# -- 4. nonfinite=skip across a resume ----------------------------------------------------------
@pytest.mark.parametrize("mode", ["simulated", "replicas"])
def test_skipped_steps_survive_a_resume(tmp_path, reference, monkeypatch, mode):
    """Killed at step 5 after the NaN step 1 was skipped, resumed from the checkpoint at
    step 4: the count of skipped steps comes back with it, so the exchanges' random
    streams and every later loss equal the uninterrupted run's."""
    killed_at(monkeypatch, 5)
    with pytest.raises(Killed):
        train(tmp_path, f"cluster.mode={mode}")
    revive(monkeypatch)
    run_dir = train(tmp_path, f"cluster.mode={mode}")
    assert read_summary(run_dir)["resumed_from_step"] == 4
    assert comparable(run_dir) == reference[mode][1]


# -- 5. the derived-data cache ------------------------------------------------------------------
class _Planted:
    """What another user could plant: unpickling it creates a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_derived_data_cache_runs_no_pickle_and_refuses_foreign_folders(tmp_path, monkeypatch):
    from tasks import data

    monkeypatch.setenv("GRADCOMP_DATA", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_MEMO", {})
    derived = tmp_path / "cache" / "derived"
    derived.mkdir(parents=True, mode=0o700)
    ran = tmp_path / "planted-code-ran"
    for name in ("entry.pt", "entry.npz"):
        (derived / name).write_bytes(pickle.dumps({"x": _Planted(str(ran))}))
    value = {"ids": torch.arange(6).view(2, 3), "labels": (torch.ones(2), [1, "a", None]),
             "ratings": torch.arange(4).numpy()}
    got = data.disk_cache("entry", lambda: value)
    assert not ran.exists()
    assert torch.equal(got["ids"], value["ids"])
    # What the next process reads back: the same values, loaded without pickle.
    back = data.load_derived(derived / "entry.npz")
    assert torch.equal(back["ids"], value["ids"]) and back["labels"][1] == [1, "a", None]
    assert (back["ratings"] == value["ratings"]).all() and isinstance(back["labels"], tuple)
    import numpy as np

    with np.load(derived / "entry.npz", allow_pickle=False) as npz:  # no object arrays
        assert not any(npz[k].dtype.hasobject for k in npz.files)

    # a folder its group may write, or one another user owns, is not used
    for folder_mode, owner in ((0o770, None), (0o700, 12345)):
        monkeypatch.setattr(data, "_MEMO", {})
        shutil.rmtree(derived)
        derived.mkdir(mode=folder_mode)
        derived.chmod(folder_mode)
        if owner is not None:
            if os.getuid() != 0:
                continue
            os.chown(derived, owner, owner)
        calls: list[int] = []

        def make(calls=calls):
            calls.append(1)
            return value

        with pytest.warns(RuntimeWarning, match="derived-data cache is not used: .*derived (may be "
                                                "written by its group|belongs to user id 12345)"):
            data.disk_cache("entry", make)
        assert calls == [1] and list(derived.iterdir()) == []


# -- 6. one durable writer ----------------------------------------------------------------------
def test_config_save_does_not_follow_a_planted_link(tmp_path):
    from repro import config as config_mod

    cfg = launch.plan([*COMMON, f"runs_root={tmp_path}"], False)[0].cfg
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml.tmp").symlink_to(outside)
    (run / "config.yaml").symlink_to(tmp_path / "also-outside.txt")
    config_mod.save(cfg, str(run / "config.yaml"))
    assert outside.read_text() == "keep me"
    assert not (tmp_path / "also-outside.txt").exists()
    assert not (run / "config.yaml").is_symlink() and "randomk" in (run / "config.yaml").read_text()


def test_a_failed_write_names_the_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """A full disk at the fsync of config.yaml: an OutputError naming the file and the
    disk, the old file intact, no temp file; and the file is fsynced at all."""
    from repro import config as config_mod
    from repro.durable import OutputError

    cfg = launch.plan([*COMMON, f"runs_root={tmp_path}"], False)[0].cfg
    path = tmp_path / "config.yaml"
    path.write_text("old\n")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError, match=f"cannot write {path}: the disk is full"):
        config_mod.save(cfg, str(path))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["config.yaml"]


def test_run_files_take_their_mode_from_the_umask(tmp_path, reference):
    """Every file of a finished run is readable by the group and others under umask 022
    (teammates on shared storage), written by one writer; under 077 by the owner only."""
    ref_dir = reference["simulated"][0]
    for base, _, names in os.walk(ref_dir):
        for name in names:
            mode = os.stat(os.path.join(base, name)).st_mode & 0o777
            assert mode == 0o666 & ~_UMASK, (name, oct(mode))
    old = os.umask(0o077)
    try:
        from repro.durable import write_text

        write_text(str(tmp_path / "private.txt"), "x")
    finally:
        os.umask(old)
    assert (tmp_path / "private.txt").stat().st_mode & 0o777 == 0o600


_UMASK = os.umask(0)
os.umask(_UMASK)


# The only places that may write a file other than through repro.durable: the ones that
# must write in place (metrics lines appended, the lock, the failure log) or whose file
# another program writes (the C++ library the compiler builds), by (file, function).
IN_PLACE = {("repro/logging.py", "__init__"), ("compressors/kernels/build.py", "_build")}


def _writes(node) -> str | None:
    """What a call writes a file with, if it does: open() for writing, os.replace /
    os.rename, a path's write_text / write_bytes, mkstemp, or torch.save / np.save(z) /
    savefig into something other than the writer's file object `f`."""
    import ast

    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
    args = node.args
    if name == "open" and owner is None:
        mode = args[1] if len(args) > 1 else next(
            (k.value for k in node.keywords if k.arg == "mode"), None)
        if isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+"):
            return "open"
    if name in ("replace", "rename") and owner == "os":
        return f"os.{name}"
    if name in ("write_text", "write_bytes") and isinstance(func, ast.Attribute) and len(args) == 1:
        return name  # Path.write_text(text): the suite's own take (path, text)
    if name == "mkstemp":
        return name
    saves = {("torch", "save"): 1, ("np", "save"): 0, ("np", "savez"): 0}
    index = saves.get((owner, name), 0 if name == "savefig" else None)
    if index is not None:
        target = args[index] if len(args) > index else None
        if not (isinstance(target, ast.Name) and target.id == "f"):
            return f"{owner}.{name}" if owner else name
    return None


def test_every_file_the_suite_writes_goes_through_the_one_writer():
    import ast

    offenders = []

    def visit(node, rel: str, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Call) and (kind := _writes(node)) and (rel, where) not in IN_PLACE:
            offenders.append(f"{rel}:{node.lineno} {kind} (in {where})")
        for child in ast.iter_child_nodes(node):
            visit(child, rel, where)

    for package in ("repro", "tasks", "compressors"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel != "repro/durable.py":
                visit(ast.parse(path.read_text()), rel, "<module>")
    assert offenders == []


# -- 7. signals -----------------------------------------------------------------------------------
def signal_after(lines: int, metrics: Path, signum: int = signal.SIGTERM) -> threading.Thread:
    """A thread that sends `signum` to this process (the launcher) once `metrics` holds
    `lines` lines, as a scheduler signals the `repro train` process alone."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if metrics.read_text().count("\n") >= lines:
                    break
            except OSError:
                pass
            time.sleep(0.005)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_sigterm_stops_at_the_step_with_a_checkpoint_and_the_same_command_resumes(
        tmp_path, reference, capsys):
    """SIGTERM to the launcher: the run stops at the end of the step it is in, with a
    checkpoint there (checkpoint_every=0: none otherwise), no DONE, exit 143 and one
    line; the same command resumes and ends as the uninterrupted run."""
    from repro import cli

    args = ["train", *COMMON, "checkpoint_every=0", f"runs_root={tmp_path}"]
    run_dir = Path(launch.plan(args[1:], False)[0].run_dir)
    thread = signal_after(2, run_dir / "metrics.jsonl")
    code = cli.main(args)
    thread.join()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM
    step = checkpoints.newest_step(str(run_dir / "checkpoints"))
    assert err[-1] == (f"repro train: interrupted at step {step}; checkpoint at step {step}; "
                       "the same command resumes")
    assert 2 <= step < 6 and not (run_dir / "DONE").exists()
    assert [r["step"] for r in comparable(str(run_dir))] == list(range(step))
    assert cli.main(args) == 0
    assert read_summary(str(run_dir))["resumed_from_step"] == step
    assert comparable(str(run_dir)) == reference["simulated"][1]


@pytest.mark.distributed
def test_a_signal_to_the_launcher_reaches_the_spawned_ranks(tmp_path):
    """SIGTERM to the launcher of 2 spawned gloo ranks: both ranks stop at the same step,
    rank 0 writes the checkpoint of that step with both ranks' parts, and no rank is
    left running."""
    ov = [*COMMON[:-4], "cluster.mode=spawn", "cluster.workers=2", "cluster.threads_per_worker=1",
          "logger=local", "logger.progress=false", "steps=200", "checkpoint_every=0",
          f"runs_root={tmp_path}"]
    from repro import stopping

    run_dir = Path(launch.plan(ov, False)[0].run_dir)
    thread = signal_after(3, run_dir / "metrics.jsonl")
    with pytest.raises(stopping.Interrupted) as info:
        launch.train(ov, out=lambda s: None)
    thread.join()
    step = checkpoints.newest_step(str(run_dir / "checkpoints"))
    assert str(info.value) == (f"interrupted at step {step}; checkpoint at step {step}; the "
                               "same command resumes")
    assert 3 <= step < 200 and not (run_dir / "DONE").exists()
    cfg = launch.plan(ov, False)[0].cfg
    checkpoints.check(str(run_dir / "checkpoints" / f"step_{step:08d}"),
                      checkpoints.config_hash(cfg), ["trainer.pt", "rank0.pt", "rank1.pt"])
    assert [r["step"] for r in comparable(str(run_dir))] == list(range(step))
    assert stopping.rank_processes() == []


def test_a_prune_cut_short_leaves_no_sealed_checkpoint_with_files_missing(tmp_path, monkeypatch):
    """Killed while it removes an old checkpoint's files, pruning leaves that checkpoint
    unsealed (ignored on resume, removed by the next prune), never sealed and partial."""
    ckpt = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        step_dir = str(ckpt / f"step_{step:08d}")
        checkpoints.begin(step_dir)
        for name in ("trainer.pt", "workers.pt"):
            checkpoints.save({"step": step}, os.path.join(step_dir, name))
        checkpoints.finish(step_dir, "hash")

    def cut_short(path, ignore_errors=False):
        os.remove(os.path.join(path, "workers.pt"))
        raise Killed("killed mid-prune")

    monkeypatch.setattr(shutil, "rmtree", cut_short)
    with pytest.raises(Killed):
        checkpoints.prune(str(ckpt), keep=2)
    monkeypatch.undo()
    for step_dir in sorted(ckpt.glob("step_*")):
        if (step_dir / checkpoints.MANIFEST).exists():
            checkpoints.check(str(step_dir), "hash", ["trainer.pt", "workers.pt"])
    assert checkpoints.find(str(ckpt), "hash", ["trainer.pt", "workers.pt"]).endswith("3")
    assert checkpoints.prune(str(ckpt), keep=2) == [str(ckpt / "step_00000001")]


def test_checkpoints_are_on_by_default_and_only_the_newest_are_kept(tmp_path):
    from repro.config import TrainConfig

    assert TrainConfig().checkpoint_every_s > 0 and TrainConfig().keep_checkpoints == 2
    run_dir = train(tmp_path, "steps=4", "checkpoint_every=1", "keep_checkpoints=2")
    kept = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert kept == ["LATEST", "step_00000003", "step_00000004"]


def test_without_checkpoint_at_end_a_finished_run_keeps_no_final_checkpoint(tmp_path):
    """The figure pipeline's setting: a short finished run leaves no checkpoint behind,
    and the key does not re-key the run (the same run with it on is already done)."""
    run_dir = train(tmp_path, "steps=3", "checkpoint_every=0", "checkpoint_at_end=false")
    assert os.path.exists(os.path.join(run_dir, "DONE"))
    ckpt = os.path.join(run_dir, "checkpoints")
    assert not os.path.isdir(ckpt) or not [p for p in os.listdir(ckpt) if p.startswith("step_")]
    lines: list[str] = []
    assert train(tmp_path, "steps=3", "checkpoint_every=0", out=lines) == run_dir
    assert any("skip" in line.lower() or "done" in line.lower() for line in lines), lines


# -- 8. values that pass a type check but not a run ------------------------------------------------
@pytest.mark.parametrize("override, words", [
    ("cluster.timeout_s=inf", "cluster.timeout_s=inf must be > 0 and at most 604800"),
    ("cluster.timeout_s=1e12", "at most 604800"),
    ("cluster.workers=5000", "cluster.workers=5000 is more than this suite runs (at most 1024"),
])
def test_unbounded_values_are_refused_before_any_work(tmp_path, override, words):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        launch.plan([*COMMON, override, f"runs_root={tmp_path}"], False)
    assert time.monotonic() - t0 < 30


def test_what_a_compressor_produces_is_checked_under_the_same_policy():
    """fp16 gradients each finite (30000) whose sum over 3 workers is not (65504 is the
    largest half): the aggregate is Inf although every input passed; error names it,
    skip skips the step on every worker."""
    import compressors
    from compressors import drive
    from repro.compression import NonFiniteGradient, WorkerCompression

    for policy in ("error", "skip"):
        workers = [WorkerCompression(compressors.build("topk", ratio=0.5), r, 3,
                                     nonfinite=policy, names={}) for r in range(3)]
        grads = [[("w", torch.full((8,), 30000.0, dtype=torch.float16))] for _ in range(3)]
        jobs = [w.step_job(g, 0) for w, g in zip(workers, grads)]
        if policy == "error":
            with pytest.raises(NonFiniteGradient, match="'w'.*not finite after compression by TopK"):
                for (_, finish), outcome in zip(jobs, drive([j for j, _ in jobs])):
                    finish(outcome)
        else:
            for (_, finish), outcome in zip(jobs, drive([j for j, _ in jobs])):
                finish(outcome)
            assert all(w.skipped and w.skipped_steps == 1 for w in workers)
            assert all(torch.equal(g[0][1], torch.zeros(8, dtype=torch.float16)) for g in grads)


# -- 9. a checkpoint the safe loader refuses ----------------------------------------------------------
def test_a_checkpoint_that_passes_its_checksum_but_not_the_safe_load_falls_back(
        tmp_path, reference, monkeypatch):
    """The newest checkpoint's trainer.pt holds an object the weights-only loader refuses,
    and its MANIFEST was updated to match: it is skipped with a warning naming the file,
    the previous one is resumed, and the run ends as the uninterrupted one."""
    import argparse

    killed_at(monkeypatch, 5)
    with pytest.raises(Killed):
        train(tmp_path)
    revive(monkeypatch)
    run_dir = Path(launch.plan([*COMMON, f"runs_root={tmp_path}"], False)[0].run_dir)
    step = run_dir / "checkpoints" / "step_00000004"
    trainer = step / "trainer.pt"
    torch.save({"step": 4, "extra": argparse.Namespace(x=1)}, trainer)
    manifest = json.loads((step / checkpoints.MANIFEST).read_text())
    manifest["files"]["trainer.pt"] = checkpoints.sha256(str(trainer))
    (step / checkpoints.MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match=f"skipping checkpoint: {trainer} cannot be loaded safely"):
        train(tmp_path)
    assert read_summary(str(run_dir))["resumed_from_step"] == 2
    assert comparable(str(run_dir)) == reference["simulated"][1]


# -- 10. how a failure ends ---------------------------------------------------------------------------
def test_a_failed_run_ends_with_one_line_naming_the_cause_and_the_log(tmp_path, capsys):
    from repro import cli

    args = ["train", *COMMON, f"runs_root={tmp_path}"]
    run_dir = Path(launch.plan(args[1:], False)[0].run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").write_text("a file where the checkpoints folder goes")
    code = cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    log = run_dir / "error.log"
    assert err[-1] == (f"repro train: failed: FileExistsError: [Errno 17] File exists: "
                       f"'{run_dir / 'checkpoints'}' (traceback in {log})")
    assert not any("Traceback" in line for line in err)
    text = log.read_text()
    assert text.startswith("== launcher (") and "Traceback (most recent call last)" in text


def test_a_ctrl_c_no_run_could_take_ends_with_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the command plans (before any run installs its handler), or a second
    one: exit 130 and one line, no traceback."""
    from repro import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "plan", interrupted)
    assert cli.main(["train", *COMMON, f"runs_root={tmp_path}"]) == 128 + signal.SIGINT
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["repro train: interrupted at once (before a run could stop at a step, or by a "
                   "second signal); every file written is whole and the same command goes on "
                   "from the last checkpoint"]


def test_a_failed_torchrun_rank_logs_its_traceback_and_says_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("cluster: {backend: gloo, device: cpu}\nno_such_key: 1\n")
    done = subprocess.run([sys.executable, "-m", "repro.worker", str(run_dir)], text=True,
                          capture_output=True, env={**os.environ, "RANK": "3",
                                                    "PYTHONPATH": str(ROOT)},
                          timeout=120, check=False)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1
    assert lines[0].startswith("rank 3: ") and lines[0].endswith(f"(traceback in {run_dir / 'error.log'})")
    assert "Traceback (most recent call last)" in (run_dir / "error.log").read_text()


def test_a_corrupt_summary_beside_done_is_found_when_the_run_would_be_skipped(tmp_path, reference):
    from repro.runs import load_run

    ref_dir = reference["simulated"][0]
    run_dir = tmp_path / "runs" / "default" / os.path.basename(ref_dir)
    shutil.copytree(ref_dir, run_dir)
    (run_dir / "summary.json").write_text('{"steps": 6, "wall_')
    with pytest.raises(ValueError, match=f"{run_dir / 'summary.json'} is not valid JSON"):
        train(tmp_path / "runs")
    with pytest.raises(ValueError, match=f"{run_dir / 'summary.json'} is not valid JSON"):
        load_run(str(run_dir))

