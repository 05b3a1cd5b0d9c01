import os

import pytest
import torch

# Two cores: keep intra-op threads bounded so parallel spawned ranks do not thrash.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip where no CUDA device exists (CI is CPU-only); nothing else skips."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
