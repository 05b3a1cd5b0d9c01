"""Checkpoints that survive a kill: every file written whole or not at all, a manifest
that proves a checkpoint complete and made by this run's config, and a reader that
refuses a bad one (naming the file) and falls back to the previous good one.

    RUN_DIR/checkpoints/step_00000040/{trainer.pt, rank0.pt, ..., MANIFEST.json}
    RUN_DIR/checkpoints/LATEST            the name of the newest complete checkpoint

A checkpoint is complete once its MANIFEST.json exists: written last, after every file
of it is on disk, it names each file with its SHA-256 and the hash of the run's config.
Files are loaded with torch.load(weights_only=True): only tensors, plain containers and
the suite's own state classes (SAFE_CLASSES) are accepted, never arbitrary pickles.
Importing this module does not import torch.

Every file is written by repro.durable (temp file, fsync, rename, fsync of the folder);
a write that fails raises its OutputError, naming the file and the reason, and a
checkpoint left unfinished is removed (`failure`). Only the newest `keep` complete
checkpoints are kept (`prune`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from typing import Any

from repro.config import config_hash  # noqa: F401 - a manifest's hash; also read from here
from repro.durable import (  # noqa: F401 - OutputError & co. are also read from here
    OutputError,
    check_writable,
    free_bytes,
    fsync_dir,
    remove_stale_temps,
    remove_stale_temps_under,
    write_error,
    write_file,
)

MANIFEST = "MANIFEST.json"
POINTER = "LATEST"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class BadCheckpoint(ValueError):
    """A checkpoint that is incomplete, corrupt, or made by another config."""


def save(obj: Any, path: str) -> None:
    """torch.save into a temp file beside `path`, fsync, rename: `path` holds the old
    file or the new one, never a part of one; the temp file is removed on failure."""
    import torch

    write_file(path, lambda f: torch.save(obj, f), binary=True)


def write_text(path: str, text: str) -> None:
    """A small text file, atomically (repro.durable)."""
    write_file(path, lambda f: f.write(text))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def step_of(step_dir: str) -> int:
    """The step a checkpoint directory (step_00000040) was taken at."""
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(step_dir)))
    if match is None:
        raise ValueError(f"{step_dir} is not a checkpoint directory (step_NNNNNNNN)")
    return int(match.group(1))


def _step_dirs(ckpt_dir: str) -> list[str]:
    """The checkpoint directories' names, newest first."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    return sorted((d for d in names if _STEP_DIR.match(d)), reverse=True)


def newest_step(ckpt_dir: str) -> int | None:
    """The step of the newest sealed checkpoint (its MANIFEST written), or None."""
    for name in _step_dirs(ckpt_dir):
        if os.path.exists(os.path.join(ckpt_dir, name, MANIFEST)):
            return step_of(name)
    return None


def find(ckpt_dir: str, cfg_hash: str, needed: list[str], max_step: int | None = None,
         loadable: bool = False) -> str | None:
    """The newest valid checkpoint directory (at most at `max_step`), or None. Each newer
    one that fails check() is reported in a warning naming the file, and the previous one
    is tried. loadable=True also loads every needed file as `load` does (memory-mapped:
    the pickle is read, the tensors are not), so a checkpoint that passes its checksums
    but holds what the safe loader refuses is skipped the same way."""
    for name in _step_dirs(ckpt_dir):
        if max_step is not None and step_of(name) > max_step:
            continue
        step_dir = os.path.join(ckpt_dir, name)
        try:
            check(step_dir, cfg_hash, needed)
            if loadable:
                for file in needed:
                    load(os.path.join(step_dir, file), mmap=True)
        except BadCheckpoint as exc:
            warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
            continue
        return step_dir
    return None


def prune(ckpt_dir: str, keep: int) -> list[str]:
    """Remove all but the newest `keep` sealed checkpoints (keep=0: none removed), and
    every unsealed one (what a stopped write or prune left); the directories removed.
    Each is unsealed (its MANIFEST removed) before its files go, so a prune cut short
    never leaves a sealed checkpoint with files missing. Call once a checkpoint was
    sealed, by its one writer (rank 0)."""
    removed = []
    sealed = 0
    for name in _step_dirs(ckpt_dir):
        step_dir = os.path.join(ckpt_dir, name)
        manifest = os.path.join(step_dir, MANIFEST)
        if os.path.exists(manifest):
            sealed += 1
            if not keep or sealed <= keep:
                continue
            os.remove(manifest)
            fsync_dir(step_dir)
        shutil.rmtree(step_dir, ignore_errors=True)
        removed.append(step_dir)
    if removed:
        fsync_dir(ckpt_dir)
    return removed


def safe_classes() -> list[type]:
    """The suite's own classes that may appear in a checkpoint's state (compressor caches,
    LR schedules), allowed to torch.load(weights_only=True)."""
    from compressors.base import Segment
    from compressors.deft import Partitioning
    from compressors.powersgd import _Group, _Plan
    from compressors.quantize import Groups
    from tasks.base import _Schedule

    return [Segment, Partitioning, _Group, _Plan, Groups, _Schedule]


def load(path: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) of a checkpoint file: tensors, containers, numbers,
    strings and SAFE classes only; anything else is refused (BadCheckpoint names the file)."""
    import torch

    try:
        with torch.serialization.safe_globals(safe_classes()):
            return torch.load(path, weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise BadCheckpoint(f"{path} cannot be loaded safely: {str(exc).splitlines()[0]}") from exc
