"""Triton kernels of the fast Walsh–Hadamard transform: the unnormalised transform of the
last dimension (a power of two d) of a contiguous float32 tensor, in place, in Sylvester
order (scipy.linalg.hadamard), in a few blocked read+write passes over the tensor.

H_d = H_{M_1} ⊗ … ⊗ H_{M_k} for d = M_1·…·M_k. Viewing a row as (P, M, Q), with Q the
product of the factors below M and P of those above, one pass applies H_M along the middle
axis; the passes run from the lowest factor up:

- the first on contiguous blocks (Q = 1, M = min(d, BLOCK); where d < BLOCK a block holds
  several rows);
- the later ones on tiles [M, BQ]: BQ contiguous columns at stride Q (coalesced), with
  M·BQ ≤ TILE, the remaining factor d/BLOCK split as evenly as possible between as few
  passes as its log2 needs (log2(TILE) − log2(MIN_COLUMNS) bits each at most).

For d = 2^27 with the defaults: contiguous blocks of 2^13, then two passes of tiles
[2^7, 64] at strides 2^13 and 2^20: three passes, each about as fast as a copy of the
tensor. Two would need a strided factor of 2^13 or more with ≥ 8 contiguous columns (a
sector): 2^16 values, more than a program holds. Within a tile the butterflies run on
values the program holds (registers, and shared memory where Triton moves them between
threads). Each stage computes a' = a + b, b' = a' − 2b (2b is exact), the stages in
reference.fwht_'s order (stride 1, 2, 4, …): the same bits as reference.fwht_ and the C++
library's transform.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compressors.kernels import cuda as gpu

triton, tl = gpu.triton, gpu.tl

# Measured on an H200 at d = 2^27, one row (ms, median of 7; x.sum() 0.14, a copy 0.27):
# the whole transform 0.86 (reference.fwht_ 12.8), its passes 0.31, 0.27, 0.29. First pass
# alone: blocks of 2^12 0.29, 2^13 0.31 (4 to 16 warps within 0.02), 2^14 0.38 at best.
# Strided tiles [128, 64], [64, 128], [128, 32] all 0.27-0.29 with 2 to 8 warps; plans of
# four passes (blocks of 2^12, or columns ≥ 128 at this tile) 1.08-1.11.
BLOCK = 1 << 13  # elements of the first pass's contiguous blocks
BLOCK_WARPS = 8
TILE = 1 << 13  # elements of the later passes' strided tiles
TILE_WARPS = 8
MIN_COLUMNS = 64  # contiguous columns of a strided tile (256 bytes), where Q allows


class Pass(NamedTuple):
    """One launch: H_M along the middle axis of the (P, M, Q) view of every row; a program
    holds a tile of `outer` consecutive groups of M (Q = 1) or M × `columns` (Q > 1)."""

    m: int
    q: int
    outer: int
    columns: int
    programs: int
    warps: int


def _warps(elements: int, most: int) -> int:
    return max(1, min(most, elements // 1024))


def plan(d: int, numel: int, block: int = BLOCK, tile: int = TILE,
         min_columns: int = MIN_COLUMNS) -> list[Pass]:
    """The passes of the transform of rows of d elements (numel in all): sizes powers of
    two, block ≥ 2, tile ≥ 2·min_columns."""
    if d < 2 or numel == 0:
        return []
    m = min(d, block)
    outer = 1 << max(0, (min(block, numel) // m - 1).bit_length())  # rows per block
    outer = min(outer, block // m)
    passes = [Pass(m, 1, outer, 1, -(-numel // (outer * m)),
                   _warps(outer * m, BLOCK_WARPS))]
    q = m
    bits_left = (d // q).bit_length() - 1
    most = (tile // min_columns).bit_length() - 1  # log2 of the largest strided factor
    while bits_left:
        steps = -(-bits_left // most)
        bits = -(-bits_left // steps)
        m = 1 << bits
        columns = min(q, tile // m)
        passes.append(Pass(m, q, 1, columns, numel // (m * columns),
                           _warps(m * columns, TILE_WARPS)))
        q *= m
        bits_left -= bits
    return passes


if triton is not None:

    @triton.jit
    def _butterflies(x, OUTER: tl.constexpr, M: tl.constexpr, INNER: tl.constexpr,
                     STAGES: tl.constexpr):
        # x: OUTER·M·INNER values, viewed (OUTER, M, INNER): H_M along the middle axis,
        # stage s pairing the halves of groups of 2^(s+1) rows of INNER values
        for s in tl.static_range(STAGES):
            y = tl.reshape(x, (OUTER * M // (2 << s), 2, (1 << s) * INNER))
            a, b = tl.split(tl.permute(y, (0, 2, 1)))
            total = a + b
            y = tl.permute(tl.join(total, total - (b + b)), (0, 2, 1))
            x = tl.reshape(y, (OUTER * M * INNER,))
        return x

    @triton.jit
    def _block_kernel(x_ptr, n, OUTER: tl.constexpr, M: tl.constexpr, STAGES: tl.constexpr):
        # a contiguous block of OUTER groups of M (the last one ragged past n)
        offs = tl.program_id(0).to(tl.int64) * (OUTER * M) + tl.arange(0, OUTER * M)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        x = _butterflies(x, OUTER, M, 1, STAGES)
        tl.store(x_ptr + offs, x, mask=inside)

    @triton.jit
    def _strided_kernel(x_ptr, Q, M: tl.constexpr, COLUMNS: tl.constexpr,
                        STAGES: tl.constexpr):
        # the tile [M, COLUMNS] at rows p·M·Q + i·Q, columns c·COLUMNS + j of the flat
        # tensor, for program p·(Q/COLUMNS) + c
        pid = tl.program_id(0).to(tl.int64)
        per_group = Q // COLUMNS
        p = pid // per_group
        c = pid - p * per_group
        base = p * M * Q + c * COLUMNS
        rows = tl.arange(0, M).to(tl.int64) * Q
        offs = base + (rows[:, None] + tl.arange(0, COLUMNS)[None, :])
        x = tl.reshape(tl.load(x_ptr + offs), (M * COLUMNS,))
        x = _butterflies(x, 1, M, COLUMNS, STAGES)
        tl.store(x_ptr + offs, tl.reshape(x, (M, COLUMNS)))


def run_pass(x: torch.Tensor, step: Pass) -> None:
    """One pass of a plan over the flat contiguous float32 x."""
    stages = step.m.bit_length() - 1
    if step.q == 1:
        _block_kernel[(step.programs,)](x, x.numel(), OUTER=step.outer, M=step.m,
                                        STAGES=stages, num_warps=step.warps)
    else:
        _strided_kernel[(step.programs,)](x, step.q, M=step.m, COLUMNS=step.columns,
                                          STAGES=stages, num_warps=step.warps)


def fwht_(x: torch.Tensor, block: int = BLOCK, tile: int = TILE,
          min_columns: int = MIN_COLUMNS) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform of the last dimension (a power of two) of a
    contiguous float32 tensor that gpu.supports takes, in place, in Sylvester order: the
    passes of plan(d, x.numel(), block, tile, min_columns), one launch each."""
    d = x.shape[-1] if x.dim() else 1
    if d & (d - 1):
        raise ValueError(f"fwht_ needs a power-of-two length, got {d}")
    if not gpu.supports(x):
        raise TypeError(f"cuda_fwht.fwht_ takes contiguous float32 tensors on the current "
                        f"CUDA device, got {x.dtype} on {x.device}")
    for step in plan(d, x.numel(), block, tile, min_columns):
        run_pass(x, step)
    return x
