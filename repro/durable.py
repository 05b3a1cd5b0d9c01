"""The one way the suite writes a file: whole or not at all, durably, and never through
a link someone planted.

`write_file(path, write)` runs write(f) into a new temp file beside `path`, created
with O_CREAT|O_EXCL|O_NOFOLLOW under a name no one can predict (NAME.XXXXXXXX.tmp, from
the system's random source), fsyncs it, renames it over `path` and fsyncs the folder: a
reader sees the old file or the new one, never a part of one; a link at `path` is
replaced, not followed; the file's mode is what the umask gives a new file (0644 under
the usual 022), so teammates on shared storage can read results. `write_text` and
`write_bytes` are the common cases. Run folders, checkpoints, metrics rewrites, figure
and comparison outputs, generated configs and the data cache all go through it.

A write that fails (disk full, quota, read-only file system, permission) raises
OutputError, an OSError whose message names the file, says why in words and what to do;
the temp file is removed, so the file it would have replaced is left as it was. Temp
files a killed process left behind are removed by the next write of the same file
(`remove_stale=True`, where each file has one writer, e.g. a locked run folder).

Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import tempfile
from collections.abc import Callable
from typing import IO, Any


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
    """Remove the temp files a killed writer of `path` left beside it (the names
    write_file gives them); how many were removed."""
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
    folder (NAME.XXXXXXXX.tmp, as write_file names them;
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


_TEMP_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))


def _create_temp(path: str) -> tuple[int, str]:
    """A new, empty temp file beside `path` (NAME.XXXXXXXX.tmp), opened for writing:
    created by this call (O_EXCL: never an existing file or link), mode 0666 less the
    umask."""
    directory, base = os.path.split(os.path.abspath(path))
    for _ in range(100):
        tmp = os.path.join(directory, f"{base}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp file name", path)


def write_file(path: str | os.PathLike, write: Callable[[IO[Any]], Any], *, binary: bool = False,
               remove_stale: bool = True, consequence: str = "") -> None:
    """write(f) into a new temp file beside `path` (text, UTF-8, no newline translation,
    or binary), fsync, rename over `path`, fsync the folder. On failure the temp file is
    removed and `path` is left as it was; a failure of the file system raises OutputError
    naming `path` (`consequence` says what it left behind). remove_stale=False where
    several processes may write the same file at once (a shared cache): their temp
    files are then never taken for a killed writer's."""
    path = os.fspath(path)
    if remove_stale:
        remove_stale_temps(path)
    tmp = None
    try:
        fd, tmp = _create_temp(path)
        opened = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")
        with opened as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except Exception as exc:
        error = exc if isinstance(exc, OutputError) else write_error(path, exc, consequence)
        _discard_temp(tmp)
        if error is None or error is exc:
            raise
        raise error from exc
    except BaseException:
        _discard_temp(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _discard_temp(tmp: str | None) -> None:
    if tmp is not None:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass


def write_text(path: str | os.PathLike, text: str, **kwargs: Any) -> None:
    """A text file (UTF-8), whole or not at all (write_file)."""
    write_file(path, lambda f: f.write(text), **kwargs)


def write_bytes(path: str | os.PathLike, data: bytes, **kwargs: Any) -> None:
    """A binary file, whole or not at all (write_file)."""
    write_file(path, lambda f: f.write(data), binary=True, **kwargs)
