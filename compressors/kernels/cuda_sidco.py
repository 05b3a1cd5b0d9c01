"""SIDCo's stages on a CUDA device with no host synchronisation between them (Triton).

On the host-driven path (sidco_pipeline.select_host, `ops.stats` / `select` on CUDA) every
stage copies its statistics to the host, where the next threshold is fitted: at 128M
elements on an H100 that path took 10–23× a device read pass, most of it the host waiting
for the device and the device for the host. Here the thresholds stay on the device:

- a `board` (int64) holds the flags, the final selection's size, where the stages
  stopped, each stage's threshold as float64 bits and each stage's count of finished
  programs; `t32` (float32) the same thresholds rounded to float32, as the comparisons
  see them (torch rounds a Python threshold to the tensor's dtype);
- the schedule is decided on the device (compressors/sidco.py's rule): stage 1 reads the
  nonzeros its pass counted and fits them at ρ = δ·d/n₀ (one stage: the stop word 1)
  or δ₁; a later stage reads its pool's count p and fits at (δ·d/p)^(1/stages left), or
  keeps the threshold where p ≤ δ·d or the stages stopped before it (stop word 2 where
  it stops), so no ratio is decided on the host;
- a later stage is one statistics pass over its source (acc, or a pool) that reads its
  threshold and shift from the board; its last program to finish adds the partials in a
  fixed order and writes the next threshold (the same float64 formulas as
  compressors/sidco.py); stage 1 is a statistics pass and one small program;
- a compaction (the pools) is one pass into a buffer sized from the fraction expected to
  pass, so no size is read on the host: each tile's offset comes from a decoupled
  look-back over the tiles before it; the pools carry acc's positions and signed values,
  in ascending order;
- the final selection is written the same way, and one copy to the host (`read`) brings
  back its size, the thresholds and the flags;
- once the previous steps' thresholds are known (sidco_pipeline.speculation_bounds), the first
  read of acc also keeps what stage 2 needs near the guessed first threshold and the pool
  above the guessed second one (`speculate`: one pass in which each tile claims its
  output ranges with one atomic add and waits for no other tile, then a small pass that
  moves each tile's entries into acc's order, so the buffers are the same whatever order
  the claims landed in), so acc is read once per step instead of four times; where the
  guess did not hold, the step is flagged MISS and redone without it.

What the device path does not decide, it flags for the caller, who then runs the
host-driven path instead (the same selection, only slower): the GP fit's cancellation or
point mass, a first stage that keeps every nonzero (its threshold is the smallest one), a
pool that outgrew its buffer, a final threshold not above its pool's (unless stage 1 chose
a single stage: every pool is then compacted at that threshold with its ties, from acc),
data whose mean needs rescaling, NaN/Inf (the caller raises) and an all-zero tensor.

Runs under Triton's CPU interpreter on CPU tensors too (TRITON_INTERPRET=1; tests).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

from compressors.kernels import cuda as gpu
from compressors.kernels.cuda import BLOCK, TILES, WARPS, _f32, _f64_bits, _grid
from compressors.kernels.numerics import CANCELLATION, SAFE_MEAN

triton, tl = gpu.triton, gpu.tl

FLAG_NONFINITE = 1  # the first read's Σ|x| is not finite: a NaN or an Inf
FLAG_ZERO = 2  # every element is zero
FLAG_UNSAFE = 4  # mean |x| outside numerics.SAFE_MEAN: the host path rescales first
FLAG_REDO = 8  # left to the host-driven path (see the module docstring)
FLAG_OVERFLOW = 16  # with FLAG_REDO: a pool outgrew its buffer (the caller may size them up)
FLAG_MISS = 32  # the speculative read's bounds did not hold: redo the step without them
# board[0]: flags, board[1]: the final selection's size, board[STOP]: 0 while the stages
# go on, STOP_FIRST where stage 1 is the only one, STOP_LATER where a later stage stopped;
# then the thresholds
STOP = 2
STOP_FIRST = 1
STOP_LATER = 2
HEAD = 3
SAFE_LOW, SAFE_HIGH = SAFE_MEAN
REDUCE = 2048  # partials per step of the fit's reduction (gpu.stats' final kernel too)
FUSED_REDUCE = 512  # the same in a later stage's last program (fewer registers there)
# The speculative read's counts (window, pool) share one 64-bit word, so that a tile claims
# both ranges with one atomic add: each < 2^31.
SPEC_LIMIT = 2**31
_COUNT_BITS = 31
# The speculative read's tile (elements per program) and warps per program: Triton 3.8's
# ptxas (-arch=sm_90a -v) gives the kernel 80 registers a thread with 8 warps on 4096
# elements (3 programs, 24 warps an SM); with Σ ln|x| (SIDCo-P) it wants more and is
# capped at SPEC_MAXNREG (two programs an SM; 12 bytes a thread spilled). Not yet tuned
# on a GPU.
SPEC_BLOCK = 4096
SPEC_WARPS = 8
SPEC_MAXNREG = 128
# The speculative read's reordering (_spec_order_kernel): one program per tile of the read
# moves that tile's entries (at most SPEC_BLOCK a buffer) ORDER_BLOCK at a time, with
# ORDER_WARPS warps; the buffers are sized for about 3.5% of acc in the window and 7% in
# the pool (sidco_pipeline.speculation_shares at SIDCo's nominal ratios), 140 and 300
# entries of a tile: one step a buffer.
ORDER_BLOCK = 512
ORDER_WARPS = 4
# A compaction's tile and warps (_compact_kernel: 116–126 registers a thread at 8 warps);
# not yet tuned on a GPU either.
COMPACT_BLOCK = 4096
COMPACT_WARPS = 8
# Polls of the look-back's window without progress before a tile of a compaction gives up
# and flags the step for the host path (a guard: a tile waits only for tiles already
# running).
SPIN_LIMIT = 1 << 22
# Predecessors' words a tile of the look-back reads at once (one per lane of a warp).
LOOK_BACK = 32

if triton is not None:
    from compressors.kernels.cuda import _exceedances, _signed_hits

    # the constants above as the kernels take them
    _HEAD = tl.constexpr(HEAD)
    _STOP = tl.constexpr(STOP)
    _STOP_FIRST = tl.constexpr(STOP_FIRST)
    _STOP_LATER = tl.constexpr(STOP_LATER)
    _REDO = tl.constexpr(FLAG_REDO)
    _OVERFLOW = tl.constexpr(FLAG_REDO | FLAG_OVERFLOW)
    _MISS = tl.constexpr(FLAG_MISS)
    _BITS = tl.constexpr(_COUNT_BITS)
    _LOW = tl.constexpr((1 << _COUNT_BITS) - 1)
    _LOOK_BACK = tl.constexpr(LOOK_BACK)
    _NONFINITE = tl.constexpr(FLAG_NONFINITE)
    _ZERO = tl.constexpr(FLAG_ZERO)
    _UNSAFE = tl.constexpr(FLAG_UNSAFE)
    _SAFE_LOW = tl.constexpr(SAFE_LOW)
    _SAFE_HIGH = tl.constexpr(SAFE_HIGH)
    _CANCEL = tl.constexpr(CANCELLATION)

    @triton.jit
    def _size(n, n_ptr, N_PTR: tl.constexpr):
        # the elements of a source: n, or (N_PTR) a count read on the device, at most n
        # (a pool's capacity of which the first count are used)
        if N_PTR:
            return tl.minimum(tl.load(n_ptr), n)
        else:
            return n

    @triton.jit
    def _past(n, n_ptr, N_PTR: tl.constexpr):
        # whether a source's count is past its buffer of n (the entries are not all there)
        if N_PTR:
            return tl.load(n_ptr) > n
        else:
            return n < 0

    @triton.jit(do_not_specialize=["n", "slot", "done_ptr", "slot_out", "want_bits", "left",
                                   "mid_rows", "u_bits"])
    def _later_stats_kernel(x_ptr, n, n_ptr, t32_ptr, board_ptr, slot, out_ptr, done_ptr,
                            slot_out, want_bits, left, mid_ptr, mid_rows, w, u, pa, u_bits,
                            HAS_ABOVE: tl.constexpr, SQUARES: tl.constexpr,
                            N_PTR: tl.constexpr, MID: tl.constexpr, BLOCK: tl.constexpr,
                            TILES: tl.constexpr, R: tl.constexpr):
        # A later stage in one launch. Per program of TILES blocks: count, Σy, Σy² of
        # y = |x| − t over |x| > t (all of the source without HAS_ABOVE), t the threshold
        # in `slot` (float64 shift, float32 comparison); stored column-major (3 ×
        # programs). The program that finishes last (a counter at done_ptr, zero before)
        # then fits the stage (_fit_stage, SQUARES: GP) into slot_out, at the ratio its
        # count gives (want_bits: δ·d as float64 bits; `left`: the stages to go, this one
        # included): each program's partials are stored before its acq_rel increment, by
        # the thread that makes it, and the last one reads them after its own.
        pid = tl.program_id(0)
        size = _size(n, n_ptr, N_PTR)
        above = tl.load(t32_ptr + slot)
        shift = tl.load(board_ptr + _HEAD + slot).to(tl.float64, bitcast=True)
        for j in tl.static_range(TILES):
            offs = pid.to(tl.int64) * (TILES * BLOCK) + j * BLOCK + tl.arange(0, BLOCK)
            a, inside, sel, c, s1, s2 = _exceedances(x_ptr, offs, size, above, shift, HAS_ABOVE)
            if j == 0:
                cnt, sum1, sum2 = c, s1, s2
            else:
                cnt += c
                sum1 += s1
                sum2 += s2
        progs = tl.num_programs(0)
        tl.store(out_ptr + pid, cnt.to(tl.float64))
        tl.store(out_ptr + progs + pid, sum1)
        if SQUARES:
            tl.store(out_ptr + 2 * progs + pid, sum2)
        else:
            tl.store(out_ptr + 2 * progs + pid, 0.0)
        if tl.atomic_add(done_ptr, 1, sem="acq_rel") == progs - 1:
            _fit_stage(out_ptr, progs, board_ptr, t32_ptr, slot, slot_out, want_bits, left,
                       0, 0, mid_ptr, mid_rows, w, u, pa, u_bits, _past(n, n_ptr, N_PTR),
                       False, SQUARES, MID, R)

    @triton.jit
    def _running_offsets(words_ptr, tile, local, SPIN: tl.constexpr):
        # The sum of `local` over the tiles before `tile` (a decoupled look-back, as in
        # Merrill & Garland's single-pass prefix scan): each tile's word holds its own
        # count (flag 1) as soon as it has one, then the sum up to and including it (flag
        # 2); a tile adds its predecessors' words back to the first sum it finds, reading
        # LOOK_BACK of them at a time (one round trip to L2 for a window, not one a word).
        # Tiles are numbered in the order programs start (the callers' ticket), so every
        # tile waited on is running or done. Values are packed counts (no field carries
        # into the next while the counts stay below 2^_BITS), shifted past a 2-bit flag.
        # A window that makes no progress for SPIN polls in a row (a predecessor never
        # heard from; none should take more than a few) ends the wait: (prefix, False),
        # the offsets unknown and the step to be redone.
        if tile > 0:
            tl.atomic_xchg(words_ptr + tile, (local << 2) | 1, sem="relaxed")
        lane = tl.arange(0, _LOOK_BACK)
        prefix = tl.zeros((), tl.uint64)
        target = tile - 1
        polls = tl.zeros((), tl.int32)
        found = True
        while target >= 0:
            idx = target - lane  # the window: target, target − 1, ...
            ok = idx >= 0
            # an atomic read on purpose: Triton issues it from one warp and broadcasts it,
            # so every warp takes the same branch (a volatile load is read by each warp)
            word = tl.atomic_add(words_ptr + idx, tl.zeros((_LOOK_BACK,), tl.uint64),
                                 mask=ok, sem="relaxed")
            word = tl.where(ok, word, 0)
            flag = word & 3
            # the first lane that ends the walk (a sum from the start, or before tile 0)
            # and the first not heard from; the lanes before whichever comes first add up
            stop = tl.min(tl.where((flag == 2) | (idx < 0), lane, _LOOK_BACK), axis=0)
            gap = tl.min(tl.where((flag == 0) & ok, lane, _LOOK_BACK), axis=0)
            done = stop < gap
            take = tl.where(done, stop + 1, gap)
            prefix += tl.sum(tl.where(lane < take, word >> 2, 0), axis=0)
            polls = tl.where(take == 0, polls + 1, 0)
            found = done | (polls < SPIN)
            target = tl.where(done | (polls >= SPIN), -1, target - take)
        tl.atomic_xchg(words_ptr + tile, ((prefix + local) << 2) | 2, sem="relaxed")
        return prefix, found

    @triton.jit(do_not_specialize=["n", "u_bits", "pa_bits", "pa_slot", "cap_w", "cap_p"])
    def _spec_read_kernel(x_ptr, n, w, u, pa, u_bits, pa_bits, pa_slot, part_ptr, mid_ptr,
                          claim_ptr, tiles_ptr, win_ptr, cap_w, pos_ptr, val_ptr, cap_p,
                          board_ptr, t32_ptr, SQUARES: tl.constexpr,
                          MID_SQUARES: tl.constexpr, LOGS: tl.constexpr, BLOCK: tl.constexpr):
        # The speculative first read: one pass over acc, one tile of BLOCK per program.
        # - stage 1's partials (gpu._stats_kernel's 7 rows, without extremes, the nonzeros
        #   always: stage 1 fits them alone) and those of z = |x| − u over |x| ≥ u
        #   (count, Σz, Σz²), in column `tile`;
        # - the window w ≤ |x| < u (|x|, for stage 2's fit) and the pool |x| > pa (acc's
        #   positions as int32 and signed values), each tile's in acc's order at a range
        #   the tile claims with one atomic add on claim_ptr (both counts packed in one
        #   word, as _BITS-bit fields), so no tile waits for another; the ranges follow
        #   the order the atomics land in, which _spec_order_kernel then undoes. Each
        #   tile's packed count and claimed start go into tiles_ptr (2 × programs); at
        #   most cap_w / cap_p entries are written (a buffer too small is flagged);
        # - pa into `pa_slot` (the pool's bound, for the final check).
        # w, u, pa: float32; u_bits, pa_bits: u and pa as float64 bits.
        tile = tl.program_id(0)
        offs = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        a = tl.abs(x)
        af = a.to(tl.float64)
        nz = inside & (a > 0.0)
        above = inside & (a >= u)
        z = tl.where(above, af - u_bits.to(tl.int64).to(tl.float64, bitcast=True), 0.0)
        win = inside & (a >= w) & (a < u)
        hit = inside & (a > pa)
        hw = win.to(tl.int32)
        hp = hit.to(tl.int32)
        cw = tl.sum(hw, axis=0)
        cp = tl.sum(hp, axis=0)
        local = (cp.to(tl.int64) << _BITS) | cw.to(tl.int64)
        claimed = tl.atomic_add(claim_ptr, local, sem="relaxed")
        progs = tl.num_programs(0)
        tl.store(tiles_ptr + tile, local)
        tl.store(tiles_ptr + progs + tile, claimed)
        start_w = claimed & _LOW
        start_p = claimed >> _BITS
        dst = start_w + (tl.cumsum(hw, axis=0) - hw).to(tl.int64)
        tl.store(win_ptr + dst, a, mask=win & (dst < cap_w))
        dst = start_p + (tl.cumsum(hp, axis=0) - hp).to(tl.int64)
        keep = hit & (dst < cap_p)
        tl.store(pos_ptr + dst, offs.to(tl.int32), mask=keep)  # (n < 2^31)
        tl.store(val_ptr + dst, x, mask=keep)
        # (a claim past a buffer's end: the total, which the last claim ends at, is past it)
        if (start_w + cw > cap_w) | (start_p + cp > cap_p):
            tl.atomic_or(board_ptr, _OVERFLOW)
        if tile == 0:
            tl.store(t32_ptr + pa_slot, pa)
            tl.store(board_ptr + _HEAD + pa_slot, pa_bits.to(tl.int64))
        base = part_ptr + tile
        tl.store(base, tl.sum(inside.to(tl.int32), axis=0).to(tl.float64))
        tl.store(base + progs, tl.sum(af, axis=0))
        if SQUARES:
            tl.store(base + 2 * progs, tl.sum(af * af, axis=0))
        else:
            tl.store(base + 2 * progs, 0.0)
        tl.store(base + 3 * progs, -1.0)
        tl.store(base + 4 * progs, float("inf"))
        tl.store(base + 5 * progs, tl.sum(nz.to(tl.int32), axis=0).to(tl.float64))
        if LOGS:
            lg = tl.where(nz, tl.log(tl.where(nz, a, 1.0).to(tl.float64)), 0.0)
            tl.store(base + 6 * progs, tl.sum(lg, axis=0))
        else:
            tl.store(base + 6 * progs, 0.0)
        tl.store(mid_ptr + tile, tl.sum(above.to(tl.int32), axis=0).to(tl.float64))
        tl.store(mid_ptr + progs + tile, tl.sum(z, axis=0))
        if MID_SQUARES:
            tl.store(mid_ptr + 2 * progs + tile, tl.sum(z * z, axis=0))
        else:
            tl.store(mid_ptr + 2 * progs + tile, 0.0)

    @triton.jit(do_not_specialize=["cap_w", "cap_p"])
    def _spec_order_kernel(tiles_ptr, ends_ptr, claim_ptr, win_in, pos_in, val_in, cap_w,
                           cap_p, win_ptr, pos_ptr, val_ptr, totals_ptr, BLOCK: tl.constexpr):
        # The speculative read's window and pool put back in acc's order, one program per
        # tile of the read: its entries move from the range it claimed (tiles_ptr, as
        # _spec_read_kernel left it) to the one the tiles before it end at (ends_ptr: the
        # inclusive running sum of the packed counts in tile order), positions widened to
        # int64. So the output is the same whatever order the claims landed in. Only
        # entries inside both buffers move (with a buffer too small the read flagged the
        # step, whose pools are then not used for the selection). Program 0 writes the
        # totals (window, pool: the sizes before the caps) from the claim counter.
        tile = tl.program_id(0)
        progs = tl.num_programs(0)
        local = tl.load(tiles_ptr + tile)
        claimed = tl.load(tiles_ptr + progs + tile)
        start = tl.load(ends_ptr + tile) - local
        cw = local & _LOW
        for i0 in range(0, cw, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            src = (claimed & _LOW) + i
            dst = (start & _LOW) + i
            move = (i < cw) & (src < cap_w) & (dst < cap_w)
            tl.store(win_ptr + dst, tl.load(win_in + src, mask=move), mask=move)
        cp = local >> _BITS
        for i0 in range(0, cp, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            src = (claimed >> _BITS) + i
            dst = (start >> _BITS) + i
            move = (i < cp) & (src < cap_p) & (dst < cap_p)
            tl.store(pos_ptr + dst, tl.load(pos_in + src, mask=move).to(tl.int64), mask=move)
            tl.store(val_ptr + dst, tl.load(val_in + src, mask=move), mask=move)
        if tile == 0:
            total = tl.load(claim_ptr)
            tl.store(totals_ptr, total & _LOW)
            tl.store(totals_ptr + 1, total >> _BITS)

    @triton.jit
    def _expm1(x):
        # e^x − 1 without cancellation for small x (Kahan's: (u − 1)·x / ln u, u = e^x);
        # libdevice's expm1 is not in Triton's CPU interpreter
        u = tl.exp(x)
        um1 = u - 1.0
        return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / tl.log(u)))

    @triton.jit
    def _add_partials(part_ptr, rows, R: tl.constexpr):
        # the first three rows (count, Σy, Σy²) of `rows` columns: each lane adds every
        # R-th column in order, then the lanes are added (one reduction per row, none in
        # the loop, so a step's three loads are in flight together); read from L2, as in
        # a fused fit other programs of this kernel wrote them
        cnt = tl.zeros((R,), tl.float64)
        s1 = tl.zeros((R,), tl.float64)
        s2 = tl.zeros((R,), tl.float64)
        for r0 in range(0, rows, R):
            r = r0 + tl.arange(0, R)
            inside = r < rows
            cnt += tl.load(part_ptr + r, mask=inside, other=0.0, cache_modifier=".cg")
            s1 += tl.load(part_ptr + rows + r, mask=inside, other=0.0, cache_modifier=".cg")
            s2 += tl.load(part_ptr + 2 * rows + r, mask=inside, other=0.0,
                          cache_modifier=".cg")
        return tl.sum(cnt, axis=0), tl.sum(s1, axis=0), tl.sum(s2, axis=0)

    @triton.jit
    def _add_row(row_ptr, rows, R: tl.constexpr):
        # one row of `rows` partials (as _add_partials adds each of its three)
        total = tl.zeros((R,), tl.float64)
        for r0 in range(0, rows, R):
            r = r0 + tl.arange(0, R)
            total += tl.load(row_ptr + r, mask=r < rows, other=0.0, cache_modifier=".cg")
        return tl.sum(total, axis=0)

    @triton.jit
    def _f64(bits):
        # a float64 passed as its bits (gpu._f64_bits)
        return bits.to(tl.int64).to(tl.float64, bitcast=True)

    @triton.jit(do_not_specialize=["rows", "ratio_bits", "stages", "first_bits",
                                   "first_log_bits"])
    def _first_fit_kernel(part_ptr, rows, board_ptr, t32_ptr, ratio_bits, stages, first_bits,
                          first_log_bits, GP: tl.constexpr, R: tl.constexpr):
        # one program: stage 1 (_fit_stage) into slot 0 from its read's partials (the
        # nonzeros in row 5); ratio_bits: δ, first_bits: δ₁, first_log_bits: ln(1/δ₁), all
        # as float64 bits; `stages`: M
        _fit_stage(part_ptr, rows, board_ptr, t32_ptr, 0, 0, ratio_bits, stages, first_bits,
                   first_log_bits, part_ptr, rows, 0.0, 0.0, 0.0, 0, False, True, GP, False,
                   R)

    @triton.jit
    def _fit_stage(part_ptr, rows, board_ptr, t32_ptr, slot_in, slot_out, want_bits, left,
                   first_bits, first_log_bits, mid_ptr, mid_rows, w, u, pa, u_bits, short,
                   FIRST: tl.constexpr, GP: tl.constexpr, MID: tl.constexpr,
                   R: tl.constexpr):
        # the partials (count, Σy, Σy² rows of `rows` columns) added in program order,
        # then the stage's threshold into `slot_out`: compressors/sidco.py's schedule and
        # exponential_quantile or gpareto_threshold, in the same float64 operations.
        # FIRST: stage 1 (location 0, its flags) on the nonzeros (row 5): want_bits holds
        # δ, `left` M, first_bits δ₁ and first_log_bits ln(1/δ₁); at ρ = δ·(d/n₀) when
        # M = 1 or ρ ≥ δ₁ (the stop word then says one stage), else at δ₁; ρ ≥ 1 (every
        # nonzero kept: the smallest is the threshold) is left to the host path.
        # Else y = |x| − t, t in `slot_in`, want_bits holds δ·d and `left` the stages to
        # go, this one included: with p exceedances, at (δ·d/p)^(1/left), written as
        # L = ln(p/(δ·d))/left; a stage keeps t where the stages stopped before it or
        # p ≤ δ·d (then it stops them).
        # MID: stage 2 from the speculative read (_spec_read_kernel): the partials are
        # the window's (w ≤ |x| < u), mid_ptr's those of z = |x| − u over |x| ≥ u; the
        # step is flagged MISS unless w ≤ t < u, the stage fits (it does not stop) and
        # the new threshold is at least pa (the pool's bound), all as float32; never where
        # the window is `short` (its count past its buffer: the read flagged an overflow,
        # and which of its entries are there depends on the order the read's tiles
        # claimed their ranges in, so its fit decides nothing; the host path redoes it)
        cnt, s1, s2 = _add_partials(part_ptr, rows, R)
        want = _f64(want_bits)
        flags = tl.zeros((), tl.int64)
        if FIRST:
            t = tl.zeros((), tl.float64)
            nonzero = _add_row(part_ptr + 5 * rows, rows, R)
            n = tl.maximum(nonzero, 1.0)  # (none: the all-zero flag below)
            rho = want * (cnt / n)
            single = (left == 1) | (rho >= _f64(first_bits))
            minus_log = tl.where(single, -tl.log(rho), _f64(first_log_bits))  # ln(1/δ₁')
            go = nonzero > 0
        else:
            t = tl.load(board_ptr + _HEAD + slot_in).to(tl.float64, bitcast=True)
            if MID:
                mc, m1, m2 = _add_partials(mid_ptr, mid_rows, R)
                t_in = tl.load(t32_ptr + slot_in)
                d = _f64(u_bits) - t  # y = z + d above u
                cnt += mc
                s1 = s1 + m1 + mc * d
                s2 = s2 + m2 + 2 * d * m1 + mc * d * d
                inside = (t_in >= w) & (u > t_in) & (cnt > 0)
                flags |= tl.where(inside | short, 0, _MISS).to(tl.int64)
            stopped = tl.load(board_ptr + _STOP)
            go = (stopped == 0) & (cnt > want)
            n = cnt
            minus_log = tl.log(tl.where(go, cnt / want, 2.0)) / left.to(tl.float64)
        mean = s1 / n
        if GP:
            var = s2 / n - mean * mean
            # (1e-2·mean)·mean in the host's order; at or below it, moments_from_sums takes
            # a second, centred pass: the host path's
            flags |= tl.where(var > mean * _CANCEL * mean, 0, _REDO).to(tl.int64)
            r = mean * mean / var
            alpha = 0.5 * (1.0 - r)
            beta = 0.5 * mean * (r + 1.0)
            q = tl.where(tl.abs(alpha) < 1e-12, beta * minus_log,
                         beta * _expm1(alpha * minus_log) / alpha)
        else:
            q = mean * minus_log
        new = t + q
        if FIRST:
            bad = (s1 != s1) | (tl.abs(s1) == float("inf"))
            flags |= tl.where(bad, _NONFINITE, 0).to(tl.int64)
            mean_all = s1 / cnt  # the host path's checks are on the mean of every element
            flags |= tl.where(mean_all == 0.0, _ZERO, 0).to(tl.int64)
            safe = (mean_all >= _SAFE_LOW) & (mean_all <= _SAFE_HIGH)
            flags |= tl.where(safe, 0, _UNSAFE).to(tl.int64)
            every = go & (rho >= 1.0)
            flags |= tl.where(every, _REDO, 0).to(tl.int64)
            if single | every:
                tl.store(board_ptr + _STOP, _STOP_FIRST)
        else:
            # the stages stop (before or here): the host path's threshold stays t
            new = tl.where(go, new, t)
            flags = tl.where(go, flags, 0)
            if MID:
                fits = go & (new.to(tl.float32) >= pa)
                flags |= tl.where(fits | short, 0, _MISS).to(tl.int64)
            if (stopped == 0) & (cnt <= want):
                tl.store(board_ptr + _STOP, _STOP_LATER)
        tl.store(board_ptr + _HEAD + slot_out, new.to(tl.int64, bitcast=True))
        tl.store(t32_ptr + slot_out, new.to(tl.float32))
        if flags != 0:
            tl.atomic_or(board_ptr, flags)

    @triton.jit(do_not_specialize=["n", "slot", "cap", "base_slot", "base_cap"])
    def _compact_kernel(x_ptr, n, n_ptr, t32_ptr, slot, words_ptr, pos_ptr, val_ptr, map_ptr,
                        cap, count_ptr, board_ptr, base_slot, base_n_ptr, base_cap,
                        STRICT: tl.constexpr, MAPPED: tl.constexpr, N_PTR: tl.constexpr,
                        FINAL: tl.constexpr, HAS_BASE: tl.constexpr, BLOCK: tl.constexpr,
                        SPIN: tl.constexpr):
        # A compaction in one pass, one tile of BLOCK per program: the elements with
        # |x| > t (≥ t when not STRICT), t in `slot`, as positions (acc's: through map_ptr
        # when MAPPED) and signed values, in the source's order, at most `cap` of them
        # (a pool past its buffer is flagged); each tile's offset from the decoupled
        # look-back over the tiles before it (words_ptr: the ticket, then one word per
        # tile, all zero before). The last tile writes the count before the cap into
        # count_ptr; with FINAL it also writes the selection's size into board[1] and,
        # with a pool under it (HAS_BASE), flags REDO unless the pool holds every element
        # at or above t: t above the pool's bound (in `base_slot`, float32), or equal to
        # it where stage 1 chose a single stage, and the pool not empty.
        # Once stage 1 chose a single stage (the stop word), every threshold is stage 1's:
        # a STRICT compaction then keeps the ties as well (|x| ≥ t), so that each pool,
        # compacted from acc or from such a pool, holds the whole final selection.
        tile = tl.atomic_add(words_ptr, 1)  # int64: the tiles in the order programs start
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        t = tl.load(t32_ptr + slot)
        size = _size(n, n_ptr, N_PTR)
        x, a, hit = _signed_hits(x_ptr, offs, size, t, STRICT)
        closed = tl.load(board_ptr + _STOP) == _STOP_FIRST
        if STRICT:
            hit = tl.where(closed, hit | ((a == t) & (offs < size)), hit)
        h = hit.to(tl.int32)
        mine = tl.sum(h, axis=0)
        words = (words_ptr + 1).to(tl.pointer_type(tl.uint64))
        before, found = _running_offsets(words, tile, mine.to(tl.uint64), SPIN)
        if not found:  # (writes below stay within the buffers; the step is redone)
            tl.atomic_or(board_ptr, _REDO)
        start = before.to(tl.int64)
        end = start + mine
        if mine > 0:
            dst = start + (tl.cumsum(h, axis=0) - h).to(tl.int64)
            keep = hit & (dst < cap)
            if MAPPED:
                src = tl.load(map_ptr + offs, mask=keep, other=0)
            else:
                src = offs
            tl.store(pos_ptr + dst, src, mask=keep)
            tl.store(val_ptr + dst, x, mask=keep)
            if end > cap:
                tl.atomic_or(board_ptr, _OVERFLOW)
        if tile == tl.num_programs(0) - 1:
            tl.store(count_ptr, end)
            if FINAL:
                tl.store(board_ptr + 1, tl.minimum(end, cap))
                if HAS_BASE:
                    base = tl.load(t32_ptr + base_slot)
                    empty = tl.minimum(tl.load(base_n_ptr), base_cap) == 0
                    short = tl.where(closed, t < base, t <= base)
                    if short | (t != t) | empty:
                        tl.atomic_or(board_ptr, _REDO)


class Pool(NamedTuple):
    """A source of a stage: acc itself (positions None, count None), or a compaction:
    acc's signed values and positions (int64) in buffers of `cap` entries, of which the
    first `count[0]` (a one-element int64 tensor on the device, at most cap) are used."""

    values: torch.Tensor
    positions: torch.Tensor | None
    count: torch.Tensor | None
    cap: int


class Speculative(NamedTuple):
    """What the speculative first read found (Stages.speculate): stage 1's partials
    (gpu.stats_partials' rows), those of z = |x| − upper over |x| ≥ upper (3 rows), the
    bounds as float32 (window, upper, pool_above), the window's |x| and the pool."""

    part: torch.Tensor
    mid: torch.Tensor
    bounds: tuple[float, float, float]
    window: Pool
    pool: Pool


class Stages:
    """One SIDCo step's device state (see the module docstring): thresholds in `slots`
    numbered from 0, the first stage's in slot 0. A pool's buffer holds `capacity` times the
    elements expected to pass (and 4096). At most `slots` + 1 passes that compact (the
    speculative read, `compact`, `final`) per step."""

    def __init__(self, acc: torch.Tensor, slots: int, capacity: float = 4.0):
        if not gpu.supports(acc):
            raise TypeError("Stages takes a contiguous float32 tensor on the current CUDA "
                            "device (or a CPU one under Triton's interpreter)")
        self.acc, self.capacity, self.slots = acc, capacity, slots
        # The board, zeroed once: the head and thresholds, then one counter per slot (the
        # programs of the stage fitted into it that are done), then the region the passes
        # that compact take their look-back words, claim counters and counts from
        # (_lookback): enough for slots + 1 of them over acc, each region 16-byte aligned.
        tiles = -(-acc.numel() // min(SPEC_BLOCK, COMPACT_BLOCK))
        head = _even(HEAD + 2 * slots)
        self.board = torch.zeros(head + (slots + 1) * _even(tiles + 4), dtype=torch.int64,
                                 device=acc.device)
        self._lookback = _Region(self.board, head, "passes that compact")
        self.t32 = torch.empty(slots, dtype=torch.float32, device=acc.device)
        # The partials (float64) of the speculative read (stage 1's rows and the mid's) and
        # of each later stage, carved from one buffer
        spec = (gpu._STATS + 3) * _even(-(-acc.numel() // SPEC_BLOCK))
        later = slots * 3 * _even(_grid(acc.numel(), BLOCK * TILES)[0])
        self._partials = _Region(
            torch.empty(spec + later, dtype=torch.float64, device=acc.device), 0, "partials")

    def source(self) -> Pool:
        return Pool(self.acc, None, None, self.acc.numel())

    def set(self, slot: int, value: float) -> None:
        """A threshold fitted on the host (SIDCo-P's gamma stage) into `slot`."""
        self.board[HEAD + slot] = _f64_bits(value)
        self.t32[slot] = _f32(value)

    def first(self, gp: bool, ratio: float, first_ratio: float, stages: int,
              spec: Speculative | None = None) -> None:
        """Stage 1 into slot 0: the exponential (or GP) fit of the nonzeros of |acc|, from
        a statistics pass or from the speculative read's partials (`spec`), at the ratio
        compressors/sidco.py's schedule gives for `ratio` (δ), `first_ratio` (δ₁) and
        `stages` (M); flags a NaN or an Inf, an all-zero acc, a mean that needs rescaling
        and a ratio that keeps every nonzero (REDO)."""
        part = (gpu.stats_partials(self.acc, squares=gp, nonzeros=True) if spec is None
                else spec.part)
        _first_fit_kernel[(1,)](part, part.shape[1], self.board, self.t32, _f64_bits(ratio),
                                stages, _f64_bits(first_ratio),
                                _f64_bits(-math.log(first_ratio)), GP=gp, R=REDUCE,
                                num_warps=8)

    def later(self, src: Pool, slot_in: int, slot_out: int, above: bool, gp: bool,
              wanted: float, left: int, spec: Speculative | None = None) -> None:
        """A later stage: fit y = |x| − t over the elements of `src` above t (all of them
        when not `above`: a pool compacted at t), t in slot_in, at the ratio their count p
        gives, (wanted/p)^(1/left) (`wanted`: δ·d; `left`: the stages to go, this one
        included), or keep t where p ≤ wanted or the stages stopped; the result into
        slot_out."""
        grid = _grid(src.cap, BLOCK * TILES)
        part = self._partials.take(3, grid[0])
        mid = part if spec is None else spec.mid
        # (without spec unused; u = 1 so that u_bits is passed as i64 either way)
        w, u, pa = (0.0, 1.0, 0.0) if spec is None else spec.bounds
        done = self.board[HEAD + self.slots + slot_out:]
        _later_stats_kernel[grid](src.values, src.cap, _count(src), self.t32, self.board,
                                  slot_in, part, done, slot_out, _f64_bits(wanted), left,
                                  mid, mid.shape[1], w, u, pa, _f64_bits(u), HAS_ABOVE=above,
                                  SQUARES=gp, N_PTR=src.count is not None, MID=spec is not None,
                                  BLOCK=BLOCK, TILES=TILES, R=FUSED_REDUCE, num_warps=WARPS)

    def speculate(self, window: float, upper: float, pool_above: float, pa_slot: int,
                  squares: bool, mid_squares: bool, logs: bool,
                  keep_window: float, keep_pool: float) -> Speculative:
        """The speculative first read of acc (_spec_read_kernel) with bounds from the
        previous steps (float32 as the comparisons see them): stage 1's partials (7 rows,
        Σx² when `squares`, nonzeros and Σ ln|x| when `logs`), the exceedances of `upper`
        (Σz² when `mid_squares`), the window [window, upper) and the pool |x| > pool_above,
        in buffers of `capacity` times the fractions `keep_window` and `keep_pool` expected
        there (and 4096), in acc's order (_in_order puts back the order of the tiles'
        claims). pool_above goes into `pa_slot`. acc must hold < SPEC_LIMIT elements."""
        acc, device = self.acc, self.acc.device
        n = acc.numel()
        if n >= SPEC_LIMIT:
            raise ValueError(f"the speculative read takes fewer than 2^31 elements, not {n}")
        progs = -(-n // SPEC_BLOCK)
        cap_w = min(n, math.ceil(self.capacity * keep_window * n) + 4096)
        cap_p = min(n, math.ceil(self.capacity * keep_pool * n) + 4096)
        part = self._partials.take(gpu._STATS, progs)
        mid = self._partials.take(3, progs)
        claim = self._lookback.take(1)  # zero: the board is zeroed once
        totals = self._lookback.take(2)
        tiles = torch.empty((2, progs), dtype=torch.int64, device=device)
        claimed = (torch.empty(cap_w, dtype=acc.dtype, device=device),
                   torch.empty(cap_p, dtype=torch.int32, device=device),
                   torch.empty(cap_p, dtype=acc.dtype, device=device))
        bounds = (_f32(window), _f32(upper), _f32(pool_above))
        _spec_read_kernel[(progs,)](acc, n, *bounds, _f64_bits(bounds[1]),
                                    _f64_bits(bounds[2]), pa_slot, part, mid, claim, tiles,
                                    claimed[0], cap_w, claimed[1], claimed[2], cap_p,
                                    self.board, self.t32, SQUARES=squares,
                                    MID_SQUARES=mid_squares, LOGS=logs, BLOCK=SPEC_BLOCK,
                                    num_warps=SPEC_WARPS,
                                    maxnreg=SPEC_MAXNREG if logs else None)
        win, positions, values = _in_order(tiles, claim, claimed, totals)
        return Speculative(part, mid, bounds, Pool(win, None, totals[0:1], cap_w),
                           Pool(values, positions, totals[1:2], cap_p))

    def second_from(self, spec: Speculative, gp: bool, wanted: float, left: int) -> None:
        """Stage 2 into slot 1 from the speculative read: the window's exceedances of
        stage 1's threshold and those above the window; flags MISS where the bounds did
        not hold (stage 1's threshold outside [window, upper), or stage 2's below the
        pool's bound) or stage 2 does not fit (stage 1 the only one, or no more than
        `wanted` above it): the pool read then does not hold the selection."""
        self.later(spec.window, 0, 1, above=True, gp=gp, wanted=wanted, left=left, spec=spec)

    def compact(self, src: Pool, slot: int, keep: float, strict: bool = True,
                cap: int | None = None) -> Pool:
        """The elements of `src` with |x| > t (≥ t when not strict), t in `slot`, into a
        new pool of `cap` entries (by default `capacity` times the `keep` fraction expected to
        pass, and 4096; never more than src's), in one pass (_compact_kernel); a pool
        that would outgrow it is flagged, and its count is the size before the cap."""
        if cap is None:
            cap = min(src.cap, math.ceil(self.capacity * keep * src.cap) + 4096)
        return self._compact(src, slot, cap, strict)

    def final(self, src: Pool, slot: int, base: Pool | None, base_slot: int,
              cap: int | None = None) -> Pool:
        """The selection {|x| ≥ t}, t in `slot`, from `src` (acc, or a pool compacted at
        the threshold in `base_slot`, `base` that pool); its size into board[1]."""
        return self._compact(src, slot, src.cap if cap is None else min(cap, src.cap),
                             strict=False, final=True, base=base, base_slot=base_slot)

    def _compact(self, src: Pool, slot: int, cap: int, strict: bool, final: bool = False,
                 base: Pool | None = None, base_slot: int = 0) -> Pool:
        device = self.acc.device
        progs = max(1, -(-src.cap // COMPACT_BLOCK))
        words = self._lookback.take(progs + 1)
        count = self._lookback.take(1)
        positions = torch.empty(cap, dtype=torch.int64, device=device)
        values = torch.empty(cap, dtype=self.acc.dtype, device=device)
        mapped, has_base = src.positions is not None, base is not None
        _compact_kernel[(progs,)](
            src.values, src.cap, _count(src), self.t32, slot, words, positions, values,
            src.positions if mapped else positions, cap, count, self.board, base_slot,
            base.count if has_base else count, base.cap if has_base else 0, STRICT=strict,
            MAPPED=mapped, N_PTR=src.count is not None, FINAL=final, HAS_BASE=has_base,
            BLOCK=COMPACT_BLOCK, SPIN=SPIN_LIMIT, num_warps=COMPACT_WARPS)
        return Pool(values, positions, count, cap)

    def read(self) -> tuple[int, int, list[float]]:
        """(flags, the final selection's size, every slot's threshold): the one copy to
        the host, which waits for everything before it."""
        got = self.board[:HEAD + self.slots].tolist()
        return got[0], got[1], [_from_bits(b) for b in got[HEAD:HEAD + self.slots]]


class _Region:
    """Consecutive blocks of `buffer` from `start` on, each handed out once, each 16-byte
    aligned (Stages' look-back words and partials)."""

    def __init__(self, buffer: torch.Tensor, start: int, what: str):
        self.buffer, self.free, self.what = buffer, start, what

    def take(self, rows: int, cols: int | None = None) -> torch.Tensor:
        """A block of `rows` elements, or (rows, cols), not handed out before."""
        size = rows if cols is None else rows * cols
        at, self.free = self.free, self.free + _even(size)
        if self.free > self.buffer.numel():
            raise RuntimeError(f"Stages: more {self.what} than it was sized for")
        block = self.buffer[at:at + size]
        return block if cols is None else block.view(rows, cols)


def _in_order(tiles: torch.Tensor, claim: torch.Tensor, claimed: tuple[torch.Tensor, ...],
              totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The speculative read's window, pool positions (int64) and values, in acc's order
    (_spec_order_kernel), from the ranges its tiles claimed (`tiles`: their packed counts
    and claimed starts; `claimed`: the buffers as the read wrote them); the totals (the
    sizes before the caps) into `totals`."""
    win_in, pos_in, val_in = claimed
    ends = torch.cumsum(tiles[0], 0)  # packed: neither field carries (each < 2^31)
    win = torch.empty_like(win_in)
    positions = torch.empty(pos_in.numel(), dtype=torch.int64, device=pos_in.device)
    values = torch.empty_like(val_in)
    _spec_order_kernel[(tiles.shape[1],)](tiles, ends, claim, win_in, pos_in, val_in,
                                          win.numel(), values.numel(), win, positions, values,
                                          totals, BLOCK=ORDER_BLOCK, num_warps=ORDER_WARPS)
    return win, positions, values


def _count(src: Pool) -> torch.Tensor:
    """The count pointer a kernel takes (the source itself where it has none: unused)."""
    return src.values if src.count is None else src.count


def _even(words: int) -> int:
    """words rounded up to a multiple of 2 (16 bytes of int64)."""
    return words + (words & 1)


def _from_bits(bits: int) -> float:
    return struct.unpack("d", struct.pack("q", bits))[0]
