"""Stopping a run cleanly on SIGTERM or SIGINT (what SLURM, schedulers and Ctrl-C send).

The first signal is a request: `requested()` says which one came, the trainer finishes
the step it is in, every rank agrees to stop at that same step (the flag travels with
the step's loss allreduce), a checkpoint is written at that step, and the run ends
without DONE. `repro train` then says, in one line, where it stopped, which checkpoint
holds it and that the same command resumes (`interrupted_line`). A second signal stops
at once: the ranks are killed and the launcher raises KeyboardInterrupt (every file is
still whole: they are all written by repro.durable).

A signal sent to the launcher alone (a scheduler signalling the `repro train` process)
reaches the whole run: `stop_on_signals(forward=RankForwarder())` passes it on to the
ranks this process started, spawned (`torch.multiprocessing`) or under torchrun (the
ranks themselves, not torchrun's agent, which would relaunch or tear them down), once
each, also to ranks that start after the signal came. A rank takes only the first signal
(a Ctrl-C in a terminal reaches it twice: from the terminal and from the launcher); a
second one to the launcher kills the ranks.

Linux: the ranks are found in /proc; elsewhere nothing is forwarded.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []


class Interrupted(Exception):
    """A run (and the command that started it) stopped on a signal; the message is the
    one line `repro train` ends with, `signum` the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _received[0] if _received else None


def clear() -> None:
    _received.clear()


@contextmanager
def stop_on_signals(forward: Callable[[int], None] | None = None, escalate: bool = True,
                    repeat_s: float = 0.25) -> Iterator[None]:
    """Within the block the first SIGINT / SIGTERM is recorded (`requested`) and passed
    to forward(signum), and again every `repeat_s` seconds until the block ends (for
    ranks that start later: forward must signal each process once). With `escalate` a
    second signal passes SIGKILL to forward and ends this process as the signal would
    (KeyboardInterrupt for SIGINT); without, later signals are ignored. Outside the main
    thread, where no handler can be installed, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    came = threading.Event()
    ended = threading.Event()

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    def handler(signum: int, frame) -> None:
        if _received:
            if not escalate:
                return
            ended.set()  # the second signal: now
            if forward is not None:
                forward(signal.SIGKILL)
            restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _received.append(signum)
        if forward is not None:
            forward(signum)
            came.set()

    def again() -> None:
        came.wait()
        while not ended.wait(repeat_s):
            forward(_received[0])

    clear()
    if forward is not None:
        threading.Thread(target=again, name="gradcomp-forward", daemon=True).start()
    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        ended.set()
        came.set()
        restore()


def _proc_children() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rank_processes(pid: int | None = None) -> list[int]:
    """The training ranks process `pid` (this one) started: its spawned children
    (multiprocessing's spawn_main) and, under a torchrun child, torchrun's workers."""
    tree = _proc_children()
    ranks = []
    for child in tree.get(os.getpid() if pid is None else pid, []):
        cmd = _cmdline(child)
        if "torch.distributed.run" in cmd:
            ranks += [g for g in tree.get(child, []) if "repro.worker" in _cmdline(g)]
        elif "spawn_main" in cmd:
            ranks.append(child)
    return ranks


class RankForwarder:
    """Calling it sends a signal to every rank this process started (rank_processes)
    that has not had one from it yet; SIGKILL goes to every rank."""

    def __init__(self) -> None:
        self.sent: set[int] = set()

    def __call__(self, signum: int) -> None:
        for pid in rank_processes():
            if pid in self.sent and signum != signal.SIGKILL:
                continue
            try:
                os.kill(pid, signum)
                self.sent.add(pid)
            except ProcessLookupError:
                pass


def interrupted_line(step: int, checkpoint_step: int | None, finished: bool = False) -> str:
    """The line a run stopped by a signal ends with."""
    if finished:
        return (f"interrupted after the run finished (step {step}); the same command goes on "
                "with the runs not yet done")
    where = ("no checkpoint (the same command starts the run again)"
             if checkpoint_step is None else f"checkpoint at step {checkpoint_step}")
    resumes = "; the same command resumes" if checkpoint_step is not None else ""
    return f"interrupted at step {step}; {where}{resumes}"
