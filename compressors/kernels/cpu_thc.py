"""ctypes bindings of THC's kernels and the counter-hash stream (csrc/thc_kernels.cpp):
the random stream (stochastic-rounding noise, RHT signs) generated inside the fused
passes instead of read from torch.rand buffers. The torch twins compute the same stream
(counter_stream.py) where the library is unavailable (GRADCOMP_NATIVE=0, GPU tensors, no
compiler); tests check that both give the same bits.

Everything takes contiguous CPU float32 tensors and assumes the library is loaded
(ops.available()). Seeds are 64-bit integers, passed as two 32-bit words (low, high)."""

from __future__ import annotations

import ctypes
import threading

import torch

from compressors.kernels import build
from compressors.kernels.cpu import empty, threads

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_U32 = ctypes.c_uint32
_F = ctypes.c_float
_INT = ctypes.c_int
_declared: set[int] = set()

_SIGNATURES = {
    "gc_thc_rng_fill": ([_I64, _I64, _U32, _U32, _INT, _P, _INT], None),
    "gc_thc_apply_signs_f32": ([_P, _I64, _U32, _U32, _INT], None),
    "gc_thc_encode_hash_f32": ([_P, _I64, _INT, _F, _F, _F, _P, _INT, _P, _P, _U32, _U32, _P,
                                _P, _INT], _I64),
    "gc_thc_rotate_f32": ([_P, _I64, _I64, _F, _U32, _U32, _P, _INT], None),
    "gc_thc_rotate_encode_f32": ([_P, _I64, _I64, _F, _U32, _U32, _P, _INT, _F, _F, _F, _P, _INT,
                                  _P, _P, _U32, _U32, _P, _P, _INT], _I64),
    "gc_thc_decode_f32": ([_P, _INT, _I64, _I64, _F, _F, _U32, _U32, _P, _INT], None),
    "gc_thc_uniform_encode_f32": ([_P, _I64, _INT, _F, _F, _F, _U32, _U32, _P], None),
    "gc_stochastic_levels_f32": ([_P, _I64, _P, _I64, _P, _P, _F, _U32, _U32, _P, _INT, _INT],
                                 None),
}
VALUE_BYTES = {torch.uint8: 1, torch.int32: 4, torch.int64: 8}
NOISE, SIGNS = 0, 1


def _lib() -> ctypes.CDLL:
    lib = build.load()
    if lib is None:
        raise RuntimeError("native kernels unavailable; check ops.available() first")
    if id(lib) not in _declared:
        for name, (args, res) in _SIGNATURES.items():
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = res
        _declared.add(id(lib))
    return lib


def words(seed: int) -> tuple[int, int]:
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & 0xFFFFFFFF, seed >> 32


