"""Random-k: k distinct coordinates drawn uniformly from a seed every rank shares, the
ranks' values there averaged exactly, zero elsewhere."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import SimulatedGroup
from compressors.basic import _PERMUTE_ABOVE, random_subset


@pytest.mark.parametrize("numel, k", [(1, 1), (7, 7), (10, 3), (1000, 1), (1000, 249),
                                      (1000, 251), (100_000, 100)])
def test_random_subset_draws_k_distinct_indices(numel, k):
    got = random_subset(numel, k, torch.Generator().manual_seed(numel + k), "cpu")
    assert got.dtype == torch.int64 and got.numel() == k
    assert got.unique().numel() == k
    assert 0 <= int(got.min()) and int(got.max()) < numel
    again = random_subset(numel, k, torch.Generator().manual_seed(numel + k), "cpu")
    assert torch.equal(got, again)  # a function of the seed: every rank draws the same


@pytest.mark.parametrize("numel, k", [(40, 4), (40, 30)])  # repeats dropped / permutation
def test_random_subset_is_uniform(numel, k):
    """Each index is kept with probability k/numel (a chi-square test on 8000 draws;
    keeping the smallest distinct draws instead of the first would fail it at once)."""
    assert (k * _PERMUTE_ABOVE > numel) == (k == 30)
    trials = 8000
    counts = torch.zeros(numel)
    g = torch.Generator().manual_seed(0)
    for _ in range(trials):
        counts[random_subset(numel, k, g, "cpu")] += 1
    expected = trials * k / numel
    # Var of a count: trials·p(1−p); the 40 counts sum to trials·k (one constraint).
    p = k / numel
    chi2 = float(((counts - expected) ** 2).sum() / (trials * p * (1 - p)))
    assert chi2 < 80.0, chi2  # 39 degrees of freedom: P(χ² > 80) ≈ 1e-4


def test_randomk_averages_the_ranks_values_at_k_shared_coordinates():
    numel, ratio, workers = 5000, 0.01, 3
    group = SimulatedGroup(compressors.build("randomk", ratio=ratio), workers,
                           feedback="none", seed=4)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(numel, generator=g) for _ in range(workers)]
    outs = group.step(grads)
    idx = outs[0].sent.indices.long()
    assert idx.numel() == 50 and idx.unique().numel() == 50
    for o in outs:
        assert torch.equal(o.sent.indices.long(), idx)  # the same coordinates on every rank
    mean = torch.stack(grads).mean(0)
    agg = outs[0].aggregate
    assert torch.allclose(agg[idx], mean[idx], rtol=1e-6, atol=1e-7)
    rest = torch.ones(numel, dtype=torch.bool)
    rest[idx] = False
    assert torch.count_nonzero(agg[rest]) == 0
