"""DRAGONN: hashing-based gradient sparsification (Wang et al., ICML 2023), Algorithms 1–2.

Encoding (Algorithm 1). A threshold t is estimated from a ~1% uniform sample of |acc| as
DGC does (compressors.dgc.sample_threshold; no re-top-k). A memory of m = memory_factor·k
slots (k = ⌊d·δ⌋, memory_factor = 4 as in the authors' code) starts as −1 (empty).
Every index i with |acc_i| >= t is written into slot h(i); indices hashing to the same
slot overwrite each other and exactly one survives. The payload is the m slot indices
(int32 while d < 2³¹; −1 where empty) and the m values acc[slot] (0 where empty): a fixed
size whatever the data, so every worker's message has the same length and the allgather
needs no size exchange.

Decoding (Section 4.3, "sparse decoding"): the K workers' (index, value) pairs are
concatenated and added into one zero dense tensor by ONE index_add (duplicate indices
across workers are summed), then divided by K. Empty slots are sent to a spare "dump"
element past the end of the dense tensor, so they are dropped exactly, whatever value
their slot holds; index 0 is an ordinary index (the authors' code marks empty slots with
0, which makes index 0 unsendable; here −1 marks them, as in the paper).

Implementation choices (the paper leaves them open):
- On the CPU, candidates are found in one comparison pass over |acc| and compacted
  (flat_nonzero); only the candidates are hashed, never the whole tensor, and nothing is
  sorted. On CUDA (Triton kernels) the comparison pass writes each candidate straight into
  its slot, with the threshold and the seeds read on the device: no compaction and no
  host synchronisation (the slots do not depend on the order the candidates come in).
- The hash is a murmur-style 32-bit finaliser (xor-shift / odd-multiply rounds, both
  multipliers < 2³¹ so every product fits int64 without wrapping) keyed by two 32-bit
  seeds drawn per call from the worker's private generator (ctx.generator). Private rather
  than shared (ctx.shared_seed): workers then lose different indices to collisions, so a
  coordinate that is large on every worker is not dropped by all of them in the same
  step; a fresh seed per call keeps the same pair of indices from colliding step after
  step. The slot is the hash's high bits scaled to [0, m) (h·m >> 32).
- Collisions: on a GPU the "last writer" among threads is arbitrary; the sequential
  pseudo-code's last writer is the largest index, which would systematically starve low
  indices. Here the survivor is the colliding index with the largest hash value (a
  per-call pseudo-random priority, unique per index since the hash is a bijection on
  32-bit keys), written with scatter_reduce "amax" on (priority, index) packed in one
  int64: deterministic for a given seed, independent of thread order, and unbiased in
  position.
- `sent` holds exactly this worker's valid slots, so error feedback keeps everything
  else, including candidates lost in collisions.

The efficiency-aware tensor selection of Section 4.2 (Eq. 1: compress only if
T_comp(d) < T_full(d) − T_spr(d)) decides per tensor whether to call this compressor at
all and lives with the cost model, not here.

Memory coverage (Appendix A.2.2, Lemma A.10): writing n indices into m slots leaves an
expected fraction (1 − 1/m)ⁿ empty: `expected_empty_fraction`; `empirical_empty_fraction`
measures it for this hash.
"""

from __future__ import annotations

import math

import torch

from compressors import _native
from compressors.base import (
    Compressor,
    Context,
    Outcome,
    Pattern,
    Protocol,
    SparseSent,
    check_ratio,
    index_dtype,
    sparse_mean,
    target_k,
    union_size,
)
from compressors.dgc import check_sampling, flat_nonzero, sample_threshold
from compressors.registry import register
from compressors.requests import AllGather

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2³¹ (h < 2³², so h·C < 2⁶³ never overflows int64): the first
# multiplier of the "lowbias32" finaliser and MurmurHash2's mixing constant.
_MUL1 = 0x7FEB352D
_MUL2 = 0x5BD1E995


