"""Checkpoints that survive a kill: every file written whole or not at all, a manifest
that proves a checkpoint complete and made by this run's config, and a reader that
refuses a bad one (naming the file) and falls back to the previous good one.

    RUN_DIR/checkpoints/step_00000040/{trainer.pt, rank0.pt, ..., MANIFEST.json}
    RUN_DIR/checkpoints/LATEST            the name of the newest complete checkpoint

A checkpoint is complete once its MANIFEST.json exists: written last, after every file
of it is on disk, it names each file with its SHA-256 and the hash of the run's config.
Files are loaded with torch.load(weights_only=True): only tensors, plain containers and
the suite's own state classes (SAFE_CLASSES) are accepted, never arbitrary pickles.
Importing this module does not import torch (repro.logging's writer uses its helpers).

A write that fails (disk full, quota, read-only file system, permission) raises
OutputError, an OSError whose message names the file, says why in words and what to do;
the temp file is removed, so the file it would have replaced is left as it was. Temp
files a killed process left behind (NAME.XXXXXXXX.tmp) are removed by the next write of
the same file: each file has one writer, so a stale temp file is never one in use.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from typing import Any

MANIFEST = "MANIFEST.json"
POINTER = "LATEST"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class BadCheckpoint(ValueError):
    """A checkpoint that is incomplete, corrupt, or made by another config."""


class OutputError(OSError):
    """A file of a run could not be written. The message names the file, the reason in
    words (disk full, quota, read-only file system, permission) and what to do; `errno`
    is the system's error number where one was found, `path` the file or folder, `free`
    the bytes that were free on its file system when the write failed."""

    def __init__(self, message: str, err: int | None = None, path: str | None = None,
                 free: int | None = None):
        super().__init__(message)
        self.errno = err
        self.path = path
        self.free = free


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
    errno.EFBIG: "the file is too large for the file system",
    errno.EIO: "an input/output error (a failing disk or a lost network mount)",
}
_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `path` (its
    nearest existing folder), or None where that cannot be asked."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _errno_of(exc: BaseException) -> int | None:
    """The errno of the first OSError in exc's chain: torch.save reports a full disk as a
    RuntimeError ("unexpected pos") raised while handling the OSError."""
    seen = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, OSError) and node.errno is not None:
            return node.errno
        node = node.__cause__ or node.__context__
    return None


def write_error(path: str, exc: BaseException, consequence: str = "") -> OutputError | None:
    """The OutputError for a failed write of `path` (None when exc is not a failure of the
    file system: a bug, e.g. an object that cannot be pickled, is re-raised as it is).
    `consequence` says what the failure left behind; the advice follows it. Call it
    before removing what the write left, so the free space reported is the space that
    was left when it failed."""
    err = _errno_of(exc)
    free = exc.free if isinstance(exc, OutputError) and exc.free is not None else free_bytes(path)
    if err is None and free == 0:
        err = errno.ENOSPC  # torch's writer lost the OSError, the file system is full
    if err is None:
        return None
    reason = _REASONS.get(err) or os.strerror(err)
    where = os.path.dirname(os.path.abspath(path))
    message = f"cannot write {path}: {reason}"
    if err in _FULL and free is not None:
        message += f" ({free} bytes were free on the file system holding {where})"
    if consequence:
        message += f"; {consequence}"
    if err in _FULL:
        message += ("; free space (or set runs_root to a larger disk) and run the same "
                    "command again: it resumes from the last complete checkpoint, if any")
    elif err in (errno.EROFS, errno.EACCES, errno.EPERM):
        message += "; set runs_root to a folder this user can write"
    return OutputError(message, err, path, free)


def check_writable(folder: str, what: str, advice: str = "") -> None:
    """Raise OutputError naming `folder` (or its nearest existing parent, where it would
    be created) unless a file can be created there: the pre-flight check of an output
    folder, before any work whose results would have nowhere to go. The message reads
    "{what} {folder} is not writable: {reason}; {advice}"."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=".tmp", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        reason = _REASONS.get(exc.errno) or os.strerror(exc.errno or 0)
        named = existing if existing == os.path.abspath(folder) else (
            f"{existing} (where {folder} would be created)")
        message = f"{what} {named} is not writable: {reason}"
        raise OutputError(message + (f"; {advice}" if advice else ""), exc.errno,
                          existing) from exc


