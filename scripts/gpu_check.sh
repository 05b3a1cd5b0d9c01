#!/usr/bin/env bash
# Replicas on one GPU: 4 gloo ranks share the device and train a ~16.8M-parameter MLP
# through the public hook (repro.hooks.make) for 40 steps, for every sparse compressor;
# prints "replicas identical" (or the first parameter that differs) per compressor.
# Needs only torch and this repository (no Hydra or W&B).
#   bash scripts/gpu_check.sh [extra arguments of python -m repro.replicacheck]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m repro.replicacheck \
    --device cuda --workers 4 --steps 40 --params 16800000 "$@"
