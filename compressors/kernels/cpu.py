"""ctypes bindings of the C++ kernels (csrc/kernels.cpp): the magnitude passes of the
threshold sparsifiers, the batched sparse decode, sign packing and the sums of signs and
levels, DRAGONN's slot write, the FWHT, and this thread's workspaces.

Every function here takes tensors `takes` accepts (contiguous CPU float32/float64, not
requiring grad) and assumes the library is loaded: callers pick this implementation
through compressors/kernels/ops.py, which falls back to the torch twins of reference.py
for everything else. Comparisons are made in x's precision with the threshold rounded as
torch rounds it, so selections equal the torch reference's for the same threshold.
"""

from __future__ import annotations

import ctypes
import math
import threading

import torch

from compressors.kernels import build
from compressors.kernels.types import NonFinite, Stats

# Below this many elements per thread a second thread costs more than it saves.
MIN_PER_THREAD = 1 << 17
# pool() and select(): above this expected kept fraction the branch-free ("dense")
# compaction, which writes every group of 8 through a permutation table, beats skipping
# the groups without a hit above about 1% kept (benchmarks/kernels/select_layout.py:
# float32, 26M elements, 2 threads, skipping vs branch-free, ms: 0.5% 7.0 vs 7.7, 1% 9.8
# vs 8.5, 2% 16.0 vs 8.3, 10% 35.7 vs 10.8).
DENSE_FRACTION = 0.01
# kernels.cpp NARROW_LIMIT: int32 positions, with space for 8-lane writes past the last.
NARROW_LIMIT = (1 << 31) - 16

_C_INT64 = ctypes.c_int64
_P = ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_declared: set[int] = set()


