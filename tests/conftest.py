import os

import pytest
import torch

# Two cores: keep intra-op threads bounded so parallel spawned ranks do not thrash.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(2)


# What each test file tests. Every test gets one group marker: its file's group, else
# "unit". Tests that spawn processes are marked "distributed" where they are written.
GROUPS = {
    "kernels": ("test_native_kernels", "test_gpu_kernels", "test_fwht_kernel",
                "test_thc_cuda_kernel", "test_fastpaths",
                "test_allocations", "test_finite_fold", "test_thc_rng", "test_imports",
                "test_context_workspace", "test_bench"),
    "figures": ("test_figures", "test_figures_sidco_dragonn", "test_verdicts", "test_compare",
                "test_compare_page", "test_runs", "test_figures_long", "test_figures_link"),
}
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}


def pytest_collection_modifyitems(config, items):
    """Group markers (unit, kernels, figures; see GROUPS); every heavy test is also slow
    (the lanes nest: quick within default within all); GPU tests skip where no CUDA
    device exists (CI is CPU-only), the compare page's browser tests where no Chromium is
    installed (.ci/run installs it), the emulated network's where namespaces cannot be
    made (not root, no iproute2: tests/test_netem.py names the reason); nothing else
    skips."""
    for item in items:
        module = item.path.stem if hasattr(item, "path") else ""
        item.add_marker(getattr(pytest.mark, GROUP_OF.get(module, "unit")))
        if "heavy" in item.keywords:  # out of the default run, so out of the quick lane
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
