"""SIDCo's two-read device step (compressors/kernels/cuda_sidco.Split,
sidco_pipeline.select_split):

- everywhere: tests/interpreted_sidco_cuda_checks.py runs its kernels and the whole step
  under Triton's CPU interpreter in a fresh Python (TRITON_INTERPRET=1 must be set before
  triton is imported), against the torch reference path;
- on a CUDA device (marked gpu): the step against the reference at 2^20 and 128M
  elements, with and without zeros, and the pipeline taking it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compressors
from compressors.kernels import cuda as kernels
from compressors.kernels import sidco_pipeline

TESTS = Path(__file__).parent


@pytest.mark.heavy
@pytest.mark.skipif(kernels.triton is None, reason="needs Triton and its interpreter")
def test_split_under_the_interpreter():
    root = str(TESTS.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(TESTS / "interpreted_sidco_cuda_checks.py")],
        check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _laplace(n: int, seed: int, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64, device=device) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("n", [1 << 20, 128 * 1024 * 1024])
@pytest.mark.parametrize("zeros", [0.0, 0.9])
def test_cuda_split_selects_what_the_reference_selects(monkeypatch, name, n, zeros):
    acc = _laplace(n, seed=3)
    if zeros:
        acc[torch.rand(n, device="cuda", generator=torch.Generator(device="cuda")
                       .manual_seed(4)) < zeros] = 0.0
    fits = compressors.build(name, ratio=0.001)
    stages = fits.initial_stages
    k = max(1, int(0.001 * n))
    monkeypatch.setattr(sidco_pipeline, "SPLIT", True)  # the opt-in split path
    assert sidco_pipeline.split_usable(acc.device, fits)
    redone = []
    real = sidco_pipeline.select_device

    def spy(*args, **kwargs):
        redone.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sidco_pipeline, "select_device", spy)
    got, threshold, _ = sidco_pipeline.select(acc, k, stages, fits, {})
    assert redone == []
    ref, ref_threshold = fits.select_reference(acc, stages)
    assert torch.equal(got.indices, ref) and torch.equal(got.values, acc[ref])
    assert threshold == pytest.approx(ref_threshold, rel=1e-9)
    wanted = 0.001 * n
    assert 0.9 * wanted <= got.indices.numel() <= 1.1 * wanted


def _can_compile_for_cuda() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return kernels.triton is not None


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="no Triton with a CUDA backend here")
def test_split_kernels_compile_for_an_h100_without_one():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compressors.kernels import cuda_sidco as dev

    cases = [
        (dev._first_guess_kernel, "part_ptr:*fp64 rows:i32 board_ptr:*i64 t32_ptr:*fp32 "
         "ratio_bits:i64 stages:i32 first_bits:i64 first_log_bits:i64 wanted_bits:i64 "
         "margin_bits:i64 g_slot:i32", [{"GP": g, "R": dev.REDUCE} for g in (False, True)]),
        (dev._split_kernel, "x_ptr:*fp32 n:i64 board_ptr:*i64 t32_ptr:*fp32 g_slot:i32 "
         "part_ptr:*fp64 done_ptr:*i64 pos_ptr:*i32 val_ptr:*fp32 cap:i32 start_ptr:*i64 "
         "count_ptr:*i64 total_ptr:*i64 want_bits:i64 left:i32",
         [{"GP": g, "BLOCK": dev.SPLIT_BLOCK, "R": dev.FUSED_REDUCE} for g in (False, True)]),
        (dev._segment_stage_kernel, "val_ptr:*fp32 start_ptr:*i64 count_ptr:*i64 cap:i32 "
         "board_ptr:*i64 t32_ptr:*fp32 slot_in:i32 slot_out:i32 part_ptr:*fp64 done_ptr:*i64 "
         "want_bits:i64 left:i32",
         [{"GP": g, "BLOCK": dev.SPLIT_BLOCK, "R": dev.FUSED_REDUCE} for g in (False, True)]),
        (dev._segment_count_kernel, "val_ptr:*fp32 start_ptr:*i64 count_ptr:*i64 cap:i32 "
         "t32_ptr:*fp32 slot:i32 hits_ptr:*i64", [{"BLOCK": dev.SPLIT_BLOCK}]),
        (dev._segment_write_kernel, "val_ptr:*fp32 pos_ptr:*i32 start_ptr:*i64 "
         "count_ptr:*i64 cap:i32 t32_ptr:*fp32 slot:i32 hits_ptr:*i64 ends_ptr:*i64 "
         "out_pos_ptr:*i64 out_val_ptr:*fp32 out_cap:i32 board_ptr:*i64 g_slot:i32 "
         "check_slot:i32", [{"BLOCK": dev.SPLIT_BLOCK}]),
    ]
    for kernel, args, variants in cases:
        signature = dict(a.split(":") for a in args.split())
        assert list(signature) == kernel.arg_names[:len(signature)], kernel.__name__
        for constants in variants:
            full = {**signature, **{c: "constexpr" for c in constants}}
            out = triton.compile(ASTSource(fn=kernel, signature=full, constexprs=constants),
                                 target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 8})
            assert out.asm.get("cubin"), f"{kernel.__name__} {constants}: no binary"
