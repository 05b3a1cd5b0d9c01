"""The pure-torch twins of the kernels: what ops.py runs where neither the C++ library
(cpu.py) nor Triton (cuda.py) takes a tensor (16-bit or non-contiguous tensors, other
devices, GRADCOMP_NATIVE=0, no compiler), and the definitions the kernels are tested
against. Each gives the bits its kernels give (tests/kernels/test_native_kernels.py,
tests/kernels/interpreted_gpu_checks.py).
"""

from __future__ import annotations

import numpy as np
import torch

from compressors.kernels.counter_stream import counter_hash

_BIT_WEIGHTS: dict[str, torch.Tensor] = {}  # by device: 128, 64, ..., 1
_SIGN_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}


# -- selections ---------------------------------------------------------------------------


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the True entries of a 1-D bool mask, ascending (int64).

    On CPU, numpy's flatnonzero on the shared buffer (no copy) is several times faster than
    torch.nonzero (measured ~0.4 vs ~3 ms at 2.6M elements, one thread); on accelerators
    torch.nonzero is the compaction kernel to use."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


def select(x: torch.Tensor, t: float | torch.Tensor, strict: bool = False,
           values: bool = False, signed: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ascending positions (int64) of {|x| ≥ t} ({|x| > t} when strict), compared in x's
    dtype, and with `values` their |x| (x itself with `signed`)."""
    magnitude = x.abs()
    idx = flat_nonzero(magnitude > t if strict else magnitude >= t)
    if not values:
        return idx, None
    return idx, (x if signed else magnitude).index_select(0, idx)


def all_finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


# -- the batched sparse decode ------------------------------------------------------------


def scatter_mean(idx: torch.Tensor, val: torch.Tensor, out: torch.Tensor, divisor: int,
                 lengths: list[int] | None = None) -> torch.Tensor:
    """out ← 0, each rank's pairs added by one index_add_ per rank in rank order (`lengths`:
    each rank's share of the concatenation; None for one rank, or any order where the
    device adds one index_add_'s pairs in order, as the CPU does), out /= divisor (when
    > 1). CUDA's index_add_ over one concatenation adds colliding pairs with atomics in
    arrival order, so ranks would round the same sum differently. The division touches
    only the received coordinates where they are few (the rest are +0, which it would
    leave +0): the zero fill is then the decode's only pass over the whole of `out`."""
    out.zero_()
    if idx.numel():
        if lengths is None or len(lengths) == 1:
            if lengths is None and out.device.type != "cpu" and divisor > 2:
                raise ValueError(
                    "sparse_mean needs each rank's payload apart (a list per rank, or "
                    "lengths=) off the CPU, to sum them in rank order")
            out.index_add_(0, idx, val)
        else:
            for i, v in zip(idx.split(lengths), val.split(lengths)):
                if i.numel():
                    out.index_add_(0, i, v)
    if divisor > 1:
        if idx.numel() * SPARSE_DIVIDE < out.numel():
            out[idx] = out[idx].div_(divisor)  # a repeated index writes the same quotient
        else:
            out.div_(divisor)
    return out


# Below 1 received pair per SPARSE_DIVIDE coordinates, dividing at the pairs' indices (an
# index read, a gather and a scatter: ~3 accesses a pair) moves less than dividing all of
# `out` (a read and a write per coordinate).
SPARSE_DIVIDE = 4


# -- signs and levels (SignSGD, EF-SignSGD, QSGD, TernGrad) --------------------------------
# `groups`: consecutive groups tiling the flat tensor (compressors.quantize.Groups): its
# `scale_(x, per_group)` multiplies each group by its value in place.


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit i of the output is 1 where x[i] ≥ 0 (most significant bit first), 8 signs per
    uint8; the last byte is padded with zeros. ceil(d/8) bytes."""
    bits = x >= 0
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = _BIT_WEIGHTS.get(str(x.device))
    if weights is None:
        powers = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
        weights = _BIT_WEIGHTS[str(x.device)] = powers.to(x.device)
    return (bits.view(-1, 8).view(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """±1 per element (+1 for a set bit) of `dtype`, decoded by a 256-entry lookup table:
    one gather, no per-bit passes."""
    key = (dtype, str(packed.device))
    table = _SIGN_TABLES.get(key)
    if table is None:
        bytes_ = torch.arange(256, dtype=torch.int32)
        shifts = torch.arange(7, -1, -1, dtype=torch.int32)
        bits = (bytes_[:, None] >> shifts) & 1
        table = _SIGN_TABLES[key] = (bits * 2 - 1).to(dtype=dtype, device=packed.device)
    return table.index_select(0, packed.to(torch.int32)).view(-1)[:numel]


def add_signs_(total: torch.Tensor, packed: torch.Tensor, groups, weights: torch.Tensor
               ) -> torch.Tensor:
    """total += unpack_signs(packed) · weights[group], in place."""
    return total.add_(groups.scale_(unpack_signs(packed, total.numel(), total.dtype),
                                    weights.to(total.dtype)))


def add_levels_(total: torch.Tensor, levels: torch.Tensor, groups, weights: torch.Tensor
                ) -> torch.Tensor:
    """total += float32(levels) · weights[group], in place: the product rounded, then the
    sum."""
    return total.add_(groups.scale_(levels.to(torch.float32), weights))


def stochastic_levels(x: torch.Tensor, groups, inv: torch.Tensor, bound: torch.Tensor | None,
                      levels: int, seed: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Signed stochastic rounding in x's dtype, per element of group g:
        a = min(|x_i|, bound[g]) · inv[g]   (no bound when None),
        l = min(⌊a⌋ + [u_i < a − ⌊a⌋], levels),   out_i = sign(x_i) · l   (dtype),
    u_i the counter stream keyed by `seed`."""
    a = x.abs()
    if bound is not None:
        a = torch.minimum(a, groups.per_element(bound.to(x.dtype)))
    scaled = groups.scale_(a, inv.to(x.dtype))
    level = scaled.floor()
    noise = stream_noise(x.numel(), seed, x.device).to(x.dtype)
    level.add_(noise < scaled.sub_(level)).clamp_(max=levels)
    level.mul_(x.sign())
    return level.to(dtype) if out is None else out.copy_(level)


