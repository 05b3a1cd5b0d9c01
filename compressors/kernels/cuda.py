"""Triton kernels: the CUDA twins of the CPU library's magnitude passes (csrc/kernels.cpp).

The threshold sparsifiers spend their time in a few passes over |acc|: statistics (counts,
sums, extremes), a count above a threshold, and the selection of the positions (and |x|)
above it. In pure torch each of these is several kernels with full-size temporaries
(`x.abs()`, a bool mask, `nonzero`'s own passes): 5–20 reads' worth of memory traffic. Here
each is one kernel that reads x once:

- `stats`: per-program partial sums in float64 (y = |x| − shift widened before it is
  summed, as the CPU kernels do), added in program order by one small kernel on the device.
- `count` / `select`: a counting pass writes one count per block; a cumulative sum gives
  each block its output offset; a second pass writes the positions of its hits in order
  (a block-local prefix sum), so the result is ascending like `nonzero`'s, with no
  full-size mask and no sort. One host synchronisation (the total) sizes the output.
- `sample_abs`: DGC/DRAGONN's threshold sample drawn from the same counter-based stream
  as the CPU kernel (counter_stream.py), so both devices read the same positions.
- `dragonn_slots`: DRAGONN's memory write (hash, slot, priority) with one 64-bit atomic
  max per candidate, then the value gather: the same integers as reference.write_slots.
- `dragonn_encode`: the same memory written straight from one read of x (no compaction),
  with the threshold and the hash seeds read from device tensors: DRAGONN's encoding with
  no host synchronisation. `select` and `sample_abs` can likewise take their threshold and
  seed as device tensors (DGC's threshold and both sample seeds never reach the host).

Comparisons are made in float32 with the threshold rounded to float32, as torch does for
`tensor >= python_float`, so selections equal the torch reference's bit for bit wherever
the thresholds agree. Only contiguous float32 CUDA tensors are taken; everything else goes
the reference path, as does every call on a device where `self_test` (run once per device
by ops.py before first use) found a kernel that fails to compile or
disagrees with torch. That first use compiles every variant (26 s on an H100 with an empty
cache; Triton keeps them in its cache, so later processes load them). With
TRITON_INTERPRET=1 (Triton's CPU interpreter) the same kernels run on CPU tensors: the
tests use this to check them where no GPU exists.
"""

from __future__ import annotations

import os
import struct

import torch

from compressors.kernels.numerics import round_f32 as _f32
from compressors.kernels.types import NonFinite

try:  # triton ships with CUDA builds of torch; absent elsewhere (then: reference paths)
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (any import failure means: not available)
    triton = None
    tl = None

BLOCK = 4096  # elements per program (per loop step) of the full-tensor passes
WARPS = 4  # warps per program of the full-tensor passes
SUB = 512  # the selection's granularity: hits are counted, and blocks skipped, per SUB
SUB_WARPS = 2  # warps per program of the selection's writing pass
TILES = 4  # blocks per program of the reductions (count, stats): fewer partials to add
SMALL_BLOCK = 1024  # per program of the passes over samples and candidates
# DRAGONN's fused write: elements and warps per program, and the chunks within a program
# (the hash is computed only in chunks holding a hit). benchmarks/kernels/gpu_parts.py's sweep
# on the H100 at 128M (ms; floor 0.183): 4096/4 warps/512 0.333, chunks of 128 0.581,
# 256 0.365, 1024 0.368; 8 warps 0.43; blocks of 2048 and 8192 within 3% of 4096.
FUSED_BLOCK = 4096
FUSED_WARPS = 4
FUSED_CHUNK = 512
_STATS = 7  # count, sum, sumsq, max, min, nonzero, log_sum


# Whether the kernels below were made by Triton's CPU interpreter (TRITON_INTERPRET=1 when
# this module was imported): they then take CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    return triton is not None


def supports(t: torch.Tensor) -> bool:
    """Contiguous float32 tensors on the current CUDA device (CPU ones too under the Triton
    interpreter)."""
    if triton is None or t.dtype != torch.float32 or not t.is_contiguous() or t.numel() == 0:
        return False
    if t.is_cuda:  # the kernels launch on the current device
        return t.device.index is None or t.device.index == torch.cuda.current_device()
    return INTERPRETED and t.device.type == "cpu"


