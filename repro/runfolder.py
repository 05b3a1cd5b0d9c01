"""A run folder's own guards: the marker that proves it a run of this suite, and the
lock that keeps one launch at a time in it.

    RUN_DIR/.gradcomp-run   written when `repro train` prepares the folder; `--restart`
                            deletes only a folder that holds it
    RUN_DIR/.lock           an exclusive flock(2) held by the launch that runs in the
                            folder, holding "pid@host" of that launch

The lock is the kernel's: it goes when its holder ends, however it ends (a killed run
never blocks the next one), and it works across the hosts of a shared file system that
supports flock (NFSv4, Lustre, GPFS). A second launch of the same run names the holder
and stops (RunInUse), or waits for it (`wait=True`, `repro train --wait`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

MARKER = ".gradcomp-run"
LOCK = ".lock"
_MARKER_TEXT = "a run folder of gradcomp-repro (repro train); --restart may delete it\n"


class RunInUse(RuntimeError):
    """Another launch holds the run folder's lock."""


def holder(run_dir: str) -> str:
    """'pid@host' of the launch that holds the folder's lock, as it wrote it."""
    try:
        with open(os.path.join(run_dir, LOCK), encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return text or "an unknown process"


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False


@contextmanager
def locked(run_dir: str, wait: bool = False, out: Callable[[str], None] | None = None,
           give_up: Callable[[], bool] | None = None, poll_s: float = 0.2) -> Iterator[None]:
    """Hold the run folder's lock for the block (creating the folder). Held by another
    launch: RunInUse naming it, or with wait=True a line to `out` and a wait, which ends
    with RunInUse as soon as give_up() says so (a signal to stop)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        if not _try_lock(fd):
            who = holder(run_dir)
            if not wait:
                raise RunInUse(
                    f"{run_dir} is in use by process {who}, which is running this run; nothing "
                    "was run: wait for it to end, or pass --wait to wait for it")
            if out is not None:
                out(f"waiting: {run_dir} is in use by process {who}")
            while not _try_lock(fd):
                if give_up is not None and give_up():
                    raise RunInUse(f"stopped waiting for {run_dir} (in use by process "
                                   f"{holder(run_dir)}); nothing was run")
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def mark(run_dir: str) -> None:
    """Write the marker that makes run_dir one `--restart` may delete."""
    from repro.durable import write_text

    if not os.path.exists(os.path.join(run_dir, MARKER)):
        write_text(os.path.join(run_dir, MARKER), _MARKER_TEXT)


def not_deletable(run_dir: str) -> str | None:
    """Why run_dir must not be deleted by `--restart` (None: it may be, or it is absent):
    a link, not a folder, or a folder without the marker, i.e. not one `repro train`
    made."""
    try:
        st = os.lstat(run_dir)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{run_dir} is a symbolic link, not a run folder"
    if not stat.S_ISDIR(st.st_mode):
        return f"{run_dir} is not a folder"
    names = set(os.listdir(run_dir))
    if MARKER not in names and names - {LOCK}:
        return (f"{run_dir} holds no {MARKER}, so it is not a run folder that repro train made "
                "and --restart does not delete it: move it away or delete it yourself, or give "
                "this run another name= / group=")
    return None


def contents(run_dir: str) -> str:
    """'N files, B bytes: a, b/, ...' of run_dir (the lock file aside)."""
    files = size = 0
    for folder, _, names in os.walk(run_dir):
        for name in names:
            if folder == run_dir and name == LOCK:
                continue
            files += 1
            try:
                size += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    top = sorted(n + ("/" if os.path.isdir(os.path.join(run_dir, n)) else "")
                 for n in os.listdir(run_dir) if n != LOCK)
    shown = ", ".join(top[:8]) + (", ..." if len(top) > 8 else "")
    return f"{files} files, {size} bytes: {shown}"


def clear(run_dir: str) -> None:
    """Delete everything in run_dir but its lock (held by this launch: other launches
    must keep meeting the same file), after not_deletable allowed it."""
    problem = not_deletable(run_dir)
    if problem is not None:
        raise ValueError(problem)
    if not os.path.exists(run_dir):
        return
    for name in os.listdir(run_dir):
        if name == LOCK:
            continue
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
