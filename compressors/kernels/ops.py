"""The front of the kernel layer: each function picks its implementation per tensor.

- contiguous CPU float32/float64 tensors (not requiring grad) go to the C++ library
  (cpu.py, cpu_thc.py), once it is built and loaded (build.py);
- contiguous float32 tensors on the current CUDA device go to the Triton kernels
  (cuda.py), once Triton is importable and `cuda.self_test` has passed on that device
  (run once per device; a failure warns and sends every call on it to torch);
- everything else (16-bit or non-contiguous tensors, other devices, GRADCOMP_NATIVE=0, no
  compiler, no Triton) runs the torch twins of reference.py.

The implementations give the same selections, the same integers and the same rounded
bits where the functions say so (tests/kernels/test_native_kernels.py, tests/kernels/test_fastpaths.py,
tests/kernels/interpreted_gpu_checks.py); statistics agree to the summation order. The algorithm
modules call these functions and never choose an implementation themselves; the
accelerated pipelines of single algorithms live beside this module
(sidco_pipeline.py, dragonn_pipeline.py, thc_pipeline.py).

`available()` and `supports_cpu()` are the predicates every CPU choice goes through, and
`supports_cuda()` every CUDA one.
"""

from __future__ import annotations

import math
import warnings

import torch

from compressors.kernels import build, cpu, cpu_thc, reference
from compressors.kernels.counter_stream import draw_seed, draw_seed_words, seed_words
from compressors.kernels.cpu import DENSE_FRACTION, MIN_PER_THREAD, NARROW_LIMIT
from compressors.kernels.reference import flat_nonzero, unpack_signs
from compressors.kernels.types import NonFinite, Selected, Stats

__all__ = [
    "DENSE_FRACTION", "MIN_PER_THREAD", "NARROW_LIMIT", "NonFinite", "Selected", "Stats",
    "abs_into_workspace", "add_levels_", "add_signs_", "all_finite", "available",
    "count", "cuda_error", "empty", "error", "flat_nonzero", "fwht_", "l2_norm",
    "pack_signs", "pool", "release_workspaces", "sample_abs", "scatter_mean", "select",
    "stats", "stochastic_levels", "stream_noise", "stream_signs", "supports",
    "supports_cpu", "supports_cuda", "unpack_signs",
]


# -- which implementation --------------------------------------------------------------------


def available() -> bool:
    """Whether the C++ library is loaded (built, and allowed by GRADCOMP_NATIVE)."""
    return build.available()


def error() -> str | None:
    """Why the C++ library could not be built or loaded (None when it was, or not tried)."""
    return build.error()


def supports_cpu(t: torch.Tensor) -> bool:
    """Whether the C++ library takes `t`: contiguous, non-empty CPU float32/float64 not
    requiring grad, and the library loaded."""
    return cpu.takes(t) and available()


_cuda_module = None
_cuda_checked: dict = {}  # device -> None (the Triton kernels are used there) or why not


def _cuda():
    """compressors.kernels.cuda (the Triton kernels), imported at the first CUDA tensor;
    None where Triton is missing."""
    global _cuda_module
    if _cuda_module is None:
        from compressors.kernels import cuda  # noqa: PLC0415 (imports triton: only on demand)

        _cuda_module = cuda
    return _cuda_module if _cuda_module.available() else None


def cuda_error(device: torch.device) -> str | None:
    """Why the Triton kernels are not used on `device` (None when they are). Checked once
    per device by cuda.self_test: a Triton that cannot compile for this GPU, or any result
    that differs from torch's, sends every call to the torch paths, with a warning."""
    if device not in _cuda_checked:
        kernels = _cuda()
        problem = "triton is not importable" if kernels is None else kernels.self_test(device)
        if problem is not None and kernels is not None:
            warnings.warn(f"gradcomp Triton kernels unusable on {device}, using the "
                          f"pure-torch paths ({problem})", RuntimeWarning, stacklevel=3)
        _cuda_checked[device] = problem
    return _cuda_checked[device]