# -- the counter stream's noise and signs, the sample, the transform ----------------------


def _hash_range(numel: int, seed: int, device) -> torch.Tensor:
    return counter_hash(torch.arange(numel, dtype=torch.int64, device=device), seed)


def stream_noise(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """u_0 … u_{numel−1} of the stream keyed by `seed` (float32 in [0, 1)):
    u_i = (h(i) >> 8)·2^-24."""
    h = _hash_range(numel, seed, device)
    return (h >> 8).to(torch.float32).mul_(2.0**-24)


def stream_signs(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """±1 (float32) from `seed`: s_i = −1 where bit i mod 32 of h(⌊i/32⌋) is set."""
    words = _hash_range(-(-numel // 32), seed, device)
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    bits = (words[:, None] >> shifts).bitwise_and_(1).flatten()[:numel]
    return bits.to(torch.float32).mul_(-2).add_(1)


def sample_abs(x: torch.Tensor, s: int, seed: int) -> torch.Tensor:
    """|x[p_i]| for i < s, p_i = (h(i)·n) >> 32 with the counter hash keyed by `seed`
    (n = x.numel() < 2^31)."""
    positions = counter_hash(torch.arange(s, dtype=torch.int64, device=x.device), seed)
    positions.mul_(x.numel()).bitwise_right_shift_(32)
    return x.reshape(-1).index_select(0, positions).abs()


def fwht_(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh–Hadamard transform of the last dimension (a power of two) of
    a contiguous tensor, in place, in Sylvester order: log2(d) butterfly stages of
    whole-tensor ops."""
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    h = 1
    while h < d:
        pairs = x.view(rows, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        a.add_(b)  # a + b
        torch.sub(a, b, alpha=2, out=b)  # (a + b) − 2b = a − b, without a temporary
        h *= 2
    return x


# -- DRAGONN's hashed memory (Algorithm 1's write) -----------------------------------------

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2³¹ (h < 2³², so h·C < 2⁶³ never overflows int64): the first
# multiplier of the "lowbias32" finaliser and MurmurHash2's mixing constant.
_MUL1 = 0x7FEB352D
_MUL2 = 0x5BD1E995


def _mix32(h: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Seeded murmur-style finaliser of 32-bit values held in int64 (in place on h)."""
    h.bitwise_xor_(seeds[0])
    h.bitwise_xor_(h >> 16).mul_(_MUL1).bitwise_and_(_MASK32)
    h.bitwise_xor_(seeds[1])
    h.bitwise_xor_(h >> 15).mul_(_MUL2).bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 16)
    return h


def hash32(keys: torch.Tensor, seeds: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """Seeded 32-bit hash of non-negative integer keys (int64 result in [0, 2³²)).

    A bijection on keys < 2³² for fixed seeds. `wide=True` (keys may reach 2³²) folds the
    high word in with a second round."""
    keys = keys.long()
    h = _mix32(keys & _MASK32, seeds)
    if wide:
        h = _mix32(h.bitwise_xor_(keys >> 32), seeds)
    return h


def hash_slots(hashes: torch.Tensor, m: int) -> torch.Tensor:
    """Slot in [0, m) from a 32-bit hash: its high bits scaled to m (Lemire's reduction)."""
    if m < 2**31:
        return (hashes * m) >> 32
    return hashes % m


def priority_layout(numel: int) -> tuple[int, int]:
    """(index bits, priority bits) of the packed (priority, index) int64 that write_slots
    reduces with amax: the index in the low bits, the top of the hash above it."""
    index_bits = max(1, (numel - 1).bit_length())
    return index_bits, min(32, 63 - index_bits)


def write_slots(keys: torch.Tensor, m: int, seeds: torch.Tensor, numel: int) -> torch.Tensor:
    """DRAGONN's memory: m int64 slots, −1 where empty, each non-empty slot holding exactly
    one of `keys` (distinct indices in [0, numel)) that hashed there; among colliding keys
    the one with the largest hash survives (a per-call pseudo-random priority: thread
    order and position play no part), written with scatter_reduce "amax" on (priority,
    index) packed in one int64."""
    packed = torch.full((m,), -1, dtype=torch.int64, device=keys.device)
    if keys.numel() == 0:
        return packed
    keys = keys.long()
    h = hash32(keys, seeds, wide=numel > 2**32)
    slot = hash_slots(h, m)
    index_bits, priority_bits = priority_layout(numel)
    if priority_bits < 32:
        h = h >> (32 - priority_bits)
    priority = h.bitwise_left_shift_(index_bits).bitwise_or_(keys)
    packed.scatter_reduce_(0, slot, priority, reduce="amax", include_self=True)
    return torch.where(packed >= 0, packed & ((1 << index_bits) - 1), -1)
