"""DGC as its authors' code runs it, in plain torch: the baseline the DGC and DRAGONN papers
measure, next to the suite's fused `dgc` (compressors/dgc.py).

One step on a flat tensor of d elements with ratio δ:

1. k = ⌈d·δ⌉ (at least 1), the number of elements wanted.
2. importance = |acc|; s = sample_size(d, δ, sample_ratio, min_sample_top) positions are
   drawn uniformly with replacement (torch.randint) and their magnitudes gathered.
3. threshold = the minimum of torch.topk of the sample, ⌈s·δ⌉ of them; when the sample
   would cover the whole tensor, the topk runs on all of |acc| with k, so the threshold
   is the exact k-th largest magnitude.
4. candidates = torch.nonzero(importance >= threshold) over the whole tensor.
5. More than max_overselect·k candidates (4k/3): torch.topk among the candidates'
   magnitudes keeps exactly k of them (the "re-top-k"). Otherwise the candidates are
   sent as they are: fewer than k (k̂ < k) is accepted, with no second threshold and no
   padding, and error feedback keeps the rest.

The threshold is not raised above zero: when the sample holds only zeros every element
passes, and the re-top-k (or, at large δ, the whole selection) may send zeros, as the
authors' code does. Only the selection differs from `dgc`: the constructor, the momentum
correction default, the allgather of (indices, values), the decoding and Outcome.extra
(threshold, candidates, retopk) are DGC's own.

|acc| and the mask are written into workspaces kept per tensor (Context.workspace): on
accelerators they are fresh tensors from the caching allocator, as in the authors' runs;
on the CPU no full-size buffer is allocated per step.
"""

from __future__ import annotations

import math

import torch

from compressors.base import Context
from compressors.dgc import DGC, sample_size
from compressors.registry import register


def ceil_count(numel: int, ratio: float) -> int:
    """⌈numel·ratio⌉, between 1 and numel. A tiny relative slack keeps 1000·0.001 from
    rounding up to 2."""
    return max(1, min(numel, math.ceil(numel * ratio * (1 - 1e-12))))


@register("dgc_reference")
class DGCReference(DGC):
    """DGC's selection as its authors' code runs it, in plain torch (the papers' baseline).

    Sampled top-k threshold, torch.nonzero over |acc| >= threshold, re-top-k above
    max_overselect·k (see the module docstring). Parameters and feedback as `dgc`."""

    def target(self, numel: int) -> int:
        return ceil_count(numel, self.ratio)

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        return False  # no fused pass: the Session checks acc itself

    def select_with_stats(
        self, acc: torch.Tensor, k: int, ctx: Context
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        numel = acc.numel()
        importance = torch.abs(
            acc, out=ctx.workspace("dgc_reference.abs", numel, acc.dtype, acc.device))
        s = sample_size(numel, self.ratio, self.sample_ratio, self.min_sample_top)
        if s >= numel:
            samples, top = importance, k
        else:
            positions = torch.randint(numel, (s,), generator=ctx.generator, device=acc.device)
            samples, top = importance[positions], ceil_count(s, self.ratio)
        threshold = torch.topk(samples, top, sorted=False).values.min()
        mask = torch.ge(importance, threshold,
                        out=ctx.workspace("dgc_reference.mask", numel, torch.bool, acc.device))
        candidates = torch.nonzero(mask).view(-1)
        count = candidates.numel()
        if count > self.overselect_limit(k):
            best = torch.topk(importance[candidates], k, sorted=False).indices
            candidates = candidates[best]
        return candidates, threshold, count, acc.index_select(0, candidates)
