"""The Triton Walsh–Hadamard transform of compressors/kernels/cuda_fwht.py:

- its pass plans (pure Python);
- everywhere: tests/kernels/interpreted_fwht_checks.py runs the kernels under Triton's CPU
  interpreter in a fresh Python (TRITON_INTERPRET=1 must be set before triton is
  imported), against reference.fwht_ and scipy.linalg.hadamard, including multi-pass plans
  on small sizes;
- where Triton has its CUDA backend: the launched variants compile for an H100 (sm_90);
- on a CUDA device (marked gpu): the same bits as reference.fwht_ at 2^20 and 2^27, and
  ops.fwht_ taking the kernels.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compressors.kernels import cuda_fwht, reference

TESTS = Path(__file__).parent


def _has_triton() -> bool:
    return cuda_fwht.triton is not None


def test_plan_of_a_large_row_takes_three_passes():
    steps = cuda_fwht.plan(1 << 27, 1 << 27)
    assert [(s.m, s.q, s.columns) for s in steps] == [
        (1 << 13, 1, 1), (1 << 7, 1 << 13, 64), (1 << 7, 1 << 20, 64)]
    assert [s.programs for s in steps] == [1 << 14, 1 << 14, 1 << 14]


@pytest.mark.parametrize("d, rows", [(2, 1), (64, 1000), (1 << 13, 3), (1 << 14, 2),
                                     (1 << 20, 1), (1 << 21, 4)])
def test_plans_cover_every_stage_once(d, rows):
    steps = cuda_fwht.plan(d, rows * d)
    size = 1
    for step in steps:
        assert step.q == size
        assert step.m * max(step.outer, step.columns) <= max(cuda_fwht.BLOCK, cuda_fwht.TILE)
        if step.q > 1:
            assert step.programs * step.m * step.columns == rows * d
        size *= step.m
    assert size == d
    assert cuda_fwht.plan(1, rows) == []


@pytest.mark.heavy
@pytest.mark.skipif(not _has_triton(), reason="needs Triton and its interpreter")
def test_fwht_kernels_under_the_interpreter():
    root = str(TESTS.parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(TESTS / "interpreted_fwht_checks.py")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    report = done.stdout + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and re.search(r"\b\d+ passed\b", summary), report
    assert not re.search(r"skipped|deselected|error", summary), report


def _can_compile_for_cuda() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return _has_triton()


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="no Triton with a CUDA backend here")
def test_fwht_kernels_compile_for_an_h100_without_one():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launched = {}
    for d, rows in ((1 << 27, 1), (1 << 20, 1), (1 << 14, 8), (64, 1000), (2, 3)):
        for step in cuda_fwht.plan(d, rows * d):
            launched[step] = None
    for step in launched:
        stages = step.m.bit_length() - 1
        if step.q == 1:
            kernel, signature = cuda_fwht._block_kernel, {"x_ptr": "*fp32", "n": "i64"}
            constants = {"OUTER": step.outer, "M": step.m, "STAGES": stages}
        else:
            kernel, signature = cuda_fwht._strided_kernel, {"x_ptr": "*fp32", "Q": "i32"}
            constants = {"M": step.m, "COLUMNS": step.columns, "STAGES": stages}
        full = {**signature, **{c: "constexpr" for c in constants}}
        out = triton.compile(ASTSource(fn=kernel, signature=full, constexprs=constants),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": step.warps})
        assert out.asm.get("cubin"), f"{kernel.__name__} {constants}: no binary"


@pytest.mark.gpu
@pytest.mark.parametrize("log_d", [20, 27])
def test_cuda_transform_equals_the_reference(log_d):
    g = torch.Generator(device="cuda").manual_seed(log_d)
    x = torch.randn(1, 1 << log_d, generator=g, device="cuda", dtype=torch.float32)
    got = cuda_fwht.fwht_(x.clone())
    want = reference.fwht_(x)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_ops_fwht_takes_the_kernels_on_cuda(monkeypatch):
    from compressors.kernels import ops

    x = torch.randn(3, 1 << 15, device="cuda")
    want = reference.fwht_(x.clone()).mul_((1 << 15) ** -0.5)
    calls = []
    real = cuda_fwht.fwht_
    monkeypatch.setattr(cuda_fwht, "fwht_", lambda t: calls.append(t.shape) or real(t))
    assert torch.equal(ops.fwht_(x), want) and calls == [x.shape]