def _f64_bits(v: float) -> int:
    """A double's bit pattern as a signed 64-bit int: the kernels bitcast it back, so the
    value reaches them exactly (Triton passes Python floats as float32)."""
    return struct.unpack("q", struct.pack("d", float(v)))[0]


if triton is not None:

    @triton.jit
    def _threshold(t, T_PTR: tl.constexpr):
        # the threshold: a float32 argument, or (T_PTR) read from a one-element float32
        # tensor on the device, so the host never waits for it
        if T_PTR:
            return tl.load(t)
        else:
            return t

    @triton.jit
    def _signed_hits(x_ptr, offs, n, t, STRICT: tl.constexpr):
        # x and |x| at offs (0 past the end) and whether |x| passes t (> when STRICT,
        # else ≥)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        a = tl.abs(x)
        if STRICT:
            hit = (a > t) & inside
        else:
            hit = (a >= t) & inside
        return x, a, hit

    @triton.jit
    def _hits(x_ptr, offs, n, t, STRICT: tl.constexpr):
        # |x| at offs (0 past the end) and whether it passes t (> when STRICT, else ≥)
        x, a, hit = _signed_hits(x_ptr, offs, n, t, STRICT)
        return a, hit

    @triton.jit
    def _sub_counts_kernel(x_ptr, n, t, counts_ptr, nsub, flag_ptr, STRICT: tl.constexpr,
                           CHECK: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                           T_PTR: tl.constexpr):
        # hits per sub-block of SUB elements (BLOCK // SUB of them per program); CHECK:
        # programs that saw a NaN or an Inf add 1 to flag_ptr[0] (the folded check)
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        a, hit = _hits(x_ptr, offs, n, _threshold(t, T_PTR), STRICT)
        per_sub = tl.sum(tl.reshape(hit.to(tl.int32), (BLOCK // SUB, SUB)), axis=1)
        sub = pid.to(tl.int64) * (BLOCK // SUB) + tl.arange(0, BLOCK // SUB)
        tl.store(counts_ptr + sub, per_sub, mask=sub < nsub)
        if CHECK:
            bad = tl.sum(((a == float("inf")) | (a != a)).to(tl.int32), axis=0)
            if bad > 0:
                tl.atomic_add(flag_ptr, 1)

    @triton.jit
    def _select_kernel(x_ptr, n, t, counts_ptr, ends_ptr, idx_ptr, val_ptr, map_ptr,
                       STRICT: tl.constexpr, VALUES: tl.constexpr, MAPPED: tl.constexpr,
                       SUB: tl.constexpr, T_PTR: tl.constexpr):
        # one sub-block per program; those without a hit (most, at small ratios) read
        # nothing but their count
        pid = tl.program_id(0)
        mine = tl.load(counts_ptr + pid)
        if mine > 0:
            offs = pid.to(tl.int64) * SUB + tl.arange(0, SUB)
            a, hit = _hits(x_ptr, offs, n, _threshold(t, T_PTR), STRICT)
            h = hit.to(tl.int32)
            dst = tl.load(ends_ptr + pid) - mine + (tl.cumsum(h, axis=0) - h).to(tl.int64)
            if MAPPED:
                src = tl.load(map_ptr + offs, mask=hit, other=0)
            else:
                src = offs
            tl.store(idx_ptr + dst, src, mask=hit)
            if VALUES:
                tl.store(val_ptr + dst, a, mask=hit)

    @triton.jit
    def _count_kernel(x_ptr, n, t, out_ptr, STRICT: tl.constexpr, BLOCK: tl.constexpr,
                      TILES: tl.constexpr):
        # one partial per program of TILES consecutive blocks (unrolled)
        pid = tl.program_id(0)
        for j in tl.static_range(TILES):
            offs = pid.to(tl.int64) * (TILES * BLOCK) + j * BLOCK + tl.arange(0, BLOCK)
            a, hit = _hits(x_ptr, offs, n, t, STRICT)
            c = tl.sum(hit.to(tl.int32), axis=0)
            if j == 0:
                total = c
            else:
                total += c
        tl.store(out_ptr + pid, total.to(tl.int64))

    @triton.jit
    def _exceedances(x_ptr, offs, n, above, shift, HAS_ABOVE: tl.constexpr):
        # |x| at offs (0 past the end), which are inside, which are counted (those inside,
        # or with HAS_ABOVE those with |x| > above), and their count, Σy and Σy² with
        # y = |x| − shift in float64
        inside = offs < n
        a = tl.abs(tl.load(x_ptr + offs, mask=inside, other=0.0))
        if HAS_ABOVE:
            sel = (a > above) & inside
        else:
            sel = inside
        y = tl.where(sel, a.to(tl.float64) - shift, 0.0)
        return (a, inside, sel, tl.sum(sel.to(tl.int32), axis=0), tl.sum(y, axis=0),
                tl.sum(y * y, axis=0))

    @triton.jit(do_not_specialize=["shift_bits"])
    def _stats_kernel(x_ptr, n, above, shift_bits, out_ptr, HAS_ABOVE: tl.constexpr,
                      SQUARES: tl.constexpr, EXTREMES: tl.constexpr, LOGS: tl.constexpr,
                      NONZEROS: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
        # per program of TILES consecutive blocks: count, Σy, Σy², max, min, nonzero,
        # Σ ln|x| (y = |x| − shift in float64), the blocks' sums added in block order;
        # the nonzeros with EXTREMES, LOGS or NONZEROS
        pid = tl.program_id(0)
        shift = shift_bits.to(tl.int64).to(tl.float64, bitcast=True)
        for j in tl.static_range(TILES):
            offs = pid.to(tl.int64) * (TILES * BLOCK) + j * BLOCK + tl.arange(0, BLOCK)
            # s2 unused (and removed by the compiler) unless SQUARES
            a, inside, sel, c, s1, s2 = _exceedances(x_ptr, offs, n, above, shift, HAS_ABOVE)
            # as kernels.cpp: the max over all elements, the min over those counted, NaN in
            # neither; nonzeros (and logs) over all elements with |x| > 0
            hi = tl.max(tl.where(inside & (a == a), a, -1.0), axis=0)
            lo = tl.min(tl.where(sel & (a == a), a, float("inf")), axis=0)
            nz = inside & (a > 0.0)
            z = tl.sum(nz.to(tl.int32), axis=0)
            if LOGS:
                lg = tl.sum(tl.where(nz, tl.log(tl.where(nz, a, 1.0).to(tl.float64)), 0.0),
                            axis=0)
            else:
                lg = s1 * 0.0
            if j == 0:
                cnt, sum1, sum2, top, bottom, nzs, logs_sum = c, s1, s2, hi, lo, z, lg
            else:
                cnt += c
                sum1 += s1
                sum2 += s2
                top = tl.maximum(top, hi)
                bottom = tl.minimum(bottom, lo)
                nzs += z
                logs_sum += lg
        # column-major (7 × programs): the final reduction reads each column contiguously
        base = out_ptr + pid
        progs = tl.num_programs(0)
        tl.store(base + 0 * progs, cnt.to(tl.float64))
        tl.store(base + 1 * progs, sum1)
        if SQUARES:
            tl.store(base + 2 * progs, sum2)
        else:
            tl.store(base + 2 * progs, 0.0)
        if EXTREMES:
            tl.store(base + 3 * progs, top.to(tl.float64))
            tl.store(base + 4 * progs, bottom.to(tl.float64))
        else:
            tl.store(base + 3 * progs, -1.0)
            tl.store(base + 4 * progs, float("inf"))
        if EXTREMES or LOGS or NONZEROS:
            tl.store(base + 5 * progs, nzs.to(tl.float64))
        else:
            tl.store(base + 5 * progs, 0.0)
        if LOGS:
            tl.store(base + 6 * progs, logs_sum)
        else:
            tl.store(base + 6 * progs, 0.0)

    @triton.jit
    def _stats_final_kernel(part_ptr, rows, out_ptr, R: tl.constexpr):
        # one program: the partials' columns (7 × rows, row-contiguous) added (max, min for
        # 3, 4) in order
        lane = tl.arange(0, 8)
        # the identities: 0 for sums, −1 for the max (|x| ≥ 0), +inf for the min
        acc = tl.where(lane == 3, -1.0, tl.where(lane == 4, float("inf"), 0.0)).to(tl.float64)
        for r0 in range(0, rows, R):
            r = r0 + tl.arange(0, R)
            inside = r < rows
            row = part_ptr + r
            for j in tl.static_range(7):
                if j == 3:
                    v = tl.max(tl.load(row + j * rows, mask=inside, other=-1.0), axis=0)
                    acc = tl.where(lane == j, tl.maximum(acc, v), acc)
                elif j == 4:
                    v = tl.min(tl.load(row + j * rows, mask=inside, other=float("inf")), axis=0)
                    acc = tl.where(lane == j, tl.minimum(acc, v), acc)
                else:
                    v = tl.sum(tl.load(row + j * rows, mask=inside, other=0.0), axis=0)
                    acc = tl.where(lane == j, acc + v, acc)
        tl.store(out_ptr + lane, acc)

    @triton.jit
    def _nonfinite_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr, TILES: tl.constexpr):
        # non-finite elements (NaN, ±Inf) per program of TILES blocks
        pid = tl.program_id(0)
        for j in tl.static_range(TILES):
            offs = pid.to(tl.int64) * (TILES * BLOCK) + j * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
            c = tl.sum((tl.abs(x) == float("inf")) | (x != x), axis=0)
            if j == 0:
                total = c.to(tl.int32)
            else:
                total += c.to(tl.int32)
        tl.store(out_ptr + pid, total)

    @triton.jit
    def _mix32(h):
        # counter_stream._mix32_ on 32-bit words held in int64
        h = ((h ^ (h >> 16)) * 0x21F0AAAD) & 0xFFFFFFFF
        h = ((h ^ (h >> 15)) * 0x735A2D97) & 0xFFFFFFFF
        return h ^ (h >> 15)

    @triton.jit(do_not_specialize=["n", "s", "k0", "k1"])
    def _sample_kernel(x_ptr, n, s, k0, k1, out_ptr, BLOCK: tl.constexpr,
                       K_PTR: tl.constexpr):
        # K_PTR: k0 is a device tensor holding the seed's two words (k1 unused), so the
        # seed drawn on the device is never copied to the host
        pid = tl.program_id(0)
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < s
        if K_PTR:
            w0 = tl.load(k0).to(tl.int64)
            w1 = tl.load(k0 + 1).to(tl.int64)
        else:
            w0 = k0.to(tl.int64)
            w1 = k1.to(tl.int64)
        h = _mix32((i & 0xFFFFFFFF) ^ w0)
        h = _mix32(h ^ ((i >> 32) ^ w1))
        p = (h * n.to(tl.int64)) >> 32
        v = tl.load(x_ptr + p, mask=inside, other=0.0)
        tl.store(out_ptr + i, tl.abs(v), mask=inside)

    @triton.jit
    def _dragonn_slot(key, s0, s1, m, index_bits, priority_shift):
        # reference._mix32 (two seeded rounds) of int64 keys < 2^32, then
        # Lemire's slot and the (priority, index) packing of write_slots. The hash in
        # 32-bit unsigned words (its products wrap mod 2^32 as the torch code's masks
        # do), the slot their high word with m (Lemire's h·m >> 32); only the packed
        # priority is 64-bit.
        h = key.to(tl.uint32) ^ s0.to(tl.uint32)
        h = (h ^ (h >> 16)) * tl.full((), 0x7FEB352D, tl.uint32)
        h = h ^ s1.to(tl.uint32)
        h = (h ^ (h >> 15)) * tl.full((), 0x5BD1E995, tl.uint32)
        h = h ^ (h >> 16)
        slot = tl.umulhi(h, m.to(tl.uint32)).to(tl.int64)
        top = (h >> priority_shift.to(tl.uint32)).to(tl.int64)
        priority = (top << index_bits.to(tl.int64)) | key
        return slot, priority

    @triton.jit(do_not_specialize=["nk", "m", "s0", "s1", "index_bits", "priority_shift"])
    def _dragonn_write_kernel(keys_ptr, nk, m, s0, s1, index_bits, priority_shift, packed_ptr,
                              BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        q = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = q < nk
        key = tl.load(keys_ptr + q, mask=inside, other=0)
        slot, priority = _dragonn_slot(key, s0, s1, m, index_bits, priority_shift)
        tl.atomic_max(packed_ptr + slot, priority, mask=inside)

    @triton.jit(do_not_specialize=["n", "m", "index_bits", "priority_shift"])
    def _dragonn_fused_kernel(x_ptr, n, t_ptr, seeds_ptr, m, index_bits, priority_shift,
                              packed_ptr, found_ptr, CHECK: tl.constexpr, BLOCK: tl.constexpr,
                              CHUNK: tl.constexpr):
        # DRAGONN's whole memory write in one read of x, the threshold and the hash seeds
        # read from the device: every |x_i| >= t writes (priority, i) into its slot, in
        # chunks of CHUNK elements, the hash computed only in chunks holding a hit. Adds
        # the program's hits to found_ptr[0] and (CHECK) 1 to found_ptr[1] when it saw
        # a NaN or an Inf.
        pid = tl.program_id(0)
        t = tl.load(t_ptr)
        s0 = tl.load(seeds_ptr)
        s1 = tl.load(seeds_ptr + 1)
        for j in tl.static_range(BLOCK // CHUNK):
            offs = pid.to(tl.int64) * BLOCK + j * CHUNK + tl.arange(0, CHUNK)
            a, hit = _hits(x_ptr, offs, n, t, False)
            c = tl.sum(hit.to(tl.int32), axis=0)
            if c > 0:
                slot, priority = _dragonn_slot(offs, s0, s1, m, index_bits, priority_shift)
                tl.atomic_max(packed_ptr + slot, priority, mask=hit)
            if CHECK:
                b = tl.sum(((a == float("inf")) | (a != a)).to(tl.int32), axis=0)
            else:
                b = c * 0
            if j == 0:
                total = c
                bad = b
            else:
                total += c
                bad += b
        if total > 0:
            tl.atomic_add(found_ptr, total.to(tl.int64))
        if CHECK:
            if bad > 0:
                tl.atomic_add(found_ptr + 1, 1)

    @triton.jit(do_not_specialize=["m", "index_bits"])
    def _dragonn_take_kernel(packed_ptr, m, index_bits, acc_ptr, values_ptr,
                             VALUES: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = j < m
        packed = tl.load(packed_ptr + j, mask=inside, other=-1)
        full = packed >= 0
        slot = tl.where(full, packed & ((1 << index_bits.to(tl.int64)) - 1), -1)
        tl.store(packed_ptr + j, slot, mask=inside)
        if VALUES:
            v = tl.load(acc_ptr + slot, mask=inside & full, other=0.0)
            tl.store(values_ptr + j, v, mask=inside)


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, -(-n // block)),)


def count(x: torch.Tensor, t: float, strict: bool = False) -> int:
    """#{|x| ≥ t} (#{|x| > t} when strict), t rounded to float32. One read pass."""
    grid = _grid(x.numel(), BLOCK * TILES)
    out = torch.empty(grid[0], dtype=torch.int64, device=x.device)
    _count_kernel[grid](x, x.numel(), _f32(t), out, STRICT=strict, BLOCK=BLOCK, TILES=TILES,
                        num_warps=WARPS)
    return int(out.sum())


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or ±Inf in x: one read pass (torch.isfinite(x).all() writes and reads a bool
    tensor as large as x first)."""
    grid = _grid(x.numel(), BLOCK * TILES)
    out = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    _nonfinite_kernel[grid](x, x.numel(), out, BLOCK=BLOCK, TILES=TILES, num_warps=WARPS)
    return int(out.sum()) == 0


def _device_threshold(t: float | torch.Tensor, x: torch.Tensor) -> float | torch.Tensor:
    """A Python threshold rounded to float32, or a one-element float32 tensor on x's
    device, which the kernels read there (no host synchronisation)."""
    if isinstance(t, torch.Tensor):
        if t.numel() != 1 or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError("a threshold tensor must hold one float32 on the tensor's device")
        return t.reshape(1)
    return _f32(t)


def select(x: torch.Tensor, t: float | torch.Tensor, strict: bool = False,
           values: bool = False, index_map: torch.Tensor | None = None,
           check_finite: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ascending positions (int64) of {|x| ≥ t} ({|x| > t} when strict), mapped through
    `index_map` when given, and with `values` their |x|. A counting pass (hits per
    sub-block of SUB elements), their cumulative sum, one host synchronisation (the total),
    and a writing pass that reads only the sub-blocks holding a hit. `t`: a float, or a
    one-element float32 tensor on x's device (read there: the total is then the only
    synchronisation). `check_finite`: the counting pass also looks for NaN and Inf (read
    back in the same synchronisation) and types.NonFinite is raised when it
    finds one."""
    n = x.numel()
    t = _device_threshold(t, x)
    on_device = isinstance(t, torch.Tensor)
    nsub = -(-n // SUB)
    counts = torch.empty(nsub, dtype=torch.int32, device=x.device)
    flag = torch.zeros(1, dtype=torch.int64, device=x.device) if check_finite else counts
    if nsub:
        _sub_counts_kernel[_grid(n, BLOCK)](x, n, t, counts, nsub, flag, STRICT=strict,
                                            CHECK=check_finite, BLOCK=BLOCK, SUB=SUB,
                                            T_PTR=on_device, num_warps=WARPS)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    if check_finite:
        total, bad = torch.cat((ends[-1:], flag)).tolist() if nsub else (0, 0)
        if bad:
            raise NonFinite("the tensor holds NaN or Inf")
    else:
        total = int(ends[-1]) if nsub else 0
    idx = torch.empty(total, dtype=torch.int64, device=x.device)
    val = torch.empty(total, dtype=x.dtype, device=x.device) if values else None
    if total:
        _select_kernel[(nsub,)](x, n, t, counts, ends, idx, idx if val is None else val,
                                x if index_map is None else index_map, STRICT=strict,
                                VALUES=values, MAPPED=index_map is not None, SUB=SUB,
                                T_PTR=on_device, num_warps=SUB_WARPS)
    return idx, val


def stats_partials(x: torch.Tensor, above: float | None = None, shift: float = 0.0,
                   squares: bool = False, extremes: bool = False,
                   logs: bool = False, nonzeros: bool = False) -> torch.Tensor:
    """The per-program partials (7 × programs, float64) that `stats` reduces."""
    grid = _grid(x.numel(), BLOCK * TILES)
    extremes = extremes or logs  # as in kernels.cpp: logs imply max, min and nonzeros
    out = torch.empty((_STATS, grid[0]), dtype=torch.float64, device=x.device)
    _stats_kernel[grid](x, x.numel(), 0.0 if above is None else _f32(above), _f64_bits(shift),
                        out, HAS_ABOVE=above is not None, SQUARES=squares,
                        EXTREMES=extremes, LOGS=logs, NONZEROS=nonzeros and not extremes,
                        BLOCK=BLOCK, TILES=TILES, num_warps=WARPS)
    return out


def stats(x: torch.Tensor, above: float | None = None, shift: float = 0.0,
          squares: bool = False, extremes: bool = False, logs: bool = False,
          nonzeros: bool = False) -> tuple:
    """(count, Σy, Σy², max, min, nonzero, Σ ln|x|) as cpu.stats defines
    them: one read pass; the programs' partials are added in program order by one small
    kernel on the device, and the 7 results copied to the host (one synchronisation)."""
    return reduce_stats(stats_partials(x, above, shift, squares, extremes, logs, nonzeros))


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """||x||₂ as a 1-element float64 tensor on x's device: Σx² in float64 over fixed blocks,
    added in program order (the same bits on every rank for the same x), one read of x
    and no synchronisation with the host."""
    return _reduced(stats_partials(x, squares=True))[2:3].sqrt()


def _reduced(part: torch.Tensor) -> torch.Tensor:
    """The partials (7 × programs) added in program order by one small kernel, into 8
    float64 values on the device (the 7 results and a pad)."""
    out = torch.empty(8, dtype=torch.float64, device=part.device)
    _stats_final_kernel[(1,)](part, part.shape[1], out, R=2048, num_warps=8)
    return out


def reduce_stats(part: torch.Tensor) -> tuple:
    """`stats`' 7 results from per-program partials (7 × programs, float64, as
    stats_partials writes them), added in program order on the device, then copied to the
    host (one synchronisation)."""
    got = _reduced(part).tolist()
    return (int(got[0]), got[1], got[2], got[3], got[4], int(got[5]), got[6])


def sample_abs(x: torch.Tensor, s: int, k0: int | torch.Tensor, k1: int = 0) -> torch.Tensor:
    """|x[p_i]|, p_i = (h(i)·n) >> 32 for i < s (the CPU kernel's positions). The seed's
    words: the ints k0, k1, or k0 an int64 tensor on x's device holding both (read there,
    so a seed drawn on the device needs no synchronisation)."""
    out = torch.empty(s, dtype=x.dtype, device=x.device)
    words = isinstance(k0, torch.Tensor)
    if words and (k0.numel() != 2 or k0.dtype != torch.int64 or k0.device != x.device):
        raise ValueError("the seed tensor must hold two int64 words on the tensor's device")
    if s:
        _sample_kernel[_grid(s, SMALL_BLOCK)](x, x.numel(), s, k0, 0 if words else k1, out,
                                              BLOCK=SMALL_BLOCK, K_PTR=words)
    return out


def dragonn_encode(x: torch.Tensor, t: torch.Tensor, m: int, index_bits: int,
                   priority_bits: int, seeds: torch.Tensor, check_finite: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DRAGONN's encoding with no host synchronisation: one read of x writes every
    |x_i| >= t into its slot (what select, then dragonn_slots, give), then the slots'
    values are gathered. t: x's threshold, a one-element float32 tensor on x's device;
    seeds: the two hash seeds, int64 on x's device; x.numel() <= 2^32, m < 2^31.
    Returns (slots int64, −1 where empty; values, 0 where empty; found: int64 [number of
    candidates, number of programs that saw a NaN or an Inf (0 unless check_finite)]),
    all on the device."""
    n = x.numel()
    t = _device_threshold(t, x)
    if not isinstance(t, torch.Tensor):
        raise ValueError("dragonn_encode takes its threshold as a tensor on the device")
    if seeds.numel() != 2 or seeds.dtype != torch.int64 or seeds.device != x.device:
        raise ValueError("the hash seeds must be two int64 on the tensor's device")
    packed = torch.full((m,), -1, dtype=torch.int64, device=x.device)
    found = torch.zeros(2, dtype=torch.int64, device=x.device)
    _dragonn_fused_kernel[_grid(n, FUSED_BLOCK)](x, n, t, seeds, m, index_bits,
                                                 32 - priority_bits, packed, found,
                                                 CHECK=check_finite, BLOCK=FUSED_BLOCK,
                                                 CHUNK=FUSED_CHUNK, num_warps=FUSED_WARPS)
    return *_dragonn_take(packed, m, index_bits, x, True), found


def _dragonn_take(packed: torch.Tensor, m: int, index_bits: int, acc: torch.Tensor,
                  values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The written memory's slots (packed turned into the index, −1 where empty, in place)
    and, with `values`, acc's values there (0 where empty)."""
    out = torch.empty(m, dtype=acc.dtype, device=acc.device) if values else None
    _dragonn_take_kernel[_grid(m, SMALL_BLOCK)](packed, m, index_bits, acc,
                                                packed if out is None else out,
                                                VALUES=values, BLOCK=SMALL_BLOCK)
    return packed, out


def dragonn_slots(keys: torch.Tensor, m: int, index_bits: int, priority_bits: int,
                  seeds: tuple[int, int], acc: torch.Tensor, values: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """cpu.dragonn_slots on the device: slots (int64, −1 where empty) and
    the values of acc there (0 where empty)."""
    packed = torch.full((m,), -1, dtype=torch.int64, device=acc.device)
    if keys.numel():
        _dragonn_write_kernel[_grid(keys.numel(), SMALL_BLOCK)](
            keys, keys.numel(), m, int(seeds[0]), int(seeds[1]), index_bits,
            32 - priority_bits, packed, BLOCK=SMALL_BLOCK)
    return _dragonn_take(packed, m, index_bits, acc, values)


def self_test(device: torch.device | str) -> str | None:
    """Run the kernels once on `device` in the variants the compressors use and compare each
    result with torch: None when all agree, else what failed (a Triton that cannot compile
    for this GPU, or a wrong result). ops.py runs it once per device before
    using the kernels. Sizes: a multiple of 16 (how Triton specialises most gradients) for
    every variant, and a ragged one for the common variants."""
    from compressors.kernels.counter_stream import counter_hash, seed_words  # noqa: PLC0415
    from compressors.kernels.reference import priority_layout, write_slots  # noqa: PLC0415

    def close(a: float, b: float) -> bool:
        return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))

    try:
        g = torch.Generator().manual_seed(0)
        for n, every in ((4 * BLOCK, True), (3 * BLOCK + 5, False)):
            x = torch.randn(n, generator=g, dtype=torch.float32, device="cpu").to(device)
            x[7] = -x[9]  # a tie of magnitudes
            x[11] = 0.0
            a = x.abs()
            ad = a.double()
            t = float(a.kthvalue(n - 50).values)
            where = torch.arange(n, device=x.device) * 3
            for strict in (False, True):
                ref = torch.nonzero(a > t if strict else a >= t).squeeze(1)
                if count(x, t, strict=strict) != ref.numel():
                    return f"count (strict={strict}) differs from torch"
                for values in ((False, True) if every else (True,)):
                    for mapped in ((False, True) if every else (False,)):
                        idx, val = select(x, t, strict=strict, values=values,
                                          index_map=where if mapped else None)
                        if not torch.equal(idx, where[ref] if mapped else ref) or (
                                values and not torch.equal(val, a[ref])):
                            return (f"select (strict={strict}, values={values}, "
                                    f"mapped={mapped}) differs from torch.nonzero")
            # (SIDCo's first reads count the nonzeros alone: with and without squares)
            combos = ([(above, sq, ext, lg, False) for above in (None, t)
                       for sq in (False, True) for ext in (False, True) for lg in (False, True)]
                      + [(None, sq, False, False, True) for sq in (False, True)] if every
                      else [(None, False, False, False, True), (t, True, True, False, False)])
            nz = ad[ad > 0]
            for above, sq, ext, lg, nzs in combos:
                got = stats(x, above=above, shift=0.25, squares=sq, extremes=ext, logs=lg,
                            nonzeros=nzs)
                chosen = ad[ad > t] if above is not None else ad
                y = chosen - 0.25
                want = [chosen.numel(), float(y.sum()), float((y * y).sum()) if sq else 0.0]
                if ext or lg:
                    want += [float(ad.max()), float(chosen.min()), nz.numel()]
                else:
                    want += [-1.0, float("inf"), nz.numel() if nzs else 0]
                want.append(float(nz.log().sum()) if lg else 0.0)
                if not all(close(float(u), float(v)) for u, v in zip(got, want)):
                    return (f"stats (above={above is not None}, squares={sq}, extremes={ext}, "
                            f"logs={lg}, nonzeros={nzs}) differ from torch")
            one_nan = x.clone()
            one_nan[3] = float("nan")
            if not all_finite(x) or all_finite(one_nan):
                return "all_finite is wrong"
            ref = torch.nonzero(a >= t).squeeze(1)
            if not torch.equal(select(x, t, check_finite=True)[0], ref):
                return "select (check_finite=True) differs from torch.nonzero"
            for bad in (float("nan"), float("-inf")):
                one_bad = x.clone()
                one_bad[n - 1] = bad
                try:
                    select(one_bad, t, check_finite=True)
                    return f"select (check_finite=True) misses a {bad}"
                except NonFinite:
                    pass
            t_dev = torch.tensor([t], dtype=torch.float32, device=x.device)
            for strict in (False, True):
                ref = torch.nonzero(a > t_dev if strict else a >= t_dev).squeeze(1)
                idx, val = select(x, t_dev, strict=strict, values=True)
                if not torch.equal(idx, ref) or not torch.equal(val, a[ref]):
                    return f"select (strict={strict}, threshold on the device) differs from torch"
            seed = 0x0123456789ABCDEF
            positions = (counter_hash(torch.arange(1000, device=x.device), seed) * n) >> 32
            words = torch.tensor(seed_words(seed), dtype=torch.int64, device=x.device)
            if not torch.equal(sample_abs(x, 1000, *seed_words(seed)), a[positions]):
                return "sample_abs differs from the counter stream's positions"
            if not torch.equal(sample_abs(x, 1000, words), a[positions]):
                return "sample_abs (seed on the device) differs from the counter stream's positions"
            keys = torch.nonzero(a >= t).squeeze(1)
            seeds = (0x9E3779B9, 12345)
            seeds_dev = torch.tensor(seeds, dtype=torch.int64, device=x.device)
            ref = write_slots(keys, 37, seeds_dev, n)
            ref_vals = torch.where(ref >= 0, x[ref.clamp(min=0)], 0.0)
            for values in (True, False):
                slots, vals = dragonn_slots(keys, 37, *priority_layout(n), seeds, x, values)
                if not torch.equal(slots, ref) or (values and not torch.equal(vals, ref_vals)):
                    return "dragonn_slots differs from write_slots"
            for check in (False, True):
                slots, vals, found = dragonn_encode(x, t_dev, 37, *priority_layout(n), seeds_dev,
                                                    check_finite=check)
                if not torch.equal(slots, ref) or not torch.equal(vals, ref_vals) or (
                        found.tolist() != [keys.numel(), 0]):
                    return f"dragonn_encode (check_finite={check}) differs from write_slots"
            found = dragonn_encode(one_nan, t_dev, 37, *priority_layout(n), seeds_dev,
                                   check_finite=True)[2]
            if int(found[1]) == 0:
                return "dragonn_encode (check_finite=True) misses a NaN"
        return None
    except Exception as exc:  # noqa: BLE001 (whatever fails: report it, take the torch path)
        return f"{type(exc).__name__}: {exc}"
