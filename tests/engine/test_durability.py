"""What a run leaves when its disk fills up or its folder is read-only, and what it never
writes: a training run whose runs folder is a tiny tmpfs ends with an error naming the
file and saying the disk is full, leaves no DONE, no summary.json and no sealed partial
checkpoint, and the same command finishes it once there is room; a read-only runs folder
is refused before any run starts. Also: no token from the environment reaches a run's
files, every torch.load of the suite is weights_only=True or says why not, and nothing
starts a shell.

The disk tests mount tmpfs folders (root only): where mounting is impossible they skip,
saying why.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from repro import checkpoints, launch
from repro.logging import parse_metrics, read_metrics, read_summary

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["compressor=dgc", "compressor.ratio=0.05", "task=cifar10_mixer", "task.size=smoke",
          "eval_every=0", "eval_batches=1", "cluster.threads_per_worker=1", "logger=local",
          "logger.progress=false"]
SIMULATED = [*COMMON, "cluster=simulated", "cluster.workers=2", "keep_checkpoints=0"]
NEEDED = ["trainer.pt", "workers.pt"]


def _mount_problem() -> str | None:
    """Why tmpfs folders cannot be mounted here (None: they can)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount command"
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"durability-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.strip()}"
        subprocess.run(["umount", str(probe)], check=True)
        return None
    finally:
        probe.rmdir()


MOUNT_PROBLEM = _mount_problem()
needs_mount = pytest.mark.skipif(MOUNT_PROBLEM is not None, reason=f"{MOUNT_PROBLEM}")


@contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at path for the block; unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
        if subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def fill(folder: Path) -> Path:
    """Fill the file system holding folder: a file grown until the disk is full."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = b"\0" * 65536
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def run_dir_of(overrides: list[str]) -> str:
    return launch.plan(overrides, multirun=False)[0].run_dir


def assert_nothing_finished(run_dir: str, overrides: list[str], needed=NEEDED) -> None:
    """No DONE, no summary.json, and every checkpoint either sealed (then complete,
    unaltered and made by this config) or without a MANIFEST (checkpoints.find skips it)."""
    assert not os.path.exists(os.path.join(run_dir, "DONE"))
    assert read_summary(run_dir) is None
    cfg_hash = checkpoints.config_hash(launch.plan(overrides, multirun=False)[0].cfg)
    ckpt = os.path.join(run_dir, "checkpoints")
    for name in sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []:
        step_dir = os.path.join(ckpt, name)
        if os.path.exists(os.path.join(step_dir, checkpoints.MANIFEST)):
            checkpoints.check(step_dir, cfg_hash, needed)


def losses(run_dir: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 6-step run (checkpoint every step) on a roomy disk: its metrics
    and the size of one checkpoint."""
    root = tmp_path_factory.mktemp("reference")
    ov = [*SIMULATED, "steps=6", "checkpoint_every=1", f"runs_root={root}"]
    (run_dir,) = launch.train(ov, out=lambda s: None)
    step = Path(run_dir, "checkpoints", "step_00000001")
    size = sum(f.stat().st_size for f in step.iterdir())
    return {"losses": losses(run_dir), "checkpoint_bytes": size,
            "summary": read_summary(run_dir)}


# -- disk full -----------------------------------------------------------------------------
@needs_mount
@pytest.mark.slow
def test_checkpoint_on_a_full_disk_names_the_file_and_the_rerun_resumes(tmp_path, reference):
    """Room for two checkpoints: the third fails with ENOSPC. The error names the file
    and says the disk is full; the unfinished checkpoint is removed, nothing looks
    finished; with the same folder remounted larger, the same command resumes from
    the second checkpoint and ends as the uninterrupted run does."""
    mnt = tmp_path / "disk"
    size_kib = int(2.5 * reference["checkpoint_bytes"] / 1024) + 64
    ov = [*SIMULATED, "steps=6", "checkpoint_every=1", f"runs_root={mnt}"]
    with tmpfs(mnt, f"{size_kib}k"):
        run_dir = run_dir_of(ov)
        with pytest.raises(checkpoints.OutputError) as info:
            launch.train(ov, out=lambda s: None)
        message = str(info.value)
        assert "the disk is full" in message
        assert os.path.join(run_dir, "checkpoints", "step_00000003") in message
        assert "was not finished and was removed" in message
        assert "run the same command again" in message
        assert info.value.errno == 28
        assert_nothing_finished(run_dir, ov)
        ckpt = os.path.join(run_dir, "checkpoints")
        assert sorted(d for d in os.listdir(ckpt) if d.startswith("step_")) == [
            "step_00000001", "step_00000002"]  # the unfinished step_00000003 is gone
        assert not [f for _, _, fs in os.walk(run_dir) for f in fs if f.endswith(".tmp")]
        steps, torn = parse_metrics(os.path.join(run_dir, "metrics.jsonl"))
        assert not torn and [r["step"] for r in steps] == [0, 1, 2]

        remount(mnt, "size=64m")
        launch.train(ov, out=lambda s: None)
        assert read_summary(run_dir)["resumed_from_step"] == 2
        assert Path(run_dir, "DONE").read_text() == "6\n"
        assert losses(run_dir) == reference["losses"]