def _declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of every function of kernels.cpp."""
    for suffix, ptr in (("f32", ctypes.c_void_p), ("f64", ctypes.c_void_p)):
        f = getattr(lib, f"gc_stats_{suffix}")
        f.argtypes = [ptr, _C_INT64, ctypes.c_int, ctypes.c_int, ctypes.c_double,
                      ctypes.c_double, ctypes.c_int, _P]
        f.restype = None
        f = getattr(lib, f"gc_count_{suffix}")
        f.argtypes = [ptr, _C_INT64, ctypes.c_int, ctypes.c_double, ctypes.c_int]
        f.restype = _C_INT64
        f = getattr(lib, f"gc_select_begin_{suffix}")
        f.argtypes = [ptr, _P, _C_INT64, ctypes.c_int, ctypes.c_double, ctypes.c_int,
                      ctypes.c_int, _C_INT64, ctypes.c_int, ctypes.c_int,
                      ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_C_INT64)]
        f.restype = _P
        f = getattr(lib, f"gc_fwht_{suffix}")
        f.argtypes = [ptr, _C_INT64, _C_INT64, ctypes.c_int]
        f.restype = None
        f = getattr(lib, f"gc_sample_abs_{suffix}")
        f.argtypes = [ptr, _C_INT64, _C_INT64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ptr]
        f.restype = None
        f = getattr(lib, f"gc_dragonn_slots_{suffix}")
        f.argtypes = [_P, _C_INT64, _C_INT64, ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                      ctypes.c_uint32, ptr, _P, ptr, ptr]
        f.restype = ctypes.c_int
        f = getattr(lib, f"gc_all_finite_{suffix}")
        f.argtypes = [ptr, _C_INT64, ctypes.c_int]
        f.restype = ctypes.c_int
        f = getattr(lib, f"gc_select_take_{suffix}")
        f.argtypes = [_P, _P, _P, _P]
        f.restype = None
        f = getattr(lib, f"gc_pack_signs_{suffix}")
        f.argtypes = [ptr, _C_INT64, _P, ctypes.c_int]
        f.restype = None
        f = getattr(lib, f"gc_scatter_mean_{suffix}")
        f.argtypes = [_P, ctypes.c_int, ptr, _C_INT64, ptr, _C_INT64, ctypes.c_double,
                      ctypes.c_int]
        f.restype = _C_INT64
    lib.gc_pool_begin_f32.argtypes = [_P, _C_INT64, ctypes.c_int, ctypes.c_double,
                                      ctypes.c_double, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_double, ctypes.c_int, ctypes.c_int, _C_INT64, _P,
                                      ctypes.POINTER(_C_INT64), ctypes.c_int]
    lib.gc_pool_begin_f32.restype = _P
    lib.gc_add_signs.argtypes = [_P, ctypes.c_int, _P, _C_INT64, _P, _C_INT64, _P, ctypes.c_int]
    lib.gc_add_signs.restype = None
    lib.gc_sidco_spec_f32.argtypes = [_P, _C_INT64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_double, ctypes.c_double, ctypes.c_double, _P,
                                      _P, _P, _P, ctypes.POINTER(_C_INT64),
                                      ctypes.POINTER(_C_INT64)]
    lib.gc_sidco_spec_f32.restype = ctypes.c_int
    lib.gc_stream_select.argtypes = [_P, _C_INT64, _C_INT64, _P, _C_INT64, _P, ctypes.c_int]
    lib.gc_stream_select.restype = ctypes.c_int
    lib.gc_add_levels.argtypes = [_P, _P, ctypes.c_int, _C_INT64, _P, _C_INT64, _P,
                                  ctypes.c_int]
    lib.gc_add_levels.restype = None
    lib.gc_release_workspaces.argtypes = []
    lib.gc_release_workspaces.restype = None
    lib.gc_advise_huge.argtypes = [_P, _C_INT64]
    lib.gc_advise_huge.restype = None



def library() -> ctypes.CDLL:
    """The loaded library with its functions declared; RuntimeError when it is not
    available (ops.available() says so first)."""
    lib = build.load()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable ({build.error() or 'GRADCOMP_NATIVE=0'})")
    if id(lib) not in _declared:
        _declare(lib)
        _declared.add(id(lib))
    return lib


def available() -> bool:
    """Whether the library is loaded (built, and allowed by GRADCOMP_NATIVE)."""
    return build.available()


def takes(t: torch.Tensor) -> bool:
    """Whether these kernels take `t` (the library's availability aside): contiguous,
    non-empty CPU float32/float64 not requiring grad."""
    return (t.is_cpu and t.dtype in _SUFFIX and t.is_contiguous()
            and t.numel() > 0 and not t.requires_grad)


def threads(n: int) -> int:
    """Threads for a pass over n elements: at least MIN_PER_THREAD each."""
    return max(1, min(torch.get_num_threads(), n // MIN_PER_THREAD))


def _fn(name: str, t: torch.Tensor):
    return getattr(library(), f"{name}_{_SUFFIX[t.dtype]}")


def stats(x: torch.Tensor, above: float | None = None, shift: float = 0.0,
          squares: bool = False, extremes: bool = False, logs: bool = False,
          nonzeros: bool = False) -> Stats:
    """One read pass of |x| (see Stats). `above` compares in x's precision as torch does;
    Σy² only with `squares`; max, min and nonzeros only with `extremes` (or `logs`); the
    nonzeros alone with `nonzeros` (one compare a lane: what SIDCo's first fits divide
    by, as they leave exact zeros out)."""
    out = (ctypes.c_double * 7)()
    n = x.numel()
    flags = ((1 if squares else 0) | (2 if extremes else 0) | (4 if logs else 0)
             | (8 if nonzeros else 0))
    _fn("gc_stats", x)(x.data_ptr(), n, threads(n), int(above is None),
                       0.0 if above is None else float(above), float(shift), flags, out)
    return Stats.of(out)


def count(x: torch.Tensor, t: float, strict: bool = False) -> int:
    """#{|x| ≥ t} (#{|x| > t} when strict), t rounded to x's precision as torch does."""
    n = x.numel()
    return int(_fn("gc_count", x)(x.data_ptr(), n, threads(n), float(t), int(strict)))


def select(x: torch.Tensor, t: float | torch.Tensor, strict: bool = False,
           values: bool = False, index_map: torch.Tensor | None = None, reserve: int = 0,
           check_finite: bool = False, signed: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ascending positions (int64) of {|x| ≥ t} ({|x| > t} when strict) and, with
    `values`, their |x| (x's dtype), or with `signed` their x itself (what a sparsifier
    sends, taken in the same read instead of gathered from x again). With `index_map`
    (int64, one per element of x) the positions are mapped through it. One read pass;
    outputs allocated at their exact size.
    `check_finite`: raise NonFinite when x holds a NaN or an Inf, found in the same read.
    `reserve`: the number of hits expected (presizes the buffers); when it is more than
    DENSE_FRACTION of a float32 x (with no index_map) the hits are written branch-free,
    the same result faster at such densities. `t` may be a one-element tensor."""
    if signed and index_map is not None:
        raise ValueError("select(signed=True) takes no index_map: the values are read at "
                         "positions in x, which the map would hide")
    if isinstance(t, torch.Tensor):
        t = float(t)
    n = x.numel()
    total = _C_INT64(0)
    bad = ctypes.c_int(0)
    handle = _fn("gc_select_begin", x)(
        x.data_ptr(), None if index_map is None else index_map.data_ptr(), n, threads(n),
        float(t), int(strict), (2 if signed else 1) if values else 0, int(reserve),
        int(check_finite),
        int(reserve > DENSE_FRACTION * n), ctypes.byref(bad), ctypes.byref(total))
    if not handle:
        raise MemoryError("native selection could not allocate its buffers")
    if bad.value:
        _fn("gc_select_take", x)(handle, None, None, None)  # frees the selection
        raise NonFinite("the tensor holds NaN or Inf")
    idx = torch.empty(total.value, dtype=torch.int64)
    val = torch.empty(total.value, dtype=x.dtype) if values else None
    _fn("gc_select_take", x)(handle, idx.data_ptr(), None,
                             None if val is None else val.data_ptr())
    return idx, val


def pool(x: torch.Tensor, t: float, above: float | None = None, shift: float = 0.0,
         squares: bool = False, extremes: bool = False, dense: bool = False, reserve: int = 0,
         strict: bool = True, index_dtype: torch.dtype = torch.int64, signed: bool = False,
         workspace: str | None = None,
         ) -> tuple[Stats | None, torch.Tensor | None, torch.Tensor]:
    """float32 only. Ascending positions (`index_dtype`: int64, or int32 for fewer than
    2^31 elements) and |x| (x itself with `signed`) of {|x| > t} ({|x| ≥ t} when not
    `strict`) (the next "pool"), and, when `above` is given, in the same read the
    statistics `stats(x, above, shift, squares, extremes)` would return (bit for bit: the
    same per-block partials; nonzeros count only with `extremes`, no logs). `dense`: more
    than a few percent are expected to pass (the hits are written branch-free; with int32
    positions, a store less per group of 8). One read pass of x.
    `workspace`: for a caller that needs only the values, such as a search that narrows
    its pool probe by probe: no positions (None), and the values written into this
    thread's workspace of that name, kept between calls (no fresh buffer each time), a
    view valid until the thread's next call with that workspace. x may itself be a view
    of the workspace: the hits are compacted before any is written out."""
    if x.dtype != torch.float32 or not takes(x):
        raise TypeError(f"pool() takes contiguous CPU float32 tensors, got {x.dtype} on "
                        f"{x.device} (contiguous: {x.is_contiguous()})")
    n = x.numel()
    if index_dtype not in (torch.int64, torch.int32) or (
            index_dtype == torch.int32 and n >= 1 << 31):
        raise ValueError(f"pool() positions are int64, or int32 below 2^31 elements; got "
                         f"{index_dtype} for {n} elements")
    out = (ctypes.c_double * 7)()
    total = _C_INT64(0)
    flags = (1 if squares else 0) | (2 if extremes else 0) | (4 if signed else 0)
    narrow = index_dtype == torch.int32
    handle = library().gc_pool_begin_f32(
        x.data_ptr(), n, threads(n), 0.0 if above is None else float(above), float(shift),
        flags, int(above is not None), float(t), int(strict), int(dense), int(reserve), out,
        ctypes.byref(total), int(narrow))
    if not handle:
        raise MemoryError("native pool could not allocate its buffers")
    m = total.value
    if workspace is None:
        idx = torch.empty(m, dtype=index_dtype)
        val = torch.empty(m, dtype=x.dtype)
        _fn("gc_select_take", x)(handle, None if narrow else idx.data_ptr(),
                                 idx.data_ptr() if narrow else None, val.data_ptr())
    else:
        # At least half of x, so that the steps of one tensor reuse the workspace
        # whatever their counts (a search narrows its pool where at most half passes;
        # only the pages written are mapped). x, if it is a view of the workspace, is no
        # smaller than what is asked: the workspace is not regrown under it.
        idx, val = None, workspace_buffer(("pool", workspace), max(m, n // 2), x.dtype)[:m]
        _fn("gc_select_take", x)(handle, None, None, val.data_ptr())
    st = None
    if above is not None:
        st = Stats.of(out)
    return st, idx, val


class StreamPositions:
    """The positions in x of sidco_spec's stream, held as a bitmap of x (bit i of byte
    i // 8: x[i] is in the stream) rather than written out: the caller looks up only the
    few it selects. Valid as long as the workspace it lives in (stream_workspace)."""

    def __init__(self, bitmap: torch.Tensor, numel: int, count: int):
        self.bitmap, self.numel, self.count = bitmap, numel, count

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """The int32 positions in x of stream entries `index` (ascending, each below the
        stream's size), as positions_tensor.index_select(0, index) would give them."""
        if dim != 0:
            raise IndexError(f"StreamPositions is one-dimensional, got dim={dim}")
        q = index.to(torch.int32).contiguous()
        out = torch.empty(q.numel(), dtype=torch.int32)
        if q.numel():
            code = library().gc_stream_select(self.bitmap.data_ptr(), self.numel, self.count,
                                           q.data_ptr(), q.numel(), out.data_ptr(),
                                           torch.get_num_threads())
            if code == -1:
                raise ValueError("StreamPositions.index_select() takes ascending, non-negative "
                                 "stream indices")
            if code:
                raise IndexError(f"stream index {int(q[-1])} out of range for a stream of "
                                 f"{self.count} elements")
        return out

    def tensor(self) -> torch.Tensor:
        """Every position, ascending (int32): the stream's whole positions tensor."""
        return self.index_select(0, torch.arange(self.count, dtype=torch.int32))


def sidco_spec(x: torch.Tensor, window: float, upper: float, pool_above: float,
               squares: bool = False, logs: bool = False,
               workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               mid_squares: bool | None = None,
               ) -> tuple[Stats, Stats, StreamPositions, torch.Tensor, torch.Tensor]:
    """SIDCo's speculative first read of a contiguous CPU float32 x of fewer than 2^31
    elements (compressors/sidco.py): (every element's Stats, as stats(x, squares=...,
    logs=..., nonzeros=True) gives their count, sums, nonzeros (always counted: every
    first fit divides by them) and Σ ln|x| bit for bit; `mid`: count and
    Σ|x| over |x| ≥ upper, or with `mid_squares` (default: `squares`) the count, Σz and
    Σz² of z = |x| − upper there, where `upper` is rounded to float32 first; the stream's
    positions in x (StreamPositions) and its x (signed: stats, pool and select compare
    |x|, and the values finally selected are the ones sent), ascending, over |x| >
    pool_above; the window's x, ascending, over window ≤ |x| < upper, without positions).
    The bounds compare in float32 as torch does; window ≤ upper ≤ pool_above. One read
    pass.

    The stream and the window are written straight where they are returned: into
    `workspace` (stream_workspace), a contiguous uint8 CPU tensor of at least
    stream_bitmap_bytes(x.numel()) bytes for the positions' bitmap and two contiguous
    float32 ones of at least x.numel() elements for the values, kept by the caller between
    calls (the stream and window are then views of them, valid until their next use),
    or, without `workspace`, into fresh tensors."""
    if not (takes(x) and x.dtype == torch.float32 and x.numel() < NARROW_LIMIT):
        raise TypeError(f"sidco_spec() takes contiguous CPU float32 tensors of fewer than "
                        f"2^31 elements, got {x.dtype} on {x.device} ({x.numel()} elements)")
    n = x.numel()
    if workspace is None:
        workspace = (torch.empty(stream_bitmap_bytes(n), dtype=torch.uint8),
                     torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32))
    bits, val, win = workspace
    if not (bits.dtype == torch.uint8 and bits.is_contiguous() and bits.device.type == "cpu"
            and bits.numel() >= stream_bitmap_bytes(n)
            and all(v.dtype == torch.float32 and v.is_contiguous() and v.device.type == "cpu"
                    and v.numel() >= n for v in (val, win))):
        raise TypeError(f"sidco_spec() needs a workspace for a bitmap of "
                        f"{stream_bitmap_bytes(n)} uint8 and twice {n} float32 values (contiguous CPU tensors), got "
                        f"{bits.dtype} × {bits.numel()}, {val.dtype} × {val.numel()} and "
                        f"{win.dtype} × {win.numel()}")
    v0, w0 = val.data_ptr(), win.data_ptr()
    if v0 < w0 + 4 * n and w0 < v0 + 4 * n:  # both are written 16 lanes at a time
        raise ValueError("sidco_spec() needs two separate buffers for the stream's and the "
                         "window's values: the tensors given overlap")
    out = (ctypes.c_double * 10)()
    total, wtotal = _C_INT64(0), _C_INT64(0)
    mid_squares = squares if mid_squares is None else mid_squares
    flags = (1 if squares else 0) | (2 if mid_squares else 0)
    if library().gc_sidco_spec_f32(x.data_ptr(), n, threads(n), flags, int(logs),
                                   float(window), float(upper), float(pool_above),
                                   bits.data_ptr(), val.data_ptr(), win.data_ptr(), out,
                                   ctypes.byref(total), ctypes.byref(wtotal)):
        raise MemoryError("native sidco_spec could not allocate its partial sums")
    first = Stats.of(out)
    mid = Stats(int(out[7]), out[8], out[9], -1.0, math.inf, 0, 0.0)
    return (first, mid, StreamPositions(bits, n, total.value), val[:total.value],
            win[:wtotal.value])


def stream_bitmap_bytes(n: int) -> int:
    """The bytes of sidco_spec's bitmap for n elements: ⌈n/64⌉ 64-bit words, then an int32
    checkpoint per 512 elements (the stream's size before them), then 64 bytes of padding
    (the last checkpoint's eight words are read whole)."""
    return 8 * ((n + 63) // 64) + 4 * ((n + 511) // 512) + 64


def scatter_mean(idx: torch.Tensor, val: torch.Tensor, out: torch.Tensor,
                 divisor: int) -> torch.Tensor:
    """out ← 0, out[idx[j]] += val[j] in order, out /= divisor (when > 1): bit for bit
    `out.zero_().index_add_(0, idx, val).div_(divisor)`, with `out` written once, region
    by region: the ranks' ascending selections merged (up to 64 runs), other pairs after a
    stable counting sort by region. Contiguous `out` and `val` of one float dtype
    (takes), 1-D int32/int64 `idx`. IndexError (nothing written) for an index outside
    [0, out.numel())."""
    if not (takes(out) and val.dtype == out.dtype and val.device == out.device
            and val.is_contiguous() and idx.dtype in (torch.int32, torch.int64)
            and idx.device == out.device and idx.is_contiguous()
            and idx.numel() == val.numel()):
        raise TypeError("scatter_mean() takes a contiguous CPU float32/float64 out, values of "
                        "its dtype and as many contiguous int32/int64 indices; got "
                        f"out {out.dtype} on {out.device}, values {val.dtype}, indices {idx.dtype}")
    n = out.numel()
    bad = _fn("gc_scatter_mean", out)(
        idx.data_ptr(), int(idx.dtype == torch.int64), val.data_ptr(), val.numel(),
        out.data_ptr(), n, float(divisor), threads(n))
    if bad == -2:
        raise MemoryError("native scatter_mean could not allocate its buffers")
    if bad >= 0:
        raise IndexError(f"index {int(idx[bad])} at position {bad} is out of bounds for a "
                         f"tensor of {n} elements")
    return out


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """SignSGD's 1-bit wire: bit 7 − j of byte i is set where x[8i + j] ≥ 0, ceil(n/8)
    uint8 (reference.pack_signs, the same bytes). One read of x."""
    n = x.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    _fn("gc_pack_signs", x)(x.data_ptr(), n, out.data_ptr(), threads(n))
    return out


_SIGN_TOTALS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3}


def takes_signs(total: torch.Tensor) -> bool:
    """Whether add_signs_ takes this total (one rank's signs are added into it)."""
    return (total.dtype in _SIGN_TOTALS and total.device.type == "cpu"
            and total.is_contiguous())


def add_signs_(total: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """In place, for i in group g (`offsets`: int64 group starts and the end): total[i] +=
    weights[g] where bit i of `packed` (pack_signs' layout) is set, −weights[g] where it
    is not. CPU, contiguous; total float32, int8, int16 or int32 and weights of its dtype
    (reference.add_signs_: the torch form, the same bits)."""
    if (total.dtype not in _SIGN_TOTALS or total.device.type != "cpu"
            or not total.is_contiguous() or weights.dtype != total.dtype
            or packed.dtype != torch.uint8 or packed.numel() * 8 < total.numel()):
        raise TypeError(f"add_signs_() takes a contiguous CPU float32/int8/int16/int32 total, "
                        f"weights of its dtype and enough uint8 signs; got {total.dtype}, "
                        f"{weights.dtype}, {packed.dtype} ({packed.numel()} bytes)")
    n = total.numel()
    packed, weights, offsets = packed.contiguous(), weights.contiguous(), offsets.contiguous()
    library().gc_add_signs(total.data_ptr(), _SIGN_TOTALS[total.dtype], packed.data_ptr(),
                           n, offsets.data_ptr(), offsets.numel() - 1, weights.data_ptr(),
                           threads(n))
    return total


_LEVEL_TYPES = {torch.int8: 1, torch.int16: 2, torch.int32: 3}


def takes_levels(total: torch.Tensor, levels: torch.Tensor) -> bool:
    """Whether add_levels_ takes this float32 total and these levels (one rank's payload)."""
    return (total.dtype == torch.float32 and levels.dtype in _LEVEL_TYPES
            and total.device.type == "cpu" and levels.device.type == "cpu"
            and total.is_contiguous())


def add_levels_(total: torch.Tensor, levels: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """In place, for i in group g (`offsets`: int64 group starts and the end): total[i] +=
    float(levels[i]) · weights[g]. CPU, total contiguous float32, levels int8/int16/int32
    of total's size, weights float32 (reference.add_levels_: the torch form, the same
    bits)."""
    if not takes_levels(total, levels) or weights.dtype != torch.float32 \
            or levels.numel() != total.numel():
        raise TypeError(f"add_levels_() takes a contiguous CPU float32 total, int8/int16/int32 "
                        f"levels of its size and float32 weights; got {total.dtype} "
                        f"({total.numel()}), {levels.dtype} ({levels.numel()}), {weights.dtype}")
    n = total.numel()
    levels, weights, offsets = levels.contiguous(), weights.contiguous(), offsets.contiguous()
    library().gc_add_levels(total.data_ptr(), levels.data_ptr(), _LEVEL_TYPES[levels.dtype],
                            n, offsets.data_ptr(), offsets.numel() - 1, weights.data_ptr(),
                            threads(n))
    return total


def dragonn_slots(keys: torch.Tensor, m: int, index_bits: int, priority_bits: int,
                  seeds: tuple[int, int], acc: torch.Tensor, values: bool = True,
                  key_values: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DRAGONN's memory write and value gather (reference.write_slots, then acc at each
    slot): (slots int64, −1 where empty; values in acc's dtype, 0 where
    empty, or None without `values`). keys: contiguous int64 candidate indices of acc (a
    contiguous CPU float32/64 tensor of at most 2^32 elements; with `values` every key
    must index it); m < 2^31. `key_values`: acc at the keys (as select(..., signed=True)
    writes them, the keys then ascending), read in place of acc's scattered lines."""
    if not takes(acc) or keys.dtype != torch.int64 or not keys.is_contiguous():
        raise TypeError("dragonn_slots() takes contiguous int64 keys and a contiguous CPU "
                        "float32/float64 acc")
    if key_values is not None and not (
            key_values.dtype == acc.dtype and key_values.is_contiguous()
            and key_values.device.type == "cpu" and key_values.numel() == keys.numel()):
        raise TypeError(f"dragonn_slots() key_values must be a contiguous CPU {acc.dtype} "
                        f"tensor with one value per key ({keys.numel()})")
    slots = torch.empty(m, dtype=torch.int64)
    out = torch.empty(m, dtype=acc.dtype) if values else None
    if _fn("gc_dragonn_slots", acc)(
            keys.data_ptr(), keys.numel(), m, index_bits, priority_bits, seeds[0], seeds[1],
            acc.data_ptr(), slots.data_ptr(), None if out is None else out.data_ptr(),
            None if key_values is None else key_values.data_ptr()):
        raise ValueError("dragonn_slots() with key_values takes ascending keys (as a "
                         "selection writes them)")
    return slots, out


def all_finite(x: torch.Tensor) -> bool:
    """bool(torch.isfinite(x).all()) in one read pass with no bool buffer."""
    n = x.numel()
    return bool(_fn("gc_all_finite", x)(x.data_ptr(), n, threads(n)))


def sample_abs(x: torch.Tensor, s: int, k0: int | torch.Tensor, k1: int = 0) -> torch.Tensor:
    """|x[p_i]| for i < s, p_i = (h(i)·n) >> 32 with the counter hash keyed by the 32-bit
    words (k0, k1) (counter_stream.counter_hash; n = x.numel() < 2^31): a uniform sample
    with replacement drawn and read in one pass, no positions tensor. k0 may instead be an
    int64 tensor holding both words."""
    n = x.numel()
    if not takes(x):
        raise TypeError("sample_abs() takes a contiguous CPU float32/float64 tensor")
    if n >= 1 << 31:
        raise ValueError("sample_abs needs fewer than 2^31 elements")
    if isinstance(k0, torch.Tensor):
        k0, k1 = (int(w) for w in k0.tolist())
    out = torch.empty(s, dtype=x.dtype)
    if s:
        workers = max(1, min(torch.get_num_threads(), s // (1 << 14)))
        _fn("gc_sample_abs", x)(x.data_ptr(), n, s, k0, k1, workers, out.data_ptr())
    return out


_workspaces = threading.local()


def workspace_buffer(key, n: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's workspace `key`: at least n elements of dtype, kept between calls and
    grown when a larger one is asked for (the old one is given back before the new one is
    had). Only the pages written are ever mapped."""
    kept = getattr(_workspaces, "kept", None)
    if kept is None:
        kept = _workspaces.kept = {}
    buf = kept.get(key)
    if buf is None or buf.numel() < n:
        kept.pop(key, None)
        buf = kept[key] = empty(n, dtype)
    return buf


def stream_workspace(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's workspace for sidco_spec's stream of a tensor of n elements: the
    positions' bitmap (uint8, stream_bitmap_bytes(n)) and two float32 tensors of at least n
    values (the stream's and the window's), kept between calls (grown when a larger tensor
    comes) and shared by every caller on the thread, so each must be done with a stream
    before the next call. The bitmap (an eighth of a byte per element, and its
    checkpoints) is written whole; of the values only the pages a stream or window touches
    are ever mapped (4 bytes per element of either)."""
    return (workspace_buffer("stream bitmap", stream_bitmap_bytes(n), torch.uint8),
            workspace_buffer("stream values", n, torch.float32),
            workspace_buffer("stream window", n, torch.float32))


def abs_into_workspace(x: torch.Tensor) -> torch.Tensor:
    """|x| of a CPU tensor written into this thread's magnitude workspace of x's dtype
    (what torch.topk reads: a fresh |x| costs a page fault per 4 KiB of a large tensor, 39
    against 7 ms at 26M float32 here), returned as a view of it in x's shape, valid until
    the thread's next call."""
    n = x.numel()
    return torch.abs(x, out=workspace_buffer(("magnitudes", x.dtype), n, x.dtype)[:n]
                     .view(x.shape))


def release_workspaces() -> None:
    """Give back this thread's workspaces (the SIDCo stream, the magnitudes, the pools of
    pool(..., workspace=)) and the selections' pooled hit buffers (the largest ever used,
    up to 8). The next call allocates afresh."""
    _workspaces.kept = None
    if build.load() is not None:
        library().gc_release_workspaces()


def empty(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(n) (CPU), asking for transparent huge pages before its first write when
    the library is loaded (large fresh buffers otherwise cost a page fault per 4 KiB on
    first touch, about 10x the cost of writing them). Contents and results unchanged."""
    out = torch.empty(n, dtype=dtype)
    if out.numel() and build.load() is not None:
        library().gc_advise_huge(out.data_ptr(), out.numel() * out.element_size())
    return out


def fwht_(x: torch.Tensor) -> torch.Tensor:
    """In-place unnormalised Walsh–Hadamard transform of the last dimension (a power of
    two), cache-blocked and threaded; equal bit for bit to reference.fwht_'s torch
    butterflies (same operations, same stage order)."""
    d = x.shape[-1] if x.dim() else 1
    rows = x.numel() // d if d else 0
    if rows and d > 1:
        _fn("gc_fwht", x)(x.data_ptr(), rows, d, threads(x.numel()))
    return x