def _empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh output buffer. Plain torch.empty, no huge-page advice: measured here (THP
    defrag "madvise"), advised fresh 128 MiB outputs stalled in direct compaction
    (THC decode 480-585 ms per step vs 305-330 ms without the advice) once memory was
    fragmented; only the reused transform workspace below asks for huge pages."""
    return torch.empty(n, dtype=dtype)


def _output(out: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor:
    """`out` when the caller gave one (a buffer it keeps between steps,
    Context.workspace), checked: contiguous CPU, n elements of dtype; else a fresh tensor."""
    if out is None:
        return _empty(n, dtype)
    if (out.dtype != dtype or out.numel() != n or not out.is_contiguous()
            or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous CPU {dtype} tensor of {n} elements, not "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def rng_fill(n: int, seed: int, kind: int, start: int = 0) -> torch.Tensor:
    """Elements [start, start + n) of the stream keyed by `seed`: NOISE (u in [0, 1)) or
    SIGNS (±1.0), float32."""
    out = _empty(n, torch.float32)
    if n:
        k0, k1 = words(seed)
        _lib().gc_thc_rng_fill(start, n, k0, k1, kind, out.data_ptr(), threads(n))
    return out


def apply_signs_(x: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
    """In place: x[i] ·= s_i for i < numel (x contiguous CPU float32)."""
    k0, k1 = words(seed)
    _lib().gc_thc_apply_signs_f32(x.data_ptr(), numel, k0, k1, threads(numel))
    return x


def encode(rotated: torch.Tensor, t_p: float, granularity: int, table: torch.Tensor,
           gaps: torch.Tensor, lut: torch.Tensor, seed: int, indices: bool = True,
           value_dtype: torch.dtype | None = None,
           ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """THC's grid quantisation in one pass with the noise of the stream keyed by `seed`:
    (z int32 or None, T[z] as value_dtype or None, #{|rotated| > t_p}). `table`: the
    float32 table (integers, increasing), `gaps` its differences, `lut` its
    interval_lut (int32), all contiguous CPU."""
    n = rotated.numel()
    z = torch.empty(n, dtype=torch.int32) if indices else None
    values = _empty(n, value_dtype) if value_dtype is not None else None
    k0, k1 = words(seed)
    clamped = _lib().gc_thc_encode_hash_f32(
        rotated.data_ptr(), n, threads(n), float(t_p), float(granularity / (2 * t_p)),
        float(granularity), table.data_ptr(), table.numel(), gaps.data_ptr(), lut.data_ptr(),
        k0, k1,
        None if z is None else z.data_ptr(), None if values is None else values.data_ptr(),
        0 if values is None else VALUE_BYTES[value_dtype])
    return z, values, int(clamped)


def rotate(x: torch.Tensor, padded: int, norm: float, sign_seed: int) -> torch.Tensor:
    """The unnormalised FWHT of the padded RHT input (x / norm)·s_i (zeros past
    x.numel()), in a fresh float32 buffer of `padded` elements: the input is written
    inside the transform's first (cache-blocked) pass. The same bits as the torch path
    (zeroed buffer, x / norm, × signs, FWHT)."""
    n = x.numel()
    buf = _empty(padded, torch.float32)
    k0, k1 = words(sign_seed)
    _lib().gc_thc_rotate_f32(x.data_ptr(), n, padded, float(norm), k0, k1, buf.data_ptr(),
                             threads(padded))
    return buf


_local = threading.local()


def workspace(n: int) -> torch.Tensor:
    """This thread's transform workspace: n float32 elements, kept and reused between
    calls (a fresh 128 MiB buffer costs ~15-25 ms of page faults and kernel zeroing per
    call at 2^25 elements), asking for huge pages before first touch. Its contents are
    garbage; `release_workspace()` frees it."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        _local.buf = None  # free the old one first
        buf = _local.buf = empty(n, torch.float32)
    return buf[:n]


def release_workspace() -> None:
    _local.buf = None


def rotate_encode(x: torch.Tensor, padded: int, norm: float, sign_seed: int, t_p: float,
                  granularity: int, table: torch.Tensor, gaps: torch.Tensor,
                  lut: torch.Tensor, seed: int, indices: bool = True,
                  value_dtype: torch.dtype | None = None,
                  values_out: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """rotate() and encode() fused: the FWHT's first pass writes the input, its last
    pass encodes each column strip while it is in cache. Returns what encode() returns
    (for the rotated vector of `padded` elements); the same bits. `values_out`: where
    the table values go (contiguous CPU, `padded` elements of value_dtype) instead of a
    fresh tensor."""
    n = x.numel()
    buf = workspace(padded)
    z = torch.empty(padded, dtype=torch.int32) if indices else None
    values = None if value_dtype is None else _output(values_out, padded, value_dtype)
    sk0, sk1 = words(sign_seed)
    k0, k1 = words(seed)
    clamped = _lib().gc_thc_rotate_encode_f32(
        x.data_ptr(), n, padded, float(norm), sk0, sk1, buf.data_ptr(), threads(padded),
        float(t_p), float(granularity / (2 * t_p)), float(granularity), table.data_ptr(),
        table.numel(), gaps.data_ptr(), lut.data_ptr(), k0, k1,
        None if z is None else z.data_ptr(), None if values is None else values.data_ptr(),
        0 if values is None else VALUE_BYTES[value_dtype])
    return z, values, int(clamped)


def decode(total: torch.Tensor, numel: int, a: float, b: float,
           sign_seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """THC's decompression in the FWHT's two passes: float(total)·a + b written inside
    the first, the sign flip of the first `numel` results inside the last; returns those
    `numel` floats: a view of a fresh padded buffer, or, when `out` (contiguous CPU
    float32 of numel) is given, `out` holding them (the passes then run in the reused
    transform workspace: no fresh padded buffer). `total`: contiguous CPU uint8, int32 or int64
    of power-of-two length."""
    d = total.numel()
    buf = _empty(d, torch.float32) if out is None else workspace(d)
    _decode_into(buf, total, numel, a, b, sign_seed)
    return buf[:numel] if out is None else out.copy_(buf[:numel])


def decode_in_workspace(total: torch.Tensor, numel: int, a: float, b: float,
                        sign_seed: int) -> torch.Tensor:
    """decode() into this thread's transform workspace: a view of it, valid until the next
    use of the workspace on this thread (for a result read at once, such as THC's own
    contribution that error feedback subtracts)."""
    buf = workspace(total.numel())
    _decode_into(buf, total, numel, a, b, sign_seed)
    return buf[:numel]


def _decode_into(buf: torch.Tensor, total: torch.Tensor, numel: int, a: float, b: float,
                 sign_seed: int) -> None:
    d = total.numel()
    k0, k1 = words(sign_seed)
    _lib().gc_thc_decode_f32(total.data_ptr(), VALUE_BYTES[total.dtype], d, numel, float(a),
                             float(b), k0, k1, buf.data_ptr(), threads(d))


def uniform_encode(x: torch.Tensor, lo: float, step: float, levels: int,
                   seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform THC's levels (uint8, in x's shape) of contiguous CPU float32 x: stochastic
    rounding of clamp((x − lo) / step, 0, levels) with the stream's noise; into `out` (n
    elements) if given."""
    n = x.numel()
    out = _output(out, n, torch.uint8)
    k0, k1 = words(seed)
    _lib().gc_thc_uniform_encode_f32(x.data_ptr(), n, threads(n), float(lo), float(step),
                                     float(levels), k0, k1, out.data_ptr())
    return out.view(x.shape)


LEVEL_BYTES = {torch.int8: 1, torch.int16: 2, torch.int32: 4}


def stochastic_levels(x: torch.Tensor, offsets: torch.Tensor, inv: torch.Tensor,
                      bound: torch.Tensor | None, levels: int, seed: int,
                      dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """QSGD's and TernGrad's signed stochastic levels of contiguous CPU float32 x in one
    pass (reference.stochastic_levels: the torch twin with the same bits). `offsets`: int64 group starts and the end (groups + 1 entries);
    `inv`, `bound`: float32 per group; levels ≤ 2^24; dtype int8, int16 or int32; into
    `out` if given."""
    n = x.numel()
    out = _output(out, n, dtype)
    k0, k1 = words(seed)
    _lib().gc_stochastic_levels_f32(
        x.data_ptr(), n, offsets.data_ptr(), offsets.numel() - 1, inv.data_ptr(),
        None if bound is None else bound.data_ptr(), float(levels), k0, k1, out.data_ptr(),
        LEVEL_BYTES[dtype], threads(n))
    return out
