"""THC's fused CPU passes (csrc/thc_kernels.cpp, bound in cpu_thc.py): the steps of
Algorithm 3 that compressors/thc.py writes in torch, merged into the FWHT's two
cache-blocked passes, and Uniform THC's USQ (Algorithm 1 line 15) in one pass.

- rotate (lines 9, 11): the padded copy x/ℓ · D written inside the transform's first pass;
- rotate_encode (lines 9-16): that, and the clamp, the stochastic rounding onto the table
  (noise from the counter stream, generated in the pass) and the table values written
  inside the last pass, over one per-thread transform workspace;
- decode (lines 19-21): the affine map of the summed table values inside the first pass,
  the sign flip of the kept coordinates inside the last.

Each function gives the bits of thc.py's torch steps (tests/test_thc_rng.py,
tests/test_fastpaths.py) and returns None where the library does not take the tensors
(GRADCOMP_NATIVE=0, no compiler, CUDA), so the caller runs those steps. `grid` is
thc.RotatedGrid: numel, padded, max_norm (ℓ), t_p, granularity and the sign seed.
"""

from __future__ import annotations

import torch

from compressors.kernels import cpu_thc, ops


def rotate(grid, x: torch.Tensor) -> torch.Tensor | None:
    """The unnormalised FWHT of the padded RHT input (x/ℓ)·s_i (zeros past x.numel()), in a
    fresh float32 buffer of grid.padded elements; x flat float32."""
    if not ops.supports_cpu(x):
        return None
    return cpu_thc.rotate(x, grid.padded, grid.max_norm, grid.seed)


def rotate_encode(grid, x: torch.Tensor, table: torch.Tensor, table_values, lut, seed: int,
                  indices: bool, values_out: torch.Tensor | None,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, int] | None:
    """(z int32 or None, T[z] in table_values' dtype or None, the clamped count) of flat
    float32 x rotated and quantised onto the float32 `table` (`lut`: its interval lookup)
    with the noise of the stream keyed by `seed`; T[z] into `values_out` when given."""
    if not (ops.supports_cpu(x) and table.dtype == torch.float32 and table.device.type == "cpu"
            and (table_values is None or table_values.dtype in cpu_thc.VALUE_BYTES)):
        return None
    gaps = (table[1:] - table[:-1]).contiguous()
    return cpu_thc.rotate_encode(
        x, grid.padded, grid.max_norm, grid.seed, grid.t_p, grid.granularity,
        table.contiguous(), gaps, lut.contiguous(), seed, indices=indices,
        value_dtype=None if table_values is None else table_values.dtype,
        values_out=values_out)


def decode(grid, value_sum: torch.Tensor, scale: float, offset: float,
           out: torch.Tensor | None, transient: bool) -> torch.Tensor | None:
    """value_sum·scale + offset back through the inverse RHT, the first grid.numel
    coordinates (float32): into `out` when given, or with `transient` a view of this
    thread's transform workspace (read it before the thread's next THC call), else a
    fresh tensor. value_sum: the padded uint8/int32/int64 sums."""
    if not (value_sum.dtype in cpu_thc.VALUE_BYTES and value_sum.device.type == "cpu"
            and value_sum.is_contiguous() and value_sum.numel() == grid.padded
            and ops.available()):
        return None
    if transient and out is None:
        return cpu_thc.decode_in_workspace(value_sum, grid.numel, scale, offset, grid.seed)
    return cpu_thc.decode(value_sum, grid.numel, scale, offset, grid.seed, out=out)


def unsign_(grid, out: torch.Tensor) -> bool:
    """D⁻¹ = D on the first grid.numel coordinates of a transformed float32 `out`, in
    place, with the stream's signs generated in the pass; False where the library does not
    take `out` (the caller multiplies by the signs)."""
    if not (ops.supports_cpu(out) and out.dtype == torch.float32):
        return False
    cpu_thc.apply_signs_(out, grid.numel, grid.seed)
    return True


def uniform_encode(x: torch.Tensor, lo: float, step: float, levels: int, seed: int,
                   out: torch.Tensor | None) -> torch.Tensor | None:
    """Uniform THC's levels (uint8, in x's shape) of float32 x: stochastic rounding of
    clamp((x − lo)/step, 0, levels) with the stream's noise, in one pass; into `out` (n
    elements) if given."""
    if not ops.supports_cpu(x):
        return None
    return cpu_thc.uniform_encode(x, lo, step, levels, seed, out=out)
