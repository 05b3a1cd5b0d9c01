#!/usr/bin/env bash
# Reproduce paper figures: run what each needs (runs already finished are skipped), draw it
# into outputs/<figure>/ (PNG + CSV, ignored by git) and compare it with the paper and with
# the published results/<figure>/. Nothing tracked is written unless --publish is given.
#
#   scripts/repro_figure.sh                      # the default set (13 figures; see README for its time)
#   scripts/repro_figure.sh --size smoke         # the default set's smoke variants (CI)
#   scripts/repro_figure.sh --set extended       # the training figures' long variants (see README)
#   scripts/repro_figure.sh deft-fig10 --size long  # one figure's long variant
#   scripts/repro_figure.sh sidco-fig16          # one figure, full variant
#   scripts/repro_figure.sh deft-fig1 --size smoke
#   scripts/repro_figure.sh deft-fig3 steps=400  # extra Hydra overrides for its training runs
#   scripts/repro_figure.sh --list               # every figure, status, estimated run time
#   scripts/repro_figure.sh sidco-fig16 --publish  # maintainers: also write results/sidco-fig16/
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${OMP_NUM_THREADS:-}" ]; then export OMP_NUM_THREADS=2; fi
args=()
named=0
takes_value=0
set_value=0
for a in "$@"; do
    if [ "$takes_value" = 1 ]; then args+=("$a"); takes_value=0; continue; fi
    if [ "$set_value" = 1 ]; then
        case "$a" in
            default) args+=(--default) ;;
            extended) args+=(--extended) ;;
            *) echo "repro_figure.sh: unknown set '$a'; the sets: default, extended" >&2; exit 2 ;;
        esac
        set_value=0; named=1; continue
    fi
    case "$a" in
        --set) set_value=1 ;;
        --set=*) echo "repro_figure.sh: write --set NAME (default or extended)" >&2; exit 2 ;;
        --size|--out|--results|--override|-o) args+=("$a"); takes_value=1 ;;
        --list|--readme|--rules|--default|--extended) args+=("$a"); named=1 ;;
        -*) args+=("$a") ;;
        *=*) args+=(--override "$a") ;;
        *) args+=("$a"); named=1 ;;
    esac
done
if [ "$set_value" = 1 ]; then echo "repro_figure.sh: --set needs a name: default or extended" >&2; exit 2; fi
# No figure named: the default set.
if [ "$named" = 0 ]; then args+=(--default); fi
exec repro figure "${args[@]}"