@needs_mount
@pytest.mark.slow
def test_metrics_on_a_full_disk_keep_complete_lines_and_the_rerun_restarts(tmp_path):
    """No checkpoints, a 20 KiB disk: metrics.jsonl fills it. The error names the file,
    says the disk is full and which step's line was not written; the file still ends
    with a complete line (the part of the failed line is cut off). After the test frees
    space (a larger remount), the same command restarts from step 0 and completes."""
    mnt = tmp_path / "disk"
    ov = [*SIMULATED, "steps=60", "checkpoint_every=0", f"runs_root={mnt}"]
    with tmpfs(mnt, "20k"):
        run_dir = run_dir_of(ov)
        with pytest.raises(checkpoints.OutputError) as info:
            launch.train(ov, out=lambda s: None)
        message = str(info.value)
        path = os.path.join(run_dir, "metrics.jsonl")
        assert f"cannot write {path}: the disk is full" in message
        records, torn = parse_metrics(path)
        assert not torn
        with open(path, "rb") as f:
            assert f.read().endswith(b"}\n")
        last = records[-1]["step"]
        assert f"the line of step {last + 1} was not written" in message
        assert 0 < len(records) < 60
        assert_nothing_finished(run_dir, ov)

        remount(mnt, "size=64m")
        launch.train(ov, out=lambda s: None)
        summary = read_summary(run_dir)
        assert summary["resumed_from_step"] is None and summary["steps"] == 60
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(60))
        assert os.path.exists(os.path.join(run_dir, "DONE"))


@needs_mount
@pytest.mark.parametrize("full_after", ["metrics", "summary"])
@pytest.mark.slow
def test_final_writes_on_a_full_disk_leave_neither_summary_nor_done(
        tmp_path, monkeypatch, reference, full_after):
    """The disk fills up at the end of the run: before summary.json is written, or after
    it and before DONE. Either way neither file is left (the run never looks finished),
    the error names the file; after the filler is removed the same command resumes from
    the last checkpoint (the final step) and marks the run finished."""
    import repro.logging as rlog

    mnt = tmp_path / "disk"
    ov = [*SIMULATED, "steps=6", "checkpoint_every=6", f"runs_root={mnt}"]
    with tmpfs(mnt, "8m"):
        run_dir = run_dir_of(ov)
        filler: list[Path] = []
        if full_after == "metrics":
            original = rlog.sanitise

            def full_then_sanitise(obj):
                filler.append(fill(mnt))
                return original(obj)

            monkeypatch.setattr(rlog, "sanitise", full_then_sanitise)
            expected = os.path.join(run_dir, "summary.json")
        else:
            original = rlog.write_summary

            def write_then_full(*args, **kwargs):
                original(*args, **kwargs)
                filler.append(fill(mnt))

            monkeypatch.setattr(rlog, "write_summary", write_then_full)
            expected = os.path.join(run_dir, "DONE")
        with pytest.raises(checkpoints.OutputError) as info:
            launch.train(ov, out=lambda s: None)
        monkeypatch.undo()
        message = str(info.value)
        assert f"cannot write {expected}: the disk is full" in message
        assert "the run is not marked finished (no summary.json, no DONE)" in message
        assert not os.path.exists(os.path.join(run_dir, "summary.json"))
        assert not os.path.exists(os.path.join(run_dir, "DONE"))
        assert not [f for f in os.listdir(run_dir) if f.endswith(".tmp")]

        filler[0].unlink()
        launch.train(ov, out=lambda s: None)
        summary = read_summary(run_dir)
        assert summary["resumed_from_step"] == 6 and summary["steps"] == 6
        assert Path(run_dir, "DONE").read_text() == "6\n"
        assert losses(run_dir) == reference["losses"]


