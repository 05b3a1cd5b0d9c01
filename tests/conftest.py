import os
from pathlib import Path

import pytest
import torch

# Two cores: keep intra-op threads bounded so parallel spawned ranks do not thrash.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(2)


# The tests are laid out like the source, one folder per layer; each test is marked with
# its folder's name (select a layer with -m, e.g. -m kernels). Tests that spawn processes
# are marked "distributed" where they are written.
FOLDERS = {
    "compressors": "an algorithm's defining property, through Session, simulated and real ranks",
    "kernels": "the C++ and Triton kernels against their torch twins, allocations, benches",
    "engine": "the DDP hook, trainers, launch, runs, logging, network, import layers",
    "tasks": "the workloads: models, loaders, data sets, hyper-parameters",
    "figures": "paper figures, verdicts, run comparison",
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Folder markers (see FOLDERS): a test outside them is refused, so a new file lands
    where its layer is; every heavy test is also slow (the lanes nest: quick within
    default within all); GPU tests skip where no CUDA device exists (CI is CPU-only), the
    compare page's browser tests where no Chromium is installed (.ci/run installs it), the
    emulated network's where namespaces cannot be made (not root, no iproute2:
    tests/engine/test_netem.py names the reason); nothing else skips."""
    for item in items:
        folder = Path(item.path).resolve().parent
        if folder.parent != TESTS or folder.name not in FOLDERS:
            raise pytest.UsageError(
                f"{item.path} is outside the test folders: move it into tests/<layer>/, one "
                f"of {', '.join(FOLDERS)} (tests/conftest.py FOLDERS)")
        item.add_marker(getattr(pytest.mark, folder.name))
        if "heavy" in item.keywords:  # out of the default run, so out of the quick lane
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
