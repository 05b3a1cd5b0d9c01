#!/usr/bin/env bash
# What the suite measures on a GPU, in one command, each stage stopped at its limit:
#
#   env       the machine: GPU, driver, Python, torch, Triton
#   tests     the CUDA tests (pytest -m gpu): every Triton path against its torch twin
#   bench     `repro bench --device cuda` at 128M fp32, δ = 0.001, every sparsifier and
#             THC, with the one-read floor and torch.topk in the same rounds
#   sizes     the same from 2^10 to 2^27 elements (sizes.json): the GPU compression times
#             that projections onto the papers' GPU clusters read (repro/gpubench.py)
#   step      a training step through the DDP hook on one GPU (scripts/gpu_step.py):
#             VGG-16 (batch 32) and ResNet-50 (batch 64), uncompressed, PyTorch's fp16 and
#             PowerSGD hooks, topk, dgc, dragonn, thc, sidco_e (and at bucket granularity),
#             δ = 0.001: model-step.json
#   fwht      the Walsh–Hadamard transform of 2^27 floats: Triton kernel vs torch ops
#   replicas  4 ranks sharing the GPU train through the hook; replicas bit-identical
#             (scripts/gpu_check.sh)
#   before    the bench stage on another checkout (BEFORE=<folder or .tar.gz of one>),
#             for before/after tables measured on the same machine
#
#     bash scripts/gpu_measure.sh [all|STAGE...]      (all: every stage but before)
#
# Results go to $OUT when it is set (a lent machine's folder that comes back), else to
# results/bench/gpu-<model>-torch<version>/: env.txt and per stage <stage>.log (and .json).
# The project runs from the checkout (PYTHONPATH): a Python holding torch, Triton and
# pytest needs nothing installed; Hydra and W&B are not used. A stage that fails or runs
# past its limit is reported and the next one still runs; the exit status is that of the
# last failure. Limits (s) come from LIMIT_<STAGE>, e.g. LIMIT_TESTS=200.
set -uo pipefail

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
[ "${stages[*]}" = all ] && stages=(env tests bench sizes step fwht replicas)
for s in "${stages[@]}"; do
    case $s in
        env|tests|bench|sizes|step|fwht|replicas|before) ;;
        *) echo "gpu_measure.sh: unknown stage '$s'; the stages: all env tests bench sizes step fwht replicas before" >&2
           exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_measure.sh: $py sees no CUDA device (torch.cuda.is_available() is False);" \
         "run it on a machine with a GPU" >&2
    exit 2
fi
# results/bench/gpu-<model>-torch<major.minor>/, e.g. gpu-h200-torch2.11/
machine=$("$py" -c 'import torch
v = ".".join(torch.__version__.split(".")[:2])
print("gpu-" + torch.cuda.get_device_name().split()[-1].lower() + "-torch" + v)')
out=${OUT:-results/bench/$machine}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
sizes=${SIZES:-128M}
sparse=topk,dgc,dgc_reference,redsync,gaussianksgd,sidco_e,sidco_gp,sidco_p,mstopk,dragonn,hard_threshold,thc

status=0
step() {  # step NAME DEFAULT_LIMIT_S COMMAND...: run with a time limit, output into NAME.log
    local name=$1 limit=$2
    shift 2
    local var="LIMIT_${name^^}"
    limit=${!var:-$limit}
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "== $name: exit $rc$([ "$rc" -eq 124 ] && echo ' (past its limit)')"
        status=$rc
    fi
}
bench() {  # bench NAME CHECKOUT JSON: `repro bench` of that checkout as stage NAME
    step "$1" 150 env -C "$2" PYTHONPATH="$2" "$py" -c \
        'import sys; from repro.cli import main; sys.exit(main())' bench \
        --device cuda --sizes "$sizes" --ratios 0.001 --compressor "$sparse" \
        --decode-workers 2,8 --repeats "${REPEATS:-7}" --json --out "$3"
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
        tests)
            step tests 180 env PYTHONPATH="$root" "$py" -m pytest -q -p no:cacheprovider -m gpu \
                tests/kernels/test_gpu_kernels.py tests/kernels/test_bench.py tests/kernels/test_fwht_kernel.py \
                tests/kernels/test_thc_cuda_kernel.py
            ;;
        bench)
            bench bench "$root" "$out/bench.json"
            ;;
        sizes)
            sizes=${SIZES_SWEEP:-1024,4096,16384,65536,262144,1048576,4194304,16777216,67108864,134217728} \
                REPEATS=${REPEATS:-5} bench sizes "$root" "$out/sizes.json"
            ;;
        step)
            step step 240 bash -c 'root=$0 py=$1 out=$2
                for spec in "vgg16 32" "resnet50 64"; do
                    set -- $spec
                    env PYTHONPATH="$root" "$py" scripts/gpu_step.py --model "$1" \
                        --batch "$2" --json "$out/model-step.json" || exit
                done' "$root" "$py" "$out"
            ;;
        fwht)
            step fwht 40 env PYTHONPATH="$root" "$py" -m compressors.kernels.cuda_fwht --json "$out/fwht.json"
            ;;
        replicas)
            step replicas 90 env PYTHONPATH="$root" bash scripts/gpu_check.sh --steps 20
            ;;
        before)
            src=${BEFORE:?set BEFORE to the other checkout (a folder or a .tar.gz of one)}
            if [ -f "$src" ]; then
                mkdir -p /tmp/gpu-measure-before && tar xzf "$src" -C /tmp/gpu-measure-before
                src=/tmp/gpu-measure-before
            fi
            bench before "$src" "$out/before.json"
            ;;
    esac
done
echo "== results in $out"
exit $status
