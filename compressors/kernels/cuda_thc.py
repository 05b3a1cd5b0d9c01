"""Triton kernels of THC's encoding and decoding (compressors/thc.py, Algorithm 3 lines 9-16
and 19-21) around the Walsh–Hadamard transform of cuda_fwht.py: every elementwise step
fused into the transform's first and last passes, so an encoding or a decoding costs
about what the transform alone costs.

- the first pass (contiguous blocks) builds its block itself before the butterflies:
  (x_i / ℓ)·s_i for i < numel and 0 up to the padded length (encoding), or the affine
  map Σ·a + b of the summed table values (decoding);
- the last pass (strided tiles, or the same block kernel where one pass is the whole
  transform) ends with the encoding's epilogue in place of its store: the clamped count,
  clamp to [−t_p, t_p], the map onto [0, g], the interval lookup, the stochastic rounding
  with the stream's noise u_i = (h(i) >> 8)·2^-24, and the indices z and/or the table
  values T[z] stored; or with the decoding's sign flip of the first numel coordinates,
  stored into the output;
- the passes between are cuda_fwht's own.

s_i and u_i are the counter stream of counter_stream.py (s_i: bit i mod 32 of h(⌊i/32⌋)),
computed in the passes from (seed, i). Every step is the float operation the torch path of
thc.py makes, in its order: x/ℓ a multiplication by the float32 reciprocal on CUDA and an
IEEE division on the CPU (the interpreter), the interval fraction an IEEE division
(div_rn), and no product and sum contracted into one fma, so the decoding's Σ·a + b is
rounded twice as torch's mul_ then add_ round it. Under the interpreter the results are
the same bits as the torch path. On CUDA (an H200) the rotated coordinates differ from
the torch path's in the last bits (up to 2.4e-6 at 2^27, coordinates up to ~9), so a few
coordinates at a grid boundary land one level over (3 of 2^20, 120 of 2^27 indices); every
rank takes the same path, so the ranks' sums stay exact. Sizes (block, tile,
min_columns) are cuda_fwht.plan's.
"""

from __future__ import annotations

import torch

from compressors.kernels import cuda_fwht
from compressors.kernels.counter_stream import seed_words
from compressors.kernels.cuda import INTERPRETED, supports, tl, triton
from compressors.kernels.numerics import round_f32

__all__ = ["INTERPRETED", "decode", "rotate", "rotate_encode", "supports", "unsign_"]

# what the first pass builds, and what the last one does with the transformed values
_ROTATE, _AFFINE = 0, 1
_STORE, _ENCODE, _UNSIGN = 0, 1, 2
_WORD = 1 << 32  # seed words are passed with this bit set: always 64-bit arguments
_SEEDS = ["s0", "s1", "n0", "n1"]
_UNSIGN_BLOCK = 4096
_OPTIONS = {"enable_fp_fusion": False}
VALUE_DTYPES = (torch.uint8, torch.int32, torch.int64)