def draw_hash_seeds(generator: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """Two 32-bit seeds (int64 tensor on `device`, no host synchronisation)."""
    return torch.randint(0, 2**32, (2,), generator=generator, device=device, dtype=torch.int64)


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
    """Algorithm 1's memory: m int64 slots, −1 where empty, each non-empty slot holding
    exactly one of `keys` (distinct indices in [0, numel)) that hashed there; among
    colliding keys the one with the largest hash survives (see the module docstring)."""
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


def expected_empty_fraction(n: int, m: int) -> float:
    """Lemma A.10's p = (1 − 1/m)ⁿ: expected fraction of m slots left empty by n writes
    of distinct keys through a random hash (m = n = 1024 → 0.368)."""
    if m < 1 or n < 0:
        raise ValueError(f"need m >= 1 slots and n >= 0 writes, got m={m}, n={n}")
    return (1.0 - 1.0 / m) ** n


def empty_fraction_tail_bound(n: int, m: int, eps: float) -> float:
    """Lemma A.10's bound P(|x − p| >= ε) <= 2·exp(−m·ε²/(3p))/√m on the empty fraction x."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps={eps!r} must lie in (0, 1)")
    p = expected_empty_fraction(n, m)
    if p == 0.0:
        return 0.0
    return min(1.0, 2.0 * math.exp(-m * eps * eps / (3.0 * p)) / math.sqrt(m))


def empirical_empty_fraction(
    n: int,
    m: int,
    seed: int = 0,
    keys: torch.Tensor | None = None,
) -> float:
    """Fraction of m slots left empty after DRAGONN's hash writes n distinct keys (by
    default 0..n−1, consecutive indices: the hardest case for weak hashes), with the hash
    seeded from `seed`."""
    if keys is None:
        keys = torch.arange(n, dtype=torch.int64)
    elif keys.numel() != n:
        raise ValueError(f"keys has {keys.numel()} elements but n={n}")
    if m < 1:
        raise ValueError(f"need m >= 1 slots, got m={m}")
    seeds = draw_hash_seeds(torch.Generator().manual_seed(seed))
    numel = int(keys.max()) + 1 if keys.numel() else 1
    slots = write_slots(keys, m, seeds.to(keys.device), numel)
    return float((slots < 0).sum()) / m


@register("dragonn")
class Dragonn(Compressor):
    """DRAGONN's hashing sparsifier with batched sparse decoding (module docstring).

    ratio: δ = k/d. memory_factor: m = memory_factor·k slots (4). sample_ratio,
    min_sample_top: the DGC threshold sample (see compressors.dgc).
    Default feedback: DGC momentum correction, as the paper uses for every sparsifier.
    """

    pattern = Pattern.SPARSE_ALLGATHER
    sparse = True
    default_feedback = "momentum"

    def __init__(
        self,
        ratio: float = 0.01,
        memory_factor: float = 4,
        sample_ratio: float = 0.01,
        min_sample_top: int = 10,
    ):
        self.ratio = check_ratio(ratio)
        if (
            isinstance(memory_factor, bool)
            or not isinstance(memory_factor, (int, float))
            or not math.isfinite(memory_factor)
            or memory_factor <= 0
        ):
            raise ValueError(
                f"memory_factor={memory_factor!r} must be a positive number: the memory "
                "holds memory_factor·k slots (the authors use 4)"
            )
        self.memory_factor = memory_factor
        self.sample_ratio, self.min_sample_top = check_sampling(sample_ratio, min_sample_top)

    def memory_size(self, numel: int) -> int:
        """m = ⌈memory_factor·k⌉ slots, k = ⌊d·δ⌋, at most d (more slots than elements
        could never fill: at large δ or memory_factor the memory is the tensor's size)."""
        k = target_k(numel, self.ratio)
        return max(1, min(numel, math.ceil(self.memory_factor * k * (1 - 1e-12))))

    def sent_elements(self, numel: int) -> int:
        return self.memory_size(numel)

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        # The sample reads 1% of acc; the selection pass reads all of it and checks.
        return _native.supports(acc)

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Protocol:
        numel = acc.numel()
        k = target_k(numel, self.ratio)
        m = self.memory_size(numel)
        threshold = sample_threshold(
            acc, self.ratio, k, self.sample_ratio, self.min_sample_top, ctx.generator
        )
        seeds = draw_hash_seeds(ctx.generator, acc.device)
        fits = numel <= 2**32 and m < 2**31  # the native hash's integer ranges
        if fits and _native.supports_fused_dragonn(acc):
            # CUDA: one read of acc writes every candidate straight into its slot (the
            # memory does not depend on the candidates' order), threshold and seeds read
            # on the device: no compaction and no host synchronisation before the send.
            slots, values, found = _native.dragonn_encode(
                acc.reshape(-1), threshold.reshape(1), m, *priority_layout(numel), seeds,
                check_finite=ctx.check_finite)
            if ctx.check_finite and int(found[1]):
                raise _native.NonFinite("the tensor holds NaN or Inf")
            candidates = found[0]
        else:
            native = _native.supports(acc)
            if native:  # one fused pass, no |acc| or mask buffer; the values beside
                candidates, found = _native.select(acc, float(threshold), reserve=k,
                                                   check_finite=ctx.check_finite,
                                                   values=fits, signed=True)
            else:
                candidates = flat_nonzero(acc.abs() >= threshold)
            if native and fits:
                # The memory write and the surviving values in one native loop over the
                # candidates (the same integer operations as write_slots; the values from
                # the selection's, not from acc's scattered lines).
                slots, values = _native.dragonn_slots(
                    candidates, m, *priority_layout(numel), tuple(seeds.tolist()),
                    acc.reshape(-1), key_values=found)
            else:
                slots = write_slots(candidates, m, seeds, numel)
                values = acc.index_select(0, slots.clamp(min=0)).masked_fill_(slots < 0, 0)
            candidates = candidates.numel()
        empty = slots < 0
        wire_indices = slots.to(index_dtype(numel))
        all_idx, all_val = yield (AllGather(wire_indices), AllGather(values))

        aggregate = sparse_decode(all_idx, all_val, numel, ctx.world_size, acc.dtype,
                                  out=ctx.aggregate_buffer(numel, acc.dtype, acc.device,
                                                           zero=False))
        valid = ~empty
        sent = SparseSent(wire_indices[valid], values[valid])
        selected = sent.indices.numel()
        union = union_size(all_idx) if ctx.measure else None
        return Outcome(
            aggregate=aggregate,
            sent=sent,
            selected=selected,
            target=k,
            union=union,
            extra={
                "threshold": float(threshold),
                "candidates": int(candidates),
                "empty_slot_fraction": (m - selected) / m,
            },
        )


def sparse_decode(
    indices: list[torch.Tensor],
    values: list[torch.Tensor],
    numel: int,
    world_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched sparse decoding: every worker's (index, value) pairs added into a zero dense
    tensor (`out` when given, see sparse_mean), duplicates summed in rank order, divided
    by the world size. Empty slots (index < 0) add an exact +0.0 to element 0: the sum there
    starts at +0.0 and, rounding to nearest, never reaches −0.0, so x + 0.0 = x."""
    idx = torch.cat(indices)
    empty = idx < 0
    val = torch.cat(values).to(dtype).masked_fill_(empty, 0)
    return sparse_mean(idx.masked_fill(empty, 0), val, numel, world_size, dtype, out=out,
                       lengths=[int(i.numel()) for i in indices])