def supports_cuda(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take `t`: a contiguous float32 tensor on the current CUDA
    device, Triton importable, its self-test passed there, GRADCOMP_NATIVE not 0."""
    if not t.is_cuda or t.requires_grad or not build.enabled_by_environment():
        return False
    kernels = _cuda()
    return kernels is not None and kernels.supports(t) and cuda_error(t.device) is None


def supports(t: torch.Tensor) -> bool:
    """Whether stats, count, select, pool, sample_abs and all_finite run a fused kernel on
    `t` (supports_cpu on the CPU, supports_cuda on CUDA) rather than torch."""
    if t.is_cpu:
        return supports_cpu(t)
    return supports_cuda(t)


# -- magnitude passes ----------------------------------------------------------------------


def stats(x: torch.Tensor, above: float | None = None, shift: float = 0.0,
          squares: bool = False, extremes: bool = False, logs: bool = False,
          nonzeros: bool = False) -> Stats:
    """One read pass of |x| (see Stats): count, Σy and (with `squares`) Σy² of y = |x| −
    shift over the elements counted (all, or |x| > above compared in x's precision as
    torch does); with `extremes` (or `logs`) the max over all and the min over those
    counted, and the nonzeros; the nonzeros alone with `nonzeros` (one compare a lane:
    what SIDCo's first fits divide by); Σ ln|x| over x ≠ 0 with `logs`. Sums in float64."""
    if supports_cpu(x):
        return cpu.stats(x, above, shift, squares, extremes, logs, nonzeros)
    if supports_cuda(x):
        return Stats(*_cuda().stats(x, above, shift, squares, extremes, logs, nonzeros))
    return _reference_stats(x, above, shift, squares, extremes, logs, nonzeros)


def _reference_stats(x, above, shift, squares, extremes, logs, nonzeros) -> Stats:
    a = x.abs()
    counted = a if above is None else a[a > above]
    y = counted.to(torch.float64) - shift
    wide = extremes or logs
    nan_free = a[~torch.isnan(a)]
    top = float(nan_free.max()) if wide and nan_free.numel() else -1.0
    chosen = counted[~torch.isnan(counted)]
    low = float(chosen.min()) if wide and chosen.numel() else math.inf
    positive = a[a > 0]
    log_sum = float(torch.log(positive.to(torch.float64)).sum()) if logs else 0.0
    return Stats(counted.numel(), float(y.sum()), float((y * y).sum()) if squares else 0.0,
                 top, low, positive.numel() if wide or nonzeros else 0, log_sum)


def count(x: torch.Tensor, t: float, strict: bool = False) -> int:
    """#{|x| ≥ t} (#{|x| > t} when strict), t rounded to x's precision as torch does."""
    if supports_cpu(x):
        return cpu.count(x, t, strict)
    if supports_cuda(x):
        return _cuda().count(x, t, strict)
    a = x.abs()
    return int(torch.count_nonzero(a > t if strict else a >= t))


def select(x: torch.Tensor, t: float | torch.Tensor, strict: bool = False,
           values: bool = False, index_map: torch.Tensor | None = None, reserve: int = 0,
           check_finite: bool = False, signed: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ascending positions (int64) of {|x| ≥ t} ({|x| > t} when strict) and, with
    `values`, their |x| (x's dtype), or with `signed` their x itself (what a sparsifier
    sends, taken in the same read instead of gathered from x again). With `index_map`
    (int64, one per element of x) the positions are mapped through it.
    `check_finite`: raise NonFinite when x holds a NaN or an Inf, found in the same read.
    `reserve`: the number of hits expected (the CPU kernel presizes its buffers, and above
    DENSE_FRACTION of a float32 x writes them branch-free). `t` may be a one-element
    tensor in x's dtype on x's device: on CUDA the kernels read it there (no
    synchronisation for it)."""
    if signed and index_map is not None:
        raise ValueError("select(signed=True) takes no index_map: the values are read at "
                         "positions in x, which the map would hide")
    if supports_cpu(x):
        return cpu.select(x, t, strict, values, index_map, reserve, check_finite, signed)
    if supports_cuda(x):  # a counting pass, then a writing one
        idx, val = _cuda().select(x, t, strict=strict, values=values and not signed,
                                  index_map=index_map, check_finite=check_finite)
        if values and signed:  # gathered on the device (the kernel writes |x|)
            val = x.reshape(-1).index_select(0, idx)
        return idx, val
    if check_finite and not reference.all_finite(x):
        raise NonFinite("the tensor holds NaN or Inf")
    idx, val = reference.select(x, t, strict, values, signed)
    return (idx if index_map is None else index_map.index_select(0, idx)), val


def pool(x: torch.Tensor, t: float, above: float | None = None, shift: float = 0.0,
         squares: bool = False, extremes: bool = False, dense: bool = False, reserve: int = 0,
         strict: bool = True, index_dtype: torch.dtype = torch.int64, signed: bool = False,
         workspace: str | None = None,
         ) -> tuple[Stats | None, torch.Tensor | None, torch.Tensor]:
    """float32 tensors `supports` takes only. Ascending positions (`index_dtype`: int64, or
    int32 below 2^31 elements) and |x| (x itself with `signed`) of {|x| > t} ({|x| ≥ t}
    when not `strict`), and, when `above` is given, the statistics stats(x, above, shift,
    squares, extremes) would return (on the CPU in the same read, bit for bit; nonzeros
    only with `extremes`, no logs). `dense`: more than a few percent are expected to pass
    (the CPU writes the hits branch-free). `workspace`: no positions (None), the values in
    this thread's workspace of that name (cpu.pool; on CUDA a fresh tensor)."""
    if supports_cuda(x) and x.dtype == torch.float32:  # a statistics pass, then the selection
        n = x.numel()
        if index_dtype not in (torch.int64, torch.int32) or (
                index_dtype == torch.int32 and n >= 1 << 31):
            raise ValueError(f"pool() positions are int64, or int32 below 2^31 elements; got "
                             f"{index_dtype} for {n} elements")
        st = None if above is None else stats(x, above, shift, squares, extremes)
        idx, val = select(x, t, strict=strict, values=True, signed=signed)
        return st, None if workspace is not None else idx.to(index_dtype), val
    if not supports_cpu(x):
        raise TypeError(f"pool() takes contiguous CPU float32 tensors (or CUDA ones with "
                        f"Triton), got {x.dtype} on {x.device} (contiguous: {x.is_contiguous()})")
    return cpu.pool(x, t, above, shift, squares, extremes, dense, reserve, strict,
                    index_dtype, signed, workspace)


def all_finite(x: torch.Tensor) -> bool:
    """bool(torch.isfinite(x).all()), in one read pass with no bool buffer where a kernel
    takes x (measured at 26M float32 elements: ~6 ms against ~120 ms for torch, which
    builds a bool tensor first)."""
    if supports_cpu(x):
        return cpu.all_finite(x)
    if supports_cuda(x):
        return _cuda().all_finite(x)
    return reference.all_finite(x)


def sample_abs(x: torch.Tensor, s: int, generator: torch.Generator) -> torch.Tensor:
    """|x| at s positions drawn uniformly with replacement, from one 64-bit seed drawn from
    `generator` (draw_seed): below 2^31 elements p_i = (h(i)·n) >> 32 with the counter
    stream's hash h keyed by the seed, so every implementation reads the same positions
    (on CUDA with the Triton kernels and a generator on x's device the seed never leaves
    the device); above, positions from torch.randint. x flat."""
    n = x.numel()
    if n >= 1 << 31:
        positions = torch.randint(0, n, (s,), generator=generator, device=x.device)
        return x.index_select(0, positions).abs()
    if supports_cuda(x) and generator.device == x.device:
        return _cuda().sample_abs(x, s, draw_seed_words(generator))  # read on the device
    seed = draw_seed(generator)
    if supports_cpu(x):
        return cpu.sample_abs(x, s, *seed_words(seed))
    if supports_cuda(x):
        return _cuda().sample_abs(x, s, *seed_words(seed))
    return reference.sample_abs(x, s, seed)


# Below this many elements a fresh |x| comes from the allocator's free lists (no page
# faults), sooner than through the workspace's bookkeeping.
SMALL_ABS = 1 << 16


def abs_into_workspace(x: torch.Tensor) -> torch.Tensor:
    """|x| in x's shape: on the CPU, for x of SMALL_ABS elements or more, written into this
    thread's magnitude workspace (what torch.topk reads; a fresh |x| costs a page fault
    per 4 KiB of a large tensor), a view valid until the thread's next call; else a new
    |x| (caching allocators reuse memory already)."""
    if x.device.type != "cpu" or x.numel() < SMALL_ABS:
        return x.abs()
    return cpu.abs_into_workspace(x)


# -- decoding ------------------------------------------------------------------------------


def scatter_mean(idx: torch.Tensor, val: torch.Tensor, out: torch.Tensor, divisor: int,
                 lengths: list[int] | None = None) -> torch.Tensor:
    """out ← 0, out[idx[j]] += val[j] in rank order, out /= divisor (when > 1), the same
    bits on every implementation: on the CPU one native sweep that writes `out` once
    (cpu.scatter_mean), elsewhere one index_add_ per rank (`lengths`: each rank's share of
    the concatenation). Every index must be valid."""
    if supports_cpu(out) and idx.dim() == 1:
        return cpu.scatter_mean(idx.contiguous(), val.contiguous(), out, divisor)
    return reference.scatter_mean(idx, val, out, divisor, lengths)


# -- signs and levels ----------------------------------------------------------------------


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit i of the output is 1 where x[i] ≥ 0 (most significant bit first), 8 signs per
    uint8; the last byte is padded with zeros. ceil(d/8) bytes; one native pass where the
    library takes x (no full-size bool or byte tensors)."""
    if supports_cpu(x):
        return cpu.pack_signs(x)
    return reference.pack_signs(x)


def add_signs_(total: torch.Tensor, packed: torch.Tensor, groups, weights: torch.Tensor
               ) -> torch.Tensor:
    """total += unpack_signs(packed) · weights[group], in place (one rank's decoded signs;
    `groups`: compressors.quantize.Groups). On the CPU one native pass with the same bits
    (±1·w is exactly ±w), without the unpacked full-size tensor."""
    if cpu.takes_signs(total) and available():
        return cpu.add_signs_(total, packed, groups.offsets, weights.to(total.dtype))
    return reference.add_signs_(total, packed, groups, weights)


def add_levels_(total: torch.Tensor, levels: torch.Tensor, groups, weights: torch.Tensor
                ) -> torch.Tensor:
    """total += float32(levels) · weights[group], in place (one rank's decoded levels into
    a float32 total). On the CPU one native pass with the same bits (the product rounded,
    then the sum), without the converted full-size tensor."""
    weights = weights.to(torch.float32)
    if cpu.takes_levels(total, levels) and available():
        return cpu.add_levels_(total, levels, groups.offsets, weights)
    return reference.add_levels_(total, levels, groups, weights)


def stochastic_levels(x: torch.Tensor, groups, inv: torch.Tensor, bound: torch.Tensor | None,
                      levels: int, seed: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """reference.stochastic_levels (QSGD's and TernGrad's signed stochastic rounding with
    the counter stream's noise): contiguous CPU float32 takes one fused native pass with
    the same bits, into `out` if given."""
    if (x.dtype == torch.float32 and levels <= 1 << 24 and dtype in cpu_thc.LEVEL_BYTES
            and supports_cpu(x)):
        return cpu_thc.stochastic_levels(
            x, groups.offsets, inv.float().contiguous(),
            None if bound is None else bound.float().contiguous(), levels, seed, dtype,
            out=out)
    return reference.stochastic_levels(x, groups, inv, bound, levels, seed, dtype, out)


# -- the counter stream, the transform, the norm --------------------------------------------


def _native_stream(device) -> bool:
    return torch.device(device).type == "cpu" and available()


def stream_noise(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """u_0 … u_{numel−1} of the counter stream keyed by `seed` (float32 in [0, 1))."""
    if _native_stream(device):
        return cpu_thc.rng_fill(numel, seed, cpu_thc.NOISE)
    return reference.stream_noise(numel, seed, device)


def stream_signs(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """±1 (float32) of the counter stream keyed by `seed` (reference.stream_signs)."""
    if _native_stream(device):
        return cpu_thc.rng_fill(numel, seed, cpu_thc.SIGNS)
    return reference.stream_signs(numel, seed, device)


def fwht_(x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Fast Walsh–Hadamard transform of the last dimension (a power of two), in place, in
    Sylvester order (scipy.linalg.hadamard). O(d log d): log2(d) butterfly stages of
    whole-tensor ops, or, where the library takes x, one cache-blocked native pass over
    L2-sized blocks and one over column strips, or, where the Triton kernels take x
    (supports_cuda), a few blocked passes of cuda_fwht.py; all with the same butterflies
    in the same order (the same bits). With `normalize` the transform is orthonormal (its
    own inverse)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht_ needs a power-of-two length, got {d}; zero-pad first")
    if not x.is_contiguous():
        raise ValueError("fwht_ works in place on a contiguous tensor")
    if supports_cpu(x):
        cpu.fwht_(x)
    elif supports_cuda(x):
        from compressors.kernels import cuda_fwht  # noqa: PLC0415 (imports triton)

        cuda_fwht.fwht_(x)
    else:
        reference.fwht_(x)
    if normalize and d > 1:
        x.mul_(d**-0.5)
    return x


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """||x||₂ as a 1-element float64 tensor on x's device (no overflow of the norm): one
    fused read pass where the kernels take x (Σx² in double over fixed blocks, independent
    of the thread count), else torch's float64 vector_norm (which on CUDA first converts x
    to float64: about six reads' time); they may differ in the last bits."""
    if supports_cpu(x):
        return torch.tensor([math.sqrt(cpu.stats(x, squares=True).sumsq)], dtype=torch.float64)
    if supports_cuda(x):
        return _cuda().l2_norm(x)
    return torch.linalg.vector_norm(x, dtype=torch.float64).reshape(1)


# -- buffers -----------------------------------------------------------------------------------


def empty(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(n) on the CPU, asking for transparent huge pages before its first write
    where the library is loaded (cpu.empty)."""
    return cpu.empty(n, dtype)


def release_workspaces() -> None:
    """Give back the memory the kernels keep between calls: this thread's workspaces (the
    magnitudes of abs_into_workspace, pool(..., workspace=)'s, SIDCo's stream, THC's
    transform) and the selections' pooled hit buffers. The next call allocates afresh."""
    cpu.release_workspaces()
    cpu_thc.release_workspace()
