"""`python -m repro.worker RUN_DIR`: one rank under torchrun (reads RUN_DIR/config.yaml).

A rank that fails writes its traceback into RUN_DIR/error.log (repro.failures) and ends
with one line naming the cause and the log, not a traceback on the console."""

import os
import sys

from repro.train import run_rank


def finished_rank_exit() -> None:
    """End a rank whose run returned: its process group is destroyed and everything it
    writes is on disk, so the interpreter's teardown is skipped. That teardown can abort a
    finished gloo rank (SIGABRT, "terminate called without an active exception", seen
    now and then on the emulated links) while C++ threads of torch.distributed still
    hold Python objects, and the launcher would count the finished run as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m repro.worker RUN_DIR")
    try:
        run_rank(sys.argv[1])
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line and a log entry
        from repro import failures

        rank = os.environ.get("RANK", "?")
        log = failures.record_exception(sys.argv[1], f"rank {rank}", exc)
        sys.exit(f"rank {rank}: {failures.cause(exc)} (traceback in {log})")
    finished_rank_exit()