@needs_mount
@pytest.mark.distributed
def test_real_ranks_stop_together_when_a_checkpoint_does_not_fit(tmp_path):
    """Two gloo ranks, a disk with room for the config and the metrics but not for a
    checkpoint: the launch fails with the message naming the file and the full disk,
    well within cluster.timeout_s (no rank waits for the one that failed), and leaves
    no sealed checkpoint, no summary, no DONE."""
    mnt = tmp_path / "disk"
    ov = [*COMMON, "cluster=local_cpu", "steps=4", "checkpoint_every=2",
          "cluster.timeout_s=120", f"runs_root={mnt}"]
    with tmpfs(mnt, "96k"):
        run_dir = run_dir_of(ov)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            launch.train(ov, out=lambda s: None)
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert "the disk is full" in message and "checkpoints/step_00000002" in message
        assert elapsed < 120
        assert not os.path.exists(os.path.join(run_dir, "DONE"))
        assert read_summary(run_dir) is None
        ckpt = os.path.join(run_dir, "checkpoints")
        for name in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
            assert not os.path.exists(os.path.join(ckpt, name, checkpoints.MANIFEST)), name


# -- read-only folders ---------------------------------------------------------------------
@needs_mount
def test_read_only_runs_folder_fails_before_any_run_starts(tmp_path, monkeypatch):
    """A sweep into a read-only runs folder: one error naming the folder and saying it is
    read-only, raised before the first run is launched; nothing is created."""
    mnt = tmp_path / "ro"
    started = []
    monkeypatch.setattr(launch, "launch", lambda p: started.append(p.run_dir))
    with tmpfs(mnt, "1m"):
        remount(mnt, "ro")
        with pytest.raises(checkpoints.OutputError) as info:
            launch.train([*SIMULATED, "steps=2", "seed=0,1", f"runs_root={mnt / 'runs'}"],
                         multirun=True, out=lambda s: None)
        message = str(info.value)
        assert str(mnt) in message and "the file system is read-only" in message
        assert "nothing was run" in message
        assert info.value.errno == 30
        assert started == []
        assert os.listdir(mnt) == []


@needs_mount
@pytest.mark.slow
def test_finished_runs_in_a_read_only_folder_are_skipped_and_readable(tmp_path, monkeypatch):
    """The pre-flight check refuses only runs that would write: a sweep whose runs are
    all DONE in a read-only folder is skipped without error, and reading it works."""
    mnt = tmp_path / "ro"
    ov = [*SIMULATED, "steps=2", f"runs_root={mnt}"]
    with tmpfs(mnt, "16m"):
        (run_dir,) = launch.train(ov, out=lambda s: None)
        remount(mnt, "ro")
        said: list[str] = []
        assert launch.train(ov, out=said.append) == [run_dir]
        assert said == [f"[done, skipped] {run_dir}"]
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]


# -- the checkpoint writer ------------------------------------------------------------------
def test_a_rewritten_checkpoint_is_unsealed_first_and_stale_temps_are_removed(tmp_path):
    """begin() removes an earlier MANIFEST before any file of the step changes (so a
    half-rewritten checkpoint is never sealed), and a save removes the temp files a
    killed writer of the same file left."""
    step = tmp_path / "checkpoints" / "step_00000002"
    checkpoints.begin(str(step))
    checkpoints.save({"a": 1}, str(step / "trainer.pt"))
    checkpoints.finish(str(step), "h")
    checkpoints.check(str(step), "h", ["trainer.pt"])
    stale = step / "trainer.pt.abcd1234.tmp"
    stale.write_bytes(b"half a file")
    other = step / "rank1.pt.abcd1234.tmp"  # another writer's file: kept
    other.write_bytes(b"x")
    checkpoints.begin(str(step))
    with pytest.raises(checkpoints.BadCheckpoint, match="MANIFEST.json is missing"):
        checkpoints.check(str(step), "h", ["trainer.pt"])
    checkpoints.save({"a": 2}, str(step / "trainer.pt"))
    assert not stale.exists() and other.exists()
    assert checkpoints.load(str(step / "trainer.pt")) == {"a": 2}


