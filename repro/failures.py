"""How a failed run ends: one line naming the cause and the log file; the tracebacks go
into the log, not onto the console; and a record that the run failed.

    RUN_DIR/error.log   one entry per failure, newest last: a header line
                        "== <who> (pid@host) <time>: <cause>" and the traceback
    RUN_DIR/FAILED      {"status": "failed" | "diverged", "reason": ..., "log": ...}: the run
                        stopped with an error (diverged: a NaN or an Inf in the gradients).
                        A re-run of the sweep skips it, naming the reason, unless
                        --retry-failed; it goes when the run finishes.

The launcher (`repro train`) writes its own entry and prints `failure_line`; a rank
under torchrun (repro.worker) writes its entry and exits with a one-line message, so
torchrun's report and the launcher's line name the rank's cause. Where the run folder
cannot be written (a full disk), the log goes to the system's temp folder instead.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from typing import Any

LOG = "error.log"
FAILED = "FAILED"
_HEADER = "== "


def cause(exc: BaseException) -> str:
    """One line naming what went wrong: an OSError of the suite (OutputError) or any
    exception as 'Type: first line of its message'; a spawned rank's error as the last
    line of its traceback (what that rank raised)."""
    text = str(exc).strip()
    if type(exc).__name__ == "ProcessRaisedException":
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else type(exc).__name__
    first = text.splitlines()[0] if text else ""
    from repro.durable import OutputError

    if isinstance(exc, OutputError):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def record(run_dir: str | None, who: str, reason: str, text: str) -> str:
    """Append an entry (header with `reason`, then `text`) to RUN_DIR/error.log, or to a
    log in the temp folder where that cannot be written; the log's path."""
    entry = (f"{_HEADER}{who} ({os.getpid()}@{socket.gethostname()}) "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}\n{text.rstrip()}\n\n").encode()
    places = [os.path.join(run_dir, LOG)] if run_dir and os.path.isdir(run_dir) else []
    places.append(os.path.join(tempfile.gettempdir(), f"repro-train-{os.getpid()}.log"))
    for path in places:
        try:
            # Appended whole by one write (O_APPEND): ranks failing together do not mix.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o666)
            try:
                os.write(fd, entry)
                os.fsync(fd)
            finally:
                os.close(fd)
            return path
        except OSError:
            continue
    return places[-1]


def record_exception(run_dir: str | None, who: str, exc: BaseException) -> str:
    """record() of an exception with its traceback; the log's path."""
    text = "".join(traceback.format_exception(exc))
    return record(run_dir, who, cause(exc), text)


def rank_causes(run_dir: str, since: float) -> list[str]:
    """The causes the ranks wrote into RUN_DIR/error.log since `since` (a time.time())."""
    path = os.path.join(run_dir, LOG)
    try:
        mtime = os.path.getmtime(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    if mtime < since:
        return []
    causes = []
    floor = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    for line in lines:
        if line.startswith(_HEADER + "rank "):
            reason = line.partition("): ")[2]
            stamp = reason[:19]
            if stamp >= floor:
                causes.append(reason[21:])
    return causes


def failure_line(command: str, exc: BaseException, log: str, run_dir: str | None = None,
                 since: float | None = None) -> str:
    """'repro train: failed: <cause> (traceback in <log>)'; a torchrun launch that
    failed names the first rank's cause."""
    reason = cause(exc)
    if run_dir and since is not None and "torchrun exited" in reason:
        ranks = rank_causes(run_dir, since)
        if ranks:
            reason = ranks[0]
    return f"{command}: failed: {reason} (traceback in {log})"


# -- the FAILED record --------------------------------------------------------------
def diverged(exc: BaseException) -> bool:
    """Whether a run's error is a divergence: a NaN or an Inf in the gradients, raised
    here (repro.hooks.NonFiniteGradient) or by a spawned rank (its traceback's text)."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if type(node).__name__ == "NonFiniteGradient" or "NonFiniteGradient" in str(node):
            return True
        node = node.__cause__ or node.__context__
    return False


def record_failure(run_dir: str, exc: BaseException, log: str) -> dict[str, Any]:
    """Write RUN_DIR/FAILED for a run that ended with `exc` (its traceback is in `log`);
    the record. A folder that cannot be written keeps no record (the sweep goes on)."""
    from repro.durable import write_text

    record = {"status": "diverged" if diverged(exc) else "failed", "reason": cause(exc),
              "log": log, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        write_text(os.path.join(run_dir, FAILED), json.dumps(record, indent=1) + "\n")
    except OSError:
        pass
    return record


def read_failure(run_dir: str) -> dict[str, Any] | None:
    """RUN_DIR/FAILED, or None (no failure recorded, or a record that cannot be read)."""
    try:
        with open(os.path.join(run_dir, FAILED), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def clear_failure(run_dir: str) -> None:
    path = os.path.join(run_dir, FAILED)
    if os.path.exists(path):
        os.remove(path)


def failure_text(record: dict[str, Any]) -> str:
    return f"{record.get('status', 'failed')}: {short(record.get('reason'))}"


def short(reason: str | None, limit: int = 160) -> str:
    """A failure's reason as a sweep's lines show it: its first sentence, at most `limit`
    characters (the whole is in RUN_DIR/FAILED and the traceback in the log)."""
    text = str(reason or "?")
    cut = text.find(". ")
    if cut > 0:
        text = text[:cut + 1]
    return text if len(text) <= limit else text[:limit - 1] + "…"
