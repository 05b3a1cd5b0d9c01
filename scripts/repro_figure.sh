#!/usr/bin/env bash
# Reproduce a paper figure: run what it needs (runs already finished are skipped), draw it
# into results/<figure>/ (PNG + CSV) and write the paper-vs-reproduced comparison.
#
#   scripts/repro_figure.sh                      # the default set (~5.5 min on a 2-core CPU)
#   scripts/repro_figure.sh sidco-fig16          # one figure, full variant
#   scripts/repro_figure.sh deft-fig1 --size smoke
#   scripts/repro_figure.sh deft-fig3 steps=400  # extra Hydra overrides for its training runs
#   scripts/repro_figure.sh --list               # every figure, status, estimated run time
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${OMP_NUM_THREADS:-}" ]; then export OMP_NUM_THREADS=2; fi
if [ $# -eq 0 ]; then exec repro figure --default; fi
args=()
for a in "$@"; do
    if [[ "$a" == -* || "$a" != *=* ]]; then args+=("$a"); else args+=(--override "$a"); fi
done
exec repro figure "${args[@]}"