def test_a_failure_that_is_not_the_disk_is_not_reported_as_one(tmp_path):
    """An object torch cannot pickle is a bug: it is raised as it is, not as an
    OutputError, and no temp file is left."""
    with pytest.raises(Exception) as info:
        checkpoints.save({"f": lambda: 0}, str(tmp_path / "x.pt"))
    assert not isinstance(info.value, checkpoints.OutputError)
    assert os.listdir(tmp_path) == []


# -- secrets and code hygiene ---------------------------------------------------------------
@pytest.mark.slow
def test_no_token_from_the_environment_reaches_the_run_folder(tmp_path, monkeypatch):
    """W&B in offline mode with a W&B key and other tokens in the environment: no file of
    the run folder (config.yaml, metrics.jsonl, summary.json, the W&B offline folder,
    checkpoints) holds any of them."""
    pytest.importorskip("wandb")
    secrets = {"WANDB_API_KEY": "local-" + "7" * 40, "HF_TOKEN": "hf_" + "Q" * 34,
               "GITHUB_TOKEN": "ghp_" + "Z" * 36}
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ov = [*SIMULATED, "steps=2", "checkpoint_every=1", "logger=wandb_offline",
          "logger.progress=false", f"runs_root={tmp_path}"]
    (run_dir,) = launch.train(ov, out=lambda s: None)
    files = [Path(d, f) for d, _, fs in os.walk(run_dir) for f in fs]
    assert any("wandb" in p.parts for p in files), "W&B wrote nothing: the check saw no W&B files"
    for path in files:
        data = path.read_bytes()
        for key, value in secrets.items():
            assert value.encode() not in data, f"{key} found in {path}"


@functools.cache
def _python_files() -> tuple[tuple[Path, str, ast.Module], ...]:
    """(path, text, syntax tree) of the suite's own Python files, read and parsed once for
    the checks below; the walk never descends into the skipped folders (.venv alone holds
    tens of thousands of files)."""
    skip = {".venv", ".git", "build", "node_modules", "tests"}
    found = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(names):
            if name.endswith(".py"):
                path = Path(base, name)
                text = path.read_text(encoding="utf-8")
                found.append((path, text, ast.parse(text, str(path))))
    return tuple(found)


def test_every_torch_load_is_weights_only_or_says_why():
    """Each torch.load call in the suite's code passes weights_only=True, or the lines
    just above it carry a comment starting "weights_only=False:" that says why."""
    offenders = []
    for path, text, tree in _python_files():
        if "torch.load" not in text:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "load" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"):
                continue
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                       and k.value.value is True for k in node.keywords)
            above = "\n".join(lines[max(0, node.lineno - 4):node.lineno])
            if not safe and "weights_only=False:" not in above:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], f"torch.load without weights_only=True or a reason: {offenders}"


def test_nothing_starts_a_shell():
    """No subprocess call with shell=True, no os.system / os.popen: commands are argument
    lists, so no value from a config or the command line is ever parsed by a shell."""
    offenders = []
    for path, _, tree in _python_files():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("os.system", "os.popen"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
            for k in node.keywords:
                if k.arg == "shell" and not (isinstance(k.value, ast.Constant) and not k.value.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} shell=")
    assert offenders == []


@pytest.mark.parametrize("mode, who", [(0o777, "any user"), (0o770, "its group")])
def test_native_cache_owned_or_writable_by_others_is_refused(tmp_path, monkeypatch, mode, who):
    """The C++ library is loaded into the process: a cache folder any user or its group
    may write (or one another user owns) is refused, naming it and the fix, before
    anything is built."""
    from compressors.kernels import build

    open_folder = tmp_path / "cache"
    open_folder.mkdir()
    open_folder.chmod(mode)
    monkeypatch.setenv("GRADCOMP_NATIVE_CACHE", str(open_folder))
    with pytest.raises(RuntimeError, match=f"may be written by {who}.*GRADCOMP_NATIVE_CACHE"):
        build._build("c++")
    assert list(open_folder.iterdir()) == []
    open_folder.chmod(0o700)
    if os.getuid() == 0:  # root can hand the folder to another user
        os.chown(open_folder, 12345, 12345)
        with pytest.raises(RuntimeError, match="belongs to user id 12345"):
            build._build("c++")