if triton is not None:
    from compressors.kernels.cuda import _mix32
    from compressors.kernels.cuda_fwht import _butterflies

    @triton.jit
    def _hash(i, w0, w1):
        # h(i) of the stream keyed by the words (w0, w1), i int64 ≥ 0: _mix32 on uint32
        # words (its products wrap mod 2^32, as its masks make them in int64), which
        # halves the integer work of the 64-bit form
        lo = (i & 0xFFFFFFFF).to(tl.uint32) ^ (w0 & 0xFFFFFFFF).to(tl.uint32)
        hi = (i >> 32).to(tl.uint32) ^ (w1 & 0xFFFFFFFF).to(tl.uint32)
        return _mix32(_mix32(lo) ^ hi)

    @triton.jit
    def _signed(v, i, s0, s1):
        # v·s_i: the sign flipped where bit i mod 32 of h(⌊i/32⌋) is set (exact)
        bit = (_hash(i >> 5, s0, s1) >> (i & 31).to(tl.uint32)) & 1
        return tl.where(bit != 0, -v, v)

    @triton.jit
    def _finish(r, offs, numel, dst_ptr, z_ptr, count_ptr, lut_ptr, table_ptr, tv_ptr,
                t, scale, top, s0, s1, n0, n1, EPILOGUE: tl.constexpr,
                COUNT: tl.constexpr, INDICES: tl.constexpr, VALUES: tl.constexpr):
        # the transformed values r at offs: stored (_STORE); encoded, z into z_ptr and
        # T[z] into dst_ptr (_ENCODE); or unsigned into dst_ptr below numel (_UNSIGN)
        if EPILOGUE == 0:
            tl.store(dst_ptr + offs, r)
        elif EPILOGUE == 1:
            if COUNT:
                tl.atomic_add(count_ptr, tl.sum((tl.abs(r) > t).to(tl.int64)))
            v = tl.minimum(tl.maximum(r, -t), t) + t
            v = v * scale
            v = tl.minimum(tl.maximum(v, 0.0), top)
            j = tl.load(lut_ptr + v.to(tl.int32))
            low = tl.load(table_ptr + j)
            frac = tl.math.div_rn(v - low, tl.load(table_ptr + j + 1) - low)
            u = (_hash(offs, n0, n1) >> 8).to(tl.float32) * (1.0 / 16777216.0)
            z = j + (u < frac).to(tl.int32)
            if INDICES:
                tl.store(z_ptr + offs, z)
            if VALUES:
                tl.store(dst_ptr + offs, tl.load(tv_ptr + z))
        else:
            tl.store(dst_ptr + offs, _signed(r, offs, s0, s1), mask=offs < numel)

    @triton.jit(do_not_specialize=_SEEDS)
    def _first_kernel(src_ptr, numel, a, b, dst_ptr, z_ptr, count_ptr, lut_ptr, table_ptr,
                      tv_ptr, t, scale, top, s0, s1, n0, n1, PROLOGUE: tl.constexpr,
                      RECIPROCAL: tl.constexpr, EPILOGUE: tl.constexpr,
                      COUNT: tl.constexpr, INDICES: tl.constexpr, VALUES: tl.constexpr,
                      M: tl.constexpr, STAGES: tl.constexpr):
        # one contiguous block of M padded coordinates: built from the source, transformed
        # along its M elements, finished
        offs = tl.program_id(0).to(tl.int64) * M + tl.arange(0, M)
        if PROLOGUE == 0:
            inside = offs < numel
            x = tl.load(src_ptr + offs, mask=inside, other=0.0)
            if RECIPROCAL:
                x = x * a
            else:
                x = tl.math.div_rn(x, a)
            x = tl.where(inside, _signed(x, offs, s0, s1), 0.0)
        else:
            x = tl.load(src_ptr + offs).to(tl.float32) * a
            x = x + b
        x = _butterflies(x, 1, M, 1, STAGES)
        _finish(x, offs, numel, dst_ptr, z_ptr, count_ptr, lut_ptr, table_ptr, tv_ptr,
                t, scale, top, s0, s1, n0, n1, EPILOGUE, COUNT, INDICES, VALUES)

    @triton.jit(do_not_specialize=_SEEDS)
    def _last_kernel(buf_ptr, Q, numel, dst_ptr, z_ptr, count_ptr, lut_ptr, table_ptr,
                     tv_ptr, t, scale, top, s0, s1, n0, n1, EPILOGUE: tl.constexpr,
                     COUNT: tl.constexpr, INDICES: tl.constexpr, VALUES: tl.constexpr,
                     M: tl.constexpr, COLUMNS: tl.constexpr, STAGES: tl.constexpr):
        # cuda_fwht._strided_kernel's tile [M, COLUMNS], finished instead of stored
        pid = tl.program_id(0).to(tl.int64)
        per_group = Q // COLUMNS
        p = pid // per_group
        c = pid - p * per_group
        rows = tl.arange(0, M).to(tl.int64) * Q
        offs = p * M * Q + c * COLUMNS + (rows[:, None] + tl.arange(0, COLUMNS)[None, :])
        x = tl.reshape(tl.load(buf_ptr + offs), (M * COLUMNS,))
        x = tl.reshape(_butterflies(x, 1, M, COLUMNS, STAGES), (M, COLUMNS))
        _finish(x, offs, numel, dst_ptr, z_ptr, count_ptr, lut_ptr, table_ptr, tv_ptr,
                t, scale, top, s0, s1, n0, n1, EPILOGUE, COUNT, INDICES, VALUES)

    @triton.jit(do_not_specialize=["s0", "s1"])
    def _unsign_kernel(x_ptr, numel, s0, s1, BLOCK: tl.constexpr):
        # x_i ← x_i·s_i for i < numel, in place
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        tl.store(x_ptr + offs, _signed(x, offs, s0, s1), mask=inside)


def _words(seed: int) -> tuple[int, int]:
    k0, k1 = seed_words(seed)
    return k0 | _WORD, k1 | _WORD


def _plan(padded: int, sizes: dict) -> list[cuda_fwht.Pass]:
    if padded & (padded - 1):
        raise ValueError(f"the padded length must be a power of two, got {padded}")
    # (a single coordinate: one block of one element, no butterfly)
    return cuda_fwht.plan(padded, padded, **sizes) or [cuda_fwht.Pass(1, 1, 1, 1, 1, 1)]


