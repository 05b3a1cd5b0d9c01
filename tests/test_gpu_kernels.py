"""The Triton kernels of compressors/_native/gpu.py (the CUDA paths of the threshold
sparsifiers), checked two ways:

- everywhere (CI has no GPU): tests/interpreted_gpu_checks.py runs the same kernels under
  Triton's CPU interpreter on CPU tensors, in a fresh Python (TRITON_INTERPRET=1 must be
  set before triton is imported), against the torch expressions they replace: positions,
  values, counts and statistics at thresholds equal to elements, ragged last blocks, the
  sample positions, DRAGONN's slots with collisions;
- on a CUDA device (marked gpu): every compressor that uses them selects exactly what its
  pure-torch reference path selects on the same device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compressors
from compressors import Session, drive

TESTS = Path(__file__).parent


def _triton_version() -> tuple[int, ...]:
    try:
        import triton
    except ImportError:  # torch builds without CUDA ship no triton: nothing to check
        return (0, 0)
    return tuple(int(p) for p in triton.__version__.split(".")[:2])


# Triton's interpreter before 3.8 cannot run a loop bounded by a kernel argument (the
# statistics' final reduction); torch 2.14.1 (the pinned version) ships 3.8. The compiled
# kernels are checked on any Triton by the gpu tests below.
@pytest.mark.skipif(_triton_version() < (3, 8),
                    reason="needs Triton >= 3.8 and its interpreter (absent or older here)")
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(TESTS / "interpreted_gpu_checks.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def _laplace(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


# ----------------------------------------------------------------------------------------
# On a CUDA device: the compressors' Triton paths against their torch reference paths.


def _run(name: str, grads: list[torch.Tensor], ratio: float):
    session = Session(compressors.build(name, ratio=ratio), world_size=1, feedback="none",
                      seed=11, measure=False)
    return [drive([session.exchange("g", g, step)])[0] for step, g in enumerate(grads)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p", "dgc", "dragonn", "mstopk",
                                  "hard_threshold", "redsync", "gaussianksgd"])
@pytest.mark.parametrize("ratio", [0.001, 0.01])
def test_cuda_paths_select_what_the_reference_selects(monkeypatch, name, ratio):
    from compressors import _native

    grads = [_laplace(3_000_017, seed=s).cuda() for s in range(3)]
    assert _native.supports(grads[0])
    fast = _run(name, grads, ratio)
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        assert not _native.supports(grads[0])
        slow = _run(name, grads, ratio)
    for f, s in zip(fast, slow):
        assert f.sent.indices.numel() > 0
        assert torch.equal(f.sent.indices, s.sent.indices)
        assert torch.equal(f.sent.values, s.sent.values)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sidco_e", "sidco_p", "dgc", "dragonn", "hard_threshold",
                                  "redsync"])
def test_cuda_folded_check_raises_and_changes_nothing(name):
    # The NaN/Inf check folded into the CUDA kernels' first read (DRAGONN's fused write
    # included, whose result otherwise stays on the device until the send): the Session's
    # error, the worker's stream put back, and a finite gradient exchanged as without it.
    grad = _laplace(1_000_003, seed=4).cuda()

    def session(check: bool) -> Session:
        return Session(compressors.build(name, ratio=0.01), world_size=1, feedback="none",
                       seed=2, measure=False, check_finite=check)

    folded, unfolded = session(True), session(False)
    for step in range(2):
        a = drive([folded.exchange("g", grad, step)])[0]
        b = drive([unfolded.exchange("g", grad, step)])[0]
        assert torch.equal(a.sent.indices, b.sent.indices)
        assert torch.equal(a.sent.values, b.sent.values)
    for pos, bad in ((0, float("nan")), (grad.numel() - 1, float("-inf"))):
        broken = grad.clone()
        broken[pos] = bad
        before = folded.generator(grad.device).get_state()
        with pytest.raises(FloatingPointError, match="gradient 'g' contains"):
            drive([folded.exchange("g", broken, 2)])
        assert torch.equal(folded.generator(grad.device).get_state(), before)
