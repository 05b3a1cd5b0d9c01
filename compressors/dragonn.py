"""DRAGONN: hashing-based gradient sparsification (Wang et al., ICML 2023), Algorithms 1-2.

Encoding (Algorithm 1). The threshold t comes from a ~1% uniform sample of |acc| as in
DGC (compressors.dgc.sample_threshold; no re-top-k). A memory I of m = memory_factor·k
slots (k = ⌊d·δ⌋; 4·k as in the authors' code) starts as −1 (line 2); every i with
|acc_i| ≥ t is written into slot h(i) (lines 3-8), colliding indices overwrite each other
and one survives; the payload is I (int32 while d < 2³¹) and acc[I] (line 9), 0 where a
slot is empty: a fixed size, so the allgather needs no size exchange. The write is
compressors/kernels/reference.py's write_slots, fused by kernels/dragonn_pipeline.py.

Decoding (Algorithm 2 line 5, Section 4.3): the K workers' pairs are added into one zero
tensor, duplicates summed in rank order, divided by K; empty slots add an exact +0.0, so
index 0 stays sendable (the authors' code marks empty slots with 0; here −1, as the paper).

Left open by the paper: h is a murmur-style 32-bit finaliser keyed by two seeds drawn per
call from the worker's private generator (workers lose different indices to collisions,
and a pair does not collide step after step), the slot its high bits scaled to [0, m);
among colliding indices the largest hash survives (deterministic, independent of thread
order, unbiased in position, where the pseudo-code's last writer would starve low
indices). `sent` holds exactly the valid slots, so error feedback keeps the rest. The
tensor selection of Section 4.2 (Eq. 1, Algorithm 2 line 2) lives with the cost model.
Memory coverage (Appendix A.2.2, Lemma A.10): n writes leave an expected (1 − 1/m)ⁿ of
the slots empty (`expected_empty_fraction`; `empirical_empty_fraction` for this hash).
"""

from __future__ import annotations

import math

import torch

from compressors.base import (Compressor, Context, Exchange, Outcome, Pattern, SparseSent,
                              check_ratio, index_dtype, sparse_mean, target_k, union_size)
from compressors.dgc import check_sampling, sample_threshold
from compressors.kernels import dragonn_pipeline, ops
from compressors.kernels.reference import write_slots
from compressors.registry import register
from compressors.requests import AllGather


def draw_hash_seeds(generator: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """Two 32-bit seeds (int64 tensor on `device`, no host synchronisation)."""
    return torch.randint(0, 2**32, (2,), generator=generator, device=device, dtype=torch.int64)


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


def empirical_empty_fraction(n: int, m: int, seed: int = 0,
                             keys: torch.Tensor | None = None) -> float:
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

    def __init__(self, ratio: float = 0.01, memory_factor: float = 4,
                 sample_ratio: float = 0.01, min_sample_top: int = 10):
        self.ratio = check_ratio(ratio)
        if (isinstance(memory_factor, bool) or not isinstance(memory_factor, (int, float))
                or not math.isfinite(memory_factor) or memory_factor <= 0):
            raise ValueError(f"memory_factor={memory_factor!r} must be a positive number: the "
                             "memory holds memory_factor·k slots (the authors use 4)")
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
        # The sample reads 1% of acc; the fused encoding reads all of it and checks.
        return ops.supports(acc)

    def protocol(self, acc: torch.Tensor, ctx: Context) -> Exchange[Outcome]:
        numel = acc.numel()
        k = target_k(numel, self.ratio)
        m = self.memory_size(numel)
        threshold = sample_threshold(acc, self.ratio, k, self.sample_ratio,
                                     self.min_sample_top, ctx.generator)
        seeds = draw_hash_seeds(ctx.generator, acc.device)
        # Algorithm 1 lines 2-9: the memory I and acc[I]
        slots, values, candidates = dragonn_pipeline.encode(
            acc, threshold, m, seeds, check_finite=ctx.check_finite, expected=k)
        wire_indices = slots.to(index_dtype(numel))
        all_idx, all_val = yield (AllGather(wire_indices), AllGather(values))
        aggregate = sparse_decode(all_idx, all_val, numel, ctx.world_size, acc.dtype,
                                  out=ctx.aggregate_buffer(numel, acc.dtype, acc.device,
                                                           zero=False))
        valid = slots >= 0
        sent = SparseSent(wire_indices[valid], values[valid])
        selected = sent.indices.numel()
        return Outcome(
            aggregate=aggregate, sent=sent, selected=selected, target=k,
            union=union_size(all_idx) if ctx.measure else None,
            extra={"threshold": float(threshold), "candidates": int(candidates),
                   "empty_slot_fraction": (m - selected) / m})


def sparse_decode(indices: list[torch.Tensor], values: list[torch.Tensor], numel: int,
                  world_size: int, dtype: torch.dtype, out: torch.Tensor | None = None,
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
