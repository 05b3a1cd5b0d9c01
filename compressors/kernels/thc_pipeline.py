"""THC's fused CPU passes (csrc/thc_kernels.cpp, bound in cpu_thc.py): the steps of
Algorithm 3 that compressors/thc.py writes in torch, merged into the FWHT's two
cache-blocked passes, and Uniform THC's USQ (Algorithm 1 line 15) in one pass.

- rotate (lines 9, 11): the padded copy x/ℓ · D written inside the transform's first pass;
- rotate_encode (lines 9-16): that, and the clamp, the stochastic rounding onto the table
  (noise from the counter stream, generated in the pass) and the table values written
  inside the last pass, over one per-thread transform workspace;
- decode (lines 19-21): the affine map of the summed table values inside the first pass,
  the sign flip of the kept coordinates inside the last.

On CUDA tensors (those ops.supports_cuda takes: Triton importable, its self-test passed
on the device, GRADCOMP_NATIVE not 0) rotate, rotate_encode, decode and unsign_ run the
Triton kernels of cuda_thc.py instead: the same steps fused into the first and last passes
of the Triton transform. Under Triton's CPU interpreter (TRITON_INTERPRET=1) those kernels
take the CPU tensors the library declines (the tests' way to check them without a GPU).

Each function gives the bits of thc.py's torch steps on the same device
(tests/kernels/test_thc_rng.py, tests/kernels/test_fastpaths.py, tests/kernels/test_thc_cuda_kernel.py) and
returns None where neither the library nor the kernels take the tensors (GRADCOMP_NATIVE=0,
no compiler, no Triton), so the caller runs those steps. `grid` is thc.RotatedGrid: numel,
padded, max_norm (ℓ), t_p, granularity and the sign seed.
"""

from __future__ import annotations

import os

import torch

from compressors.kernels import build, cpu_thc, ops


def _device_kernels(*tensors: torch.Tensor | None):
    """cuda_thc where its kernels take every given tensor: contiguous, on the current CUDA
    device where ops.supports_cuda would take it (any dtype: the sums are integers), or
    CPU tensors under the interpreter; None otherwise."""
    given = [t for t in tensors if t is not None]
    first = given[0]
    if first.device.type == "cuda":
        if not build.enabled_by_environment() or (
                first.device.index not in (None, torch.cuda.current_device())):
            return None
    elif first.device.type != "cpu" or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    if not all(t.device == first.device and t.is_contiguous() and not t.requires_grad
               for t in given):
        return None
    from compressors.kernels import cuda_thc  # noqa: PLC0415 (imports triton: on demand)

    if cuda_thc.triton is None:
        return None
    if first.device.type == "cuda":
        return cuda_thc if ops.cuda_error(first.device) is None else None
    return cuda_thc if cuda_thc.INTERPRETED else None


def rotate(grid, x: torch.Tensor) -> torch.Tensor | None:
    """The unnormalised FWHT of the padded RHT input (x/ℓ)·s_i (zeros past x.numel()), in a
    fresh float32 buffer of grid.padded elements; x flat float32."""
    if ops.supports_cpu(x):
        return cpu_thc.rotate(x, grid.padded, grid.max_norm, grid.seed)
    kernels = _device_kernels(x) if x.dtype == torch.float32 and x.numel() else None
    if kernels is None:
        return None
    return kernels.rotate(x, grid.padded, grid.max_norm, grid.seed)


