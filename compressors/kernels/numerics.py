"""Numerical rules shared by every implementation of the statistics passes (C++, Triton,
torch): how a threshold is rounded for a comparison, when magnitudes must be rescaled
before second moments are taken, and when a variance from raw sums is taken again by a
centred pass."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch

# Magnitudes whose mean lies outside this range are rescaled (in place, in a buffer the
# caller owns) before second moments are taken, so squares neither underflow nor overflow.
SAFE_MEAN = (1e-12, 1e12)

# moments_from_sums: a variance at or below this fraction of mean² from the raw sums has
# lost too many digits to cancellation, and is taken again by a centred pass.
CANCELLATION = 1e-2


def round_f32(t: float) -> float:
    """t rounded to float32 (as torch rounds a Python scalar compared with a float32
    tensor): to nearest, ±inf beyond the float32 range."""
    try:
        return struct.unpack("f", struct.pack("f", t))[0]
    except OverflowError:
        return math.copysign(math.inf, t)


def as_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as a comparison with a tensor of that dtype sees it."""
    if dtype == torch.float64:
        return float(value)
    if dtype == torch.float32:  # as torch's conversion, a few µs less per call
        return round_f32(value)
    return float(torch.tensor(value, dtype=dtype))


def moments_from_sums(mean: float, second: float,
                      centred: Callable[[float], float]) -> tuple[float, float]:
    """(mean, variance) from the mean and the mean square; `centred(mean)` gives the
    mean squared deviation by a second pass, used only under cancellation."""
    var = second - mean * mean
    if not var > CANCELLATION * mean * mean:
        var = centred(mean)
    return mean, max(var, 0.0)
