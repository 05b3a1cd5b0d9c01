"""The counter-based random stream shared by THC (stochastic-rounding noise, RHT signs),
QSGD/TernGrad (rounding noise) and DGC/DRAGONN (threshold-sample positions): the torch
twin of counter_hash in csrc/common.h, which the C++ and Triton kernels use."""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------
# The counter-based random stream (stochastic-rounding noise and RHT signs).
#
# Element i of the stream keyed by a 64-bit seed (k0 its low, k1 its high 32-bit word) is
#     h(i) = mix(mix(lo32(i) ^ k0) ^ k1 ^ hi32(i)),
# mix: the "lowbias32" integer finaliser (x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15;
# x *= 0x735a2d97; x ^= x >> 15; constants from C. Wellons' hash prospector, bias 0.107),
# a bijection of 32-bit words with full avalanche; two keyed rounds (as in "triple32").
# The rounding noise is u_i = (h(i) >> 8)·2^-24 (24 random bits, exact in float32, in
# [0, 1)); the Rademacher sign s_i is −1 where bit (i mod 32) of h(⌊i/32⌋) is set (a sign
# needs one bit: one hash serves 32 consecutive signs, which makes the signed padded
# copy and the decode's sign flip nearly free).
# Why this is enough here: stochastic rounding only needs each u_i uniform and
# independent of the value it rounds (unbiasedness: P(u < frac) = frac up to 2^-24), and
# the RHT only needs the signs balanced and unpredictable from the data; tests/
# test_thc_rng.py checks uniformity (mean, binned chi-square, KS), balance and the
# absence of correlation between neighbours, between seeds and between the two streams,
# and shows that the same checks reject a weak hash. A counter-based stream can be
# generated inside the fused native passes (thc_kernels.cpp: no 2^25-element noise or
# sign buffer, no torch.rand) and recomputed anywhere from (seed, i): the native and the
# torch code below give the same bits, so the same indices. DGC and DRAGONN draw their
# threshold sample's positions from the same stream (compressors/dgc.py).
# ---------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_HASH_MUL1 = 0x21F0AAAD  # both < 2^31: the int64 products below never overflow
_HASH_MUL2 = 0x735A2D97


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as its (low, high) 32-bit words: the hash's keys."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & _MASK32, seed >> 32


def draw_seed_words(generator: torch.Generator) -> torch.Tensor:
    """One 64-bit stream seed as its (low, high) 32-bit words: two draws from a torch
    generator, an int64 tensor left on the generator's device (no synchronisation)."""
    return torch.randint(0, 1 << 32, (2,), generator=generator, dtype=torch.int64,
                         device=generator.device)


def draw_seed(generator: torch.Generator) -> int:
    """One 64-bit stream seed from a torch generator (draw_seed_words, on the host)."""
    lo, hi = draw_seed_words(generator).tolist()
    return (hi << 32) | lo


def _mix32_(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on 32-bit words held in int64, in place."""
    h.bitwise_xor_(h >> 16).mul_(_HASH_MUL1).bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 15).mul_(_HASH_MUL2).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 15)


def counter_hash(index: torch.Tensor, seed: int) -> torch.Tensor:
    """h(i) of the stream keyed by `seed` for non-negative integer indices (int64 result
    in [0, 2^32)); the torch twin of counter_hash in csrc/common.h."""
    k0, k1 = seed_words(seed)
    index = index.long()
    h = _mix32_(torch.bitwise_and(index, _MASK32).bitwise_xor_(k0))
    return _mix32_(h.bitwise_xor_((index >> 32).bitwise_xor_(k1)))