def remove_stale_temps(path: str) -> int:
    """Remove the temp files a killed writer of `path` left beside it (the names save,
    write_text and repro.logging's atomic writes give them); how many were removed."""
    directory, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.[A-Za-z0-9_]{8}\.tmp$")
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if pattern.match(name):
            try:
                os.remove(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def remove_stale_temps_under(run_dir: str) -> int:
    """Remove every temp file the suite's writers left anywhere in a finished run's
    folder (NAME.XXXXXXXX.tmp, as save, write_text and the metrics writer name them;
    W&B's own folder is left alone): litter of attempts killed mid-write, which nothing
    reads. Call once the run is finished and no rank writes any more."""
    pattern = re.compile(r"^.+\.[A-Za-z0-9_]{8}\.tmp$")
    removed = 0
    for folder, subfolders, names in os.walk(run_dir):
        subfolders[:] = [d for d in subfolders if d != "wandb"]
        for name in names:
            if pattern.match(name):
                try:
                    os.remove(os.path.join(folder, name))
                    removed += 1
                except OSError:  # gone already, or not ours to remove: leave it
                    pass
    return removed


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic(path: str, mode: str, write) -> None:
    """write(file) into a temp file beside `path`, fsync, rename over `path`, fsync the
    folder. On failure the temp file is removed and `path` is left as it was; a failure
    of the file system raises OutputError naming `path`."""
    remove_stale_temps(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                   dir=directory)
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except Exception as exc:
        error = exc if isinstance(exc, OutputError) else write_error(path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if error is None or error is exc:
            raise
        raise error from exc
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def save(obj: Any, path: str) -> None:
    """torch.save into a temp file beside `path`, fsync, rename: `path` holds the old
    file or the new one, never a part of one; the temp file is removed on failure."""
    import torch

    _atomic(path, "wb", lambda f: torch.save(obj, f))


def write_text(path: str, text: str) -> None:
    """A small text file, atomically (temp file, fsync, rename)."""
    _atomic(path, "w", lambda f: f.write(text))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def config_hash(cfg) -> str:
    """SHA-256 of the run's resolved config, without the keys that cannot change its
    results (repro.launch.RESULT_NEUTRAL_KEYS: where the run lives, how progress shows)."""
    from omegaconf import OmegaConf

    from repro.launch import RESULT_NEUTRAL_KEYS

    data = OmegaConf.to_container(cfg, resolve=True)

    def strip(node: Any, prefix: str = "") -> Any:
        if not isinstance(node, dict):
            return node
        return {k: strip(v, f"{prefix}{k}.") for k, v in sorted(node.items())
                if f"{prefix}{k}" not in RESULT_NEUTRAL_KEYS}

    text = json.dumps(strip(data), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def begin(step_dir: str) -> None:
    """Make step_dir ready for a checkpoint's files: created, and unsealed (its MANIFEST
    removed) if an earlier attempt sealed it, so it is never sealed while its files
    change. Call before any file of it is written (with real ranks: on rank 0, then a
    barrier)."""
    os.makedirs(step_dir, exist_ok=True)
    manifest = os.path.join(step_dir, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)
        fsync_dir(step_dir)


def discard(step_dir: str) -> None:
    """Remove an unfinished checkpoint (no MANIFEST): after a failed write, so that it
    takes no space and nothing mistakes it for a checkpoint. A sealed one is kept."""
    if os.path.isdir(step_dir) and not os.path.exists(os.path.join(step_dir, MANIFEST)):
        shutil.rmtree(step_dir, ignore_errors=True)


def failure(step_dir: str, exc: BaseException, remove: bool = True) -> BaseException:
    """After a write of checkpoint step_dir failed: remove it if unfinished (remove=True;
    with real ranks rank 0 removes it) and return the error to raise: an OutputError that
    names the file, the reason and what became of the checkpoint, or exc itself where it
    is not a failure of the file system (a bug is not dressed up as a disk error)."""
    if remove:
        discard(step_dir)
    name = os.path.basename(step_dir)
    if os.path.exists(os.path.join(step_dir, MANIFEST)):  # sealed: only LATEST failed
        consequence = f"checkpoint {name} is complete, but {POINTER} was not updated"
    else:
        consequence = f"checkpoint {name} was not finished and was removed"
    path = exc.path if isinstance(exc, OutputError) and exc.path else step_dir
    return write_error(path, exc, consequence) or exc


def finish(step_dir: str, cfg_hash: str) -> None:
    """Write step_dir's MANIFEST.json (every other file with its SHA-256, and the config
    hash), then point LATEST at step_dir: call once every file of it is saved."""
    files = sorted(f for f in os.listdir(step_dir)
                   if f != MANIFEST and not f.endswith(".tmp")
                   and os.path.isfile(os.path.join(step_dir, f)))
    manifest = {"config_hash": cfg_hash,
                "files": {f: sha256(os.path.join(step_dir, f)) for f in files}}
    write_text(os.path.join(step_dir, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    root = os.path.dirname(os.path.abspath(step_dir))
    write_text(os.path.join(root, POINTER), os.path.basename(step_dir))


def check(step_dir: str, cfg_hash: str, needed: list[str]) -> None:
    """Raise BadCheckpoint naming the file and the reason, unless step_dir is complete,
    unaltered and made under this config, and holds every file in `needed`."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        raise BadCheckpoint(f"{path} is missing: the checkpoint was not finished (the process "
                            "stopped while writing it)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files, saved_hash = manifest["files"], manifest["config_hash"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadCheckpoint(f"{path} is unreadable ({exc})") from None
    if saved_hash != cfg_hash:
        raise BadCheckpoint(f"{step_dir} was made by another config (hash {saved_hash[:12]} vs "
                            f"this run's {cfg_hash[:12]}); restart the run (--restart)")
    for name in needed:
        if name not in files:
            raise BadCheckpoint(f"{os.path.join(step_dir, name)} is not part of this "
                                "checkpoint (another number of ranks or workers?)")
    for name, digest in files.items():
        file = os.path.join(step_dir, name)
        if not os.path.exists(file):
            raise BadCheckpoint(f"{file} is missing")
        if sha256(file) != digest:
            raise BadCheckpoint(f"{file} does not match its checksum in {MANIFEST}: it was "
                                "altered or truncated")


def find(ckpt_dir: str, cfg_hash: str, needed: list[str]) -> str | None:
    """The newest valid checkpoint directory, or None. Each newer one that fails check()
    is reported in a warning naming the file, and the previous one is tried."""
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted((d for d in os.listdir(ckpt_dir) if _STEP_DIR.match(d)), reverse=True)
    for name in steps:
        step_dir = os.path.join(ckpt_dir, name)
        try:
            check(step_dir, cfg_hash, needed)
        except BadCheckpoint as exc:
            warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
            continue
        return step_dir
    return None


def safe_classes() -> list[type]:
    """The suite's own classes that may appear in a checkpoint's state (compressor caches,
    LR schedules), allowed to torch.load(weights_only=True)."""
    from compressors.base import Segment
    from compressors.deft import Partitioning
    from compressors.powersgd import _Group, _Plan
    from compressors.quantize import Groups
    from tasks.base import _Schedule

    return [Segment, Partitioning, _Group, _Plan, Groups, _Schedule]


def load(path: str) -> Any:
    """torch.load(weights_only=True) of a checkpoint file: tensors, containers, numbers,
    strings and SAFE classes only; anything else is refused (BadCheckpoint names the file)."""
    import torch

    try:
        with torch.serialization.safe_globals(safe_classes()):
            return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise BadCheckpoint(f"{path} cannot be loaded safely: {str(exc).splitlines()[0]}") from exc
