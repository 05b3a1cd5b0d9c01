"""`python -m repro.worker RUN_DIR`: one rank under torchrun (reads RUN_DIR/config.yaml)."""

import sys

from repro.train import run_rank

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m repro.worker RUN_DIR")
    run_rank(sys.argv[1])