def _transform(src: torch.Tensor, buf: torch.Tensor, numel: int, a: float, b: float,
               prologue: int, epilogue: int, dst: torch.Tensor, sizes: dict,
               sign_seed: int, encoding: dict | None = None) -> None:
    """The transform of the block the first pass builds from `src` (into `buf`, padded),
    its last pass finished by `epilogue` into `dst` (and `encoding`'s tensors)."""
    steps = _plan(buf.numel(), sizes)
    e = encoding or {}
    s0, s1 = _words(sign_seed)
    n0, n1 = _words(e.get("seed", 0))
    common = (e.get("z", dst), e.get("count", dst), e.get("lut", dst), e.get("table", dst),
              e.get("table_values", dst), e.get("t", 0.0), e.get("scale", 0.0),
              e.get("top", 0.0), s0, s1, n0, n1)
    flags = {"COUNT": "count" in e, "INDICES": "z" in e, "VALUES": "values" in e}
    first, last = steps[0], steps[-1]
    alone = len(steps) == 1
    _first_kernel[(first.programs,)](
        src, numel, a, b, dst if alone else buf, *common, PROLOGUE=prologue,
        RECIPROCAL=src.is_cuda, EPILOGUE=epilogue if alone else _STORE, **flags,
        M=first.m, STAGES=first.m.bit_length() - 1, num_warps=first.warps, **_OPTIONS)
    if alone:
        return
    for step in steps[1:-1]:
        cuda_fwht.run_pass(buf, step)
    _last_kernel[(last.programs,)](
        buf, last.q, numel, dst, *common, EPILOGUE=epilogue, **flags, M=last.m,
        COLUMNS=last.columns, STAGES=last.m.bit_length() - 1, num_warps=last.warps,
        **_OPTIONS)


def _scale_of_norm(x: torch.Tensor, max_norm: float) -> float:
    """What x/ℓ multiplies by (CUDA: torch's float32 reciprocal of the scalar) or divides
    by (the interpreter's CPU tensors: torch's division)."""
    norm = round_f32(max_norm)
    return round_f32(1.0 / norm) if x.is_cuda else norm


def rotate(x: torch.Tensor, padded: int, max_norm: float, sign_seed: int,
           **sizes) -> torch.Tensor:
    """The unnormalised transform of (x/ℓ)·s_i (0 past x.numel()) in a fresh float32
    buffer of `padded` elements; x flat contiguous float32 that `supports` takes."""
    buf = torch.empty(padded, dtype=torch.float32, device=x.device)
    _transform(x, buf, x.numel(), _scale_of_norm(x, max_norm), 0.0, _ROTATE, _STORE, buf,
               sizes, sign_seed)
    return buf


def rotate_encode(x: torch.Tensor, padded: int, max_norm: float, sign_seed: int,
                  t_p: float, granularity: int, table: torch.Tensor, lut: torch.Tensor,
                  seed: int, indices: bool = True, table_values: torch.Tensor | None = None,
                  values_out: torch.Tensor | None = None, count: bool = True, **sizes,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
    """thc.RotatedGrid.encode_values' torch steps in the transform's passes: (z int32 or
    None, T[z] from `table_values` into `values_out` (or a fresh tensor) or None, the
    number of |r| > t_p or None without `count`). `table` float32, `lut` its
    thc.interval_lut (int32), all contiguous on x's device; the noise keyed by `seed`."""
    buf = torch.empty(padded, dtype=torch.float32, device=x.device)
    enc = {"seed": seed, "lut": lut, "table": table, "t": round_f32(t_p),
           "scale": round_f32(granularity / (2 * t_p)), "top": round_f32(granularity)}
    z = values = counted = None
    if indices:
        z = enc["z"] = torch.empty(padded, dtype=torch.int32, device=x.device)
    if table_values is not None:
        values = values_out if values_out is not None else torch.empty(
            padded, dtype=table_values.dtype, device=x.device)
        enc["table_values"] = table_values
        enc["values"] = values
    if count:
        counted = enc["count"] = torch.zeros(1, dtype=torch.int64, device=x.device)
    # (the indices stand in for the values' destination when no values are written)
    dst = values if values is not None else (z if z is not None else buf)
    _transform(x, buf, x.numel(), _scale_of_norm(x, max_norm), 0.0, _ROTATE, _ENCODE, dst,
               sizes, sign_seed, enc)
    return z, values, (int(counted) if count else None)


def decode(total: torch.Tensor, numel: int, a: float, b: float, sign_seed: int,
           out: torch.Tensor | None = None, **sizes) -> torch.Tensor:
    """The first `numel` coordinates of s_i·H(total·a + b) (float32; total the padded
    uint8/int32/int64 sums, contiguous): into `out` (numel float32 on total's device)
    when given, else a view of a fresh padded buffer. a and b are rounded to float32, and
    the map is float32(total)·a, then + b, each rounded: torch's mul_ then add_."""
    buf = torch.empty(total.numel(), dtype=torch.float32, device=total.device)
    dst = buf if out is None else out
    _transform(total, buf, numel, round_f32(a), round_f32(b), _AFFINE, _UNSIGN, dst, sizes,
               sign_seed)
    return buf[:numel] if out is None else out


def unsign_(x: torch.Tensor, numel: int, sign_seed: int) -> torch.Tensor:
    """x_i ← x_i·s_i for i < numel, in place (x contiguous float32 that `supports` takes)."""
    if numel:
        s0, s1 = _words(sign_seed)
        _unsign_kernel[(-(-numel // _UNSIGN_BLOCK),)](x, numel, s0, s1, BLOCK=_UNSIGN_BLOCK)
    return x
