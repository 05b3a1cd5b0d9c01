"""`python -m repro.worker RUN_DIR`: one rank under torchrun (reads RUN_DIR/config.yaml).

A rank that fails writes its traceback into RUN_DIR/error.log (repro.failures) and ends
with one line naming the cause and the log, not a traceback on the console."""

import os
import sys

from repro.train import run_rank

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
