#!/usr/bin/env bash
# Everything issue 7 asks to measure on a GPU, in one command: the CUDA tests, SIDCo's
# three CUDA paths side by side (scripts/bench_gpu_sidco_stages.py) and `repro bench` on
# the device at 0.26M-128M elements, each stopped at its limit (300, 240 and 300 s; not
# yet run on a GPU, so how long they take there is not known). Run from the repository
# root:
#
#     bash scripts/gpu_measure.sh [all|env|tests|stages|bench] [more of them]
#
# The limits add up to more than a lent machine's ten-minute call: where that matters,
# run `env tests` and `stages bench` as two calls (the Triton cache of the first call's
# machine makes the second start faster while it is still warm).
# Results go to $OUT when it is set (the lent machine's folder that comes back), else to
# results/bench/gpu-<UTC date and time>/: env.txt, gpu-tests.log, gpu-sidco-stages.json
# (and its .log), gpu-bench.json (and its .log). The project runs from the checkout
# (PYTHONPATH), so a machine whose Python already holds torch, Triton, scipy and pytest
# needs nothing installed; hydra, omegaconf and wandb are not used here. A stage that
# fails or runs past its limit is reported and the next one still runs; the exit status
# is that of the last failure (0 when none failed).
set -uo pipefail

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
[ "${stages[*]}" = all ] && stages=(env tests stages bench)
for s in "${stages[@]}"; do
    case $s in
        env|tests|stages|bench) ;;
        *) echo "gpu_measure.sh: unknown stage '$s'; the stages: all env tests stages bench" >&2
           exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_measure.sh: $py sees no CUDA device (torch.cuda.is_available() is False);" \
         "run it on a machine with a GPU" >&2
    exit 2
fi
out=${OUT:-results/bench/gpu-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$out" || exit 2

status=0
step() {  # step NAME LIMIT_S LOG COMMAND...: run with a time limit, output into LOG too
    local name=$1 limit=$2 log=$3
    shift 3
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout "$limit" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "== $name: exit $rc$([ "$rc" -eq 124 ] && echo ' (past its limit)')"
        status=$rc
    fi
}

for s in "${stages[@]}"; do
    case $s in
        env)
            {
                date -u
                git rev-parse HEAD 2>/dev/null
                nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
                "$py" -c 'import torch, triton, sys; print(sys.version.split()[0], "torch",
                          torch.__version__, "triton", triton.__version__,
                          torch.cuda.get_device_name())'
            } 2>&1 | tee "$out/env.txt"
            ;;
        tests)  # the CUDA tests: every Triton path against its torch path on the device
            step tests 300 "$out/gpu-tests.log" \
                "$py" -m pytest -q -p no:cacheprovider -m gpu \
                tests/test_gpu_kernels.py tests/test_bench.py
            ;;
        stages)  # SIDCo: host-driven stages, device stages, device with the speculative read
            step stages 240 "$out/gpu-sidco-stages.log" \
                "$py" scripts/bench_gpu_sidco_stages.py --sizes 26M,128M --rounds 6 \
                --steps 30 --json "$out/gpu-sidco-stages.json"
            ;;
        bench)  # the issue's command on the device
            step bench 300 "$out/gpu-bench.log" \
                "$py" -c 'import sys; from repro.cli import main; sys.exit(main())' bench \
                --device cuda --sizes 260000,2.6M,26M,128M --ratios 0.001 \
                --compressor topk,dgc,redsync,gaussianksgd,sidco_e,sidco_gp,sidco_p,mstopk,dragonn,hard_threshold,thc \
                --decode-workers 2,8 --repeats 10 --json --out "$out/gpu-bench.json"
            ;;
    esac
done
echo "== results in $out"
exit $status
