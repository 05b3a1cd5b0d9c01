"""DGC as its own authors' code runs it (Lin et al., ICLR 2018; deep-gradient-compression,
dgc/compression.py `_sparsify`), in plain torch, next to the suite's fused `dgc`
(compressors/dgc.py, the SIDCo authors' DGC variant).

One step on a flat tensor of d elements with ratio δ:

1. k = ⌈d·δ⌉ (at least 1), the number of elements wanted.
2. importance = |acc|; s = sample_size(d, δ, sample_ratio, min_sample_top) positions are
   drawn uniformly with replacement (torch.randint) and their magnitudes gathered.
3. threshold = the minimum of torch.topk of the sample, ⌈s·δ⌉ of them; when the sample
   would cover the whole tensor, the topk runs on all of |acc| with k, so the threshold
   is the exact k-th largest magnitude.
4. candidates = torch.nonzero(importance >= threshold) over the whole tensor.
5. While fewer than lower_bound·k (0.8·k) are candidates, the threshold is multiplied by
   lower_bound (×0.8) and the candidates listed again, at most max_lowerings (10) times.
6. More than k candidates: torch.topk among the candidates' magnitudes keeps the k
   largest. So k̂ never exceeds k, and falls below 0.8·k only when ten lowerings (the
   threshold ×0.107) still leave fewer than 0.8·k above it.

On Laplace gradients of 10⁶ elements (4 workers, 30 steps, δ = 0.01 and 0.001, also with
90% and 99% exact zeros) k̂/k then lies in [0.80, 1.00], where the sampled threshold
alone gives [0.28, 1.33].

Where the authors' code differs in which coordinates it keeps, not in how many: above
1.3·k candidates it runs the same top-k (its "resample"), but between k and 1.3·k it keeps
`indices[:k]`, the k lowest positions; here the k largest are kept in both cases.

The threshold is not raised above zero: when the sample holds only zeros every element
passes, and the top-k may send zeros, as the authors' code does. Only the selection
differs from `dgc`: the momentum correction default, the allgather of (indices, values)
and the decoding are DGC's own. Outcome.extra: threshold (the last one, lowered or not),
candidates (how many passed it), retopk (whether the top-k cut them to k) and lowerings.

|acc| and the mask are written into workspaces kept per tensor (Context.workspace): on
accelerators they are fresh tensors from the caching allocator, as in the authors' runs;
on the CPU no full-size buffer is allocated per step.
"""

from __future__ import annotations

import math

import torch

from compressors.base import Context, Selected
from compressors.dgc import DGC, sample_size
from compressors.registry import register
from compressors.threshold import check_finite_range, check_positive_int


def ceil_count(numel: int, ratio: float) -> int:
    """⌈numel·ratio⌉, between 1 and numel. A tiny relative slack keeps 1000·0.001 from
    rounding up to 2."""
    return max(1, min(numel, math.ceil(numel * ratio * (1 - 1e-12))))


@register("dgc_reference")
class DGCReference(DGC):
    """DGC's selection as its own authors' code runs it, in plain torch.

    Sampled top-k threshold, torch.nonzero over |acc| >= threshold, the threshold lowered
    ×lower_bound while fewer than lower_bound·k pass (at most max_lowerings times), then
    the k largest candidates when more than k pass (see the module docstring).
    ratio, sample_ratio, min_sample_top and feedback as `dgc`. lower_bound: the fraction
    of k below which the threshold is lowered, and the factor it is lowered by (0.8).
    max_lowerings: how many times at most (10)."""

    def __init__(
        self,
        ratio: float = 0.01,
        sample_ratio: float = 0.01,
        min_sample_top: int = 10,
        lower_bound: float = 0.8,
        max_lowerings: int = 10,
    ):
        # max_overselect = 1: the candidates are cut to k whenever more than k pass.
        super().__init__(ratio, sample_ratio, max_overselect=1.0, min_sample_top=min_sample_top)
        self.lower_bound = check_finite_range(
            lower_bound, "lower_bound", 0.0, 1.0, low_open=True, high_open=True,
            hint="the threshold is multiplied by it while fewer than lower_bound·k pass (DGC: 0.8)")
        self.max_lowerings = check_positive_int(max_lowerings, "max_lowerings", minimum=0)

    def target(self, numel: int) -> int:
        return ceil_count(numel, self.ratio)

    def folds_finite_check(self, acc: torch.Tensor) -> bool:
        return False  # no fused pass: the Session checks acc itself

    def select(self, acc: torch.Tensor, k: int, ctx: Context) -> Selected:
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
        mask = ctx.workspace("dgc_reference.mask", numel, torch.bool, acc.device)
        candidates = torch.nonzero(torch.ge(importance, threshold, out=mask)).view(-1)
        lowerings = 0
        # The authors' loop over at most max_lowerings thresholds (each one pass over
        # |acc|); it runs only while too few pass, so most steps list the candidates once.
        while candidates.numel() < self.lower_bound * k and lowerings < self.max_lowerings:
            threshold = threshold * self.lower_bound
            candidates = torch.nonzero(torch.ge(importance, threshold, out=mask)).view(-1)
            lowerings += 1
        count = candidates.numel()
        if count > k:  # the k largest among the candidates: never more than k
            best = torch.topk(importance[candidates], k, sorted=False).indices
            candidates = candidates[best]
        return Selected.gather(acc, candidates, threshold=float(threshold), candidates=count,
                               retopk=count > k, lowerings=lowerings)