def rotate_encode(grid, x: torch.Tensor, table: torch.Tensor, table_values, lut, seed: int,
                  indices: bool, values_out: torch.Tensor | None, count_clamped: bool = True,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None] | None:
    """(z int32 or None, T[z] in table_values' dtype or None, the clamped count) of flat
    float32 x rotated and quantised onto the float32 `table` (`lut`: its interval lookup)
    with the noise of the stream keyed by `seed`; T[z] into `values_out` when given.
    Without `count_clamped` the CUDA kernels count nothing (the count is None: no host
    synchronisation for it); the CPU library counts in any case."""
    if table.dtype != torch.float32 or not (
            table_values is None or table_values.dtype in cpu_thc.VALUE_BYTES):
        return None
    if not (ops.supports_cpu(x) and table.device.type == "cpu"):
        return _device_encode(grid, x, table, table_values, lut, seed, indices, values_out,
                              count_clamped)
    gaps = (table[1:] - table[:-1]).contiguous()
    return cpu_thc.rotate_encode(
        x, grid.padded, grid.max_norm, grid.seed, grid.t_p, grid.granularity,
        table.contiguous(), gaps, lut.contiguous(), seed, indices=indices,
        value_dtype=None if table_values is None else table_values.dtype,
        values_out=values_out)


def _device_encode(grid, x, table, table_values, lut, seed, indices, values_out, count):
    """rotate_encode by cuda_thc's kernels, or None where they do not take the tensors."""
    if values_out is not None and (table_values is None or values_out.dtype != table_values.dtype
                                   or values_out.numel() != grid.padded):
        return None
    kernels = (_device_kernels(x, table, table_values, lut, values_out)
               if x.dtype == torch.float32 and x.numel() and lut.dtype == torch.int32 else None)
    if kernels is None:
        return None
    return kernels.rotate_encode(
        x, grid.padded, grid.max_norm, grid.seed, grid.t_p, grid.granularity, table, lut, seed,
        indices=indices, table_values=table_values, values_out=values_out, count=count)


def decode(grid, value_sum: torch.Tensor, scale: float, offset: float,
           out: torch.Tensor | None, transient: bool) -> torch.Tensor | None:
    """value_sum·scale + offset back through the inverse RHT, the first grid.numel
    coordinates (float32): into `out` when given, or with `transient` a view of this
    thread's transform workspace (read it before the thread's next THC call), else a
    fresh tensor. value_sum: the padded uint8/int32/int64 sums."""
    if not (value_sum.dtype in cpu_thc.VALUE_BYTES and value_sum.numel() == grid.padded):
        return None
    if not (value_sum.device.type == "cpu" and value_sum.is_contiguous() and ops.available()):
        if out is not None and not (out.dtype == torch.float32 and out.numel() == grid.numel):
            out = None  # (the torch steps return a tensor of their own as well)
        kernels = _device_kernels(value_sum, out)
        if kernels is None:
            return None
        return kernels.decode(value_sum, grid.numel, scale, offset, grid.seed, out=out)
    if transient and out is None:
        return cpu_thc.decode_in_workspace(value_sum, grid.numel, scale, offset, grid.seed)
    return cpu_thc.decode(value_sum, grid.numel, scale, offset, grid.seed, out=out)


def unsign_(grid, out: torch.Tensor) -> bool:
    """D⁻¹ = D on the first grid.numel coordinates of a transformed float32 `out`, in
    place, with the stream's signs generated in the pass; False where the library does not
    take `out` (the caller multiplies by the signs)."""
    if ops.supports_cpu(out) and out.dtype == torch.float32:
        cpu_thc.apply_signs_(out, grid.numel, grid.seed)
        return True
    kernels = _device_kernels(out) if out.dtype == torch.float32 and out.numel() else None
    if kernels is None:
        return False
    kernels.unsign_(out, grid.numel, grid.seed)
    return True


def uniform_encode(x: torch.Tensor, lo: float, step: float, levels: int, seed: int,
                   out: torch.Tensor | None) -> torch.Tensor | None:
    """Uniform THC's levels (uint8, in x's shape) of float32 x: stochastic rounding of
    clamp((x − lo)/step, 0, levels) with the stream's noise, in one pass; into `out` (n
    elements) if given."""
    if not ops.supports_cpu(x):
        return None
    return cpu_thc.uniform_encode(x, lo, step, levels, seed, out=out)
