"""DGC's sparsity warm-up (Lin et al., ICLR 2018, "warm-up training"): the ratio δ starts
at a larger value and decays exponentially to the target over the first epochs of
training (the paper: sparsity 75% → 99.9%). Here δ falls from `start_ratio` to `ratio`
along a straight line in log δ, step by step: δ(t) = start_ratio^(1−p)·ratio^p with
p = (t − start_step)/steps, then `ratio` from step start_step + steps on. The trainer (compressor.warmup_steps, warmup_ratio) and the
DDP hook (repro.hooks.make(warmup_steps=, warmup_ratio=)) both take it from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RatioWarmup:
    """δ at each step of the warm-up: `at(step)`. steps = 0: always `ratio`."""

    ratio: float
    steps: int
    start_ratio: float = 0.25
    start_step: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"warmup_steps={self.steps!r} must be an integer ≥ 0: the steps "
                             "over which the ratio falls to its target (0: no warm-up)")
        start = self.start_ratio
        if self.steps and (isinstance(start, bool) or not isinstance(start, (int, float))
                           or not 0 < start <= 1):
            raise ValueError(f"warmup_ratio={start!r} must lie in (0, 1]: the ratio the "
                             "warm-up starts from (DGC: 0.25, i.e. 75% sparsity)")

    def at(self, step: int) -> float:
        if not self.steps or step >= self.start_step + self.steps:
            return float(self.ratio)
        progress = max(0, step - self.start_step) / self.steps
        return float(math.exp(math.log(self.start_ratio) * (1 - progress)
                              + math.log(self.ratio) * progress))
