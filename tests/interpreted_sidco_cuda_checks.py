"""SIDCo's two-read device step (cuda_sidco.Split, sidco_pipeline.select_split) run by
Triton's CPU interpreter on CPU tensors, against the torch reference path and the
host-driven path. Not collected by default (the file name): tests/test_sidco_cuda_kernel.py
runs it in a fresh Python with TRITON_INTERPRET=1, which must be set before triton is
first imported. `python tests/interpreted_sidco_cuda_checks.py` (with TRITON_INTERPRET=1)
prints what one step of each device path asks for (launches, reads of acc, host reads)."""

from __future__ import annotations

import collections
import sys

import pytest
import torch

import compressors
from compressors.kernels import cuda as kernels
from compressors.kernels import cuda_sidco as dev
from compressors.kernels import sidco_pipeline

if not kernels.INTERPRETED:
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/test_sidco_cuda_kernel.py does)")


def _laplace(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


def _zero_heavy(n: int, zeros: float, seed: int) -> torch.Tensor:
    x = _laplace(n, seed=seed)
    x[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:round(zeros * n)]] = 0.0
    return x


def _split(fits, acc, k, state=None, stages=None):
    return sidco_pipeline.select_split(acc, k, stages or fits.initial_stages, fits,
                                       {} if state is None else state)


def _agrees(fits, acc, k, got, stages=None):
    """got (select_split's) selects what the reference selects, with its threshold."""
    ref, ref_threshold = fits.select_reference(acc, stages or fits.initial_stages)
    assert torch.equal(got[0].indices.long(), ref)
    assert torch.equal(got[0].values, acc[ref])  # signed, as sent
    assert got[1] == pytest.approx(ref_threshold, rel=1e-12)
    assert got[2] is None


def _no_redo(monkeypatch) -> list:
    """Records every step redone by another path (there should be none)."""
    redone = []
    for name in ("select_host", "select_device"):
        real = getattr(sidco_pipeline, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            redone.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(sidco_pipeline, name, spy)
    return redone


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("n, zeros", [(3 * 4096 + 77, 0.0), (60_013, 0.0), (60_013, 0.9),
                                      (60_013, 0.99)])
@pytest.mark.parametrize("ratio", [0.001, 0.01])
def test_split_selects_what_the_reference_selects(monkeypatch, name, n, zeros, ratio):
    fits = compressors.build(name, ratio=ratio)
    acc = _zero_heavy(n, zeros, seed=n + int(100 * zeros))
    k = max(1, int(ratio * n))
    redone = _no_redo(monkeypatch)
    got = _split(fits, acc, k)
    # every nonzero kept (ρ = δ·d/n₀ ≥ 1): the host path finds the smallest
    assert (redone == []) == (ratio * n < int(torch.count_nonzero(acc)))
    _agrees(fits, acc, k, got)
    assert redone or got[0].indices.dtype == torch.int64
    wanted = min(ratio * n, int(torch.count_nonzero(acc)))
    assert 0.5 * wanted <= got[0].indices.numel() <= 2 * wanted


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("n", [1, 13, 4095, 4097])
def test_split_on_tensors_smaller_than_a_few_blocks(name, n):
    fits = compressors.build(name, ratio=0.01)
    acc = _laplace(n, seed=n)
    got = _split(fits, acc, 1)
    _agrees(fits, acc, 1, got)


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("stages", [1, 2, 3, 7])
def test_split_at_every_stage_count(monkeypatch, name, stages):
    fits = compressors.build(name, ratio=0.001)
    acc = _laplace(40_009, seed=stages)
    redone = _no_redo(monkeypatch)
    got = _split(fits, acc, 40, stages=stages)
    assert redone == []
    _agrees(fits, acc, 40, got, stages=stages)


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("zeros, ratio, stages, decided", [
    (0.97, 0.01, 4, True),  # ρ ≥ δ₁: one stage decided from the nonzeros
    (0.995, 0.01, 4, False),  # ρ ≥ 1: every nonzero kept (left to the host path)
    (0.0, 0.3, 3, True),  # δ ≥ δ₁: one stage whatever M
])
def test_split_where_stage_one_is_the_only_stage(monkeypatch, name, zeros, ratio, stages,
                                                 decided):
    fits = compressors.build(name, ratio=ratio)
    n = 30_011
    acc = _zero_heavy(n, zeros, seed=int(1000 * zeros))
    k = max(1, int(ratio * n))
    redone = _no_redo(monkeypatch)
    got = _split(fits, acc, k, stages=stages)
    assert (redone == []) == decided
    ref, ref_threshold = fits.select_reference(acc, stages)
    assert torch.equal(got[0].indices.long(), ref) and torch.equal(got[0].values, acc[ref])
    assert got[1] == pytest.approx(ref_threshold, rel=1e-12)


@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
def test_split_on_constant_and_zero_tensors(name):
    fits = compressors.build(name, ratio=0.001)
    stages = fits.initial_stages
    assert _split(fits, torch.zeros(20_000), 20) == (None, 0.0, None)
    constant = torch.full((20_001,), 0.5)
    constant[::3] = -0.5
    got = _split(fits, constant, 20)
    ref, _ = fits.select_reference(constant, stages)
    assert torch.equal(got[0].indices.long(), ref)
    assert _split(fits, _laplace(20_000) * 1e-10, 20) is None  # rescaled by the reference


def test_split_flags_nan_and_inf():
    from compressors.kernels.types import NonFinite

    fits = compressors.build("sidco_e", ratio=0.001)
    bad = _laplace(20_000, seed=1)
    bad[777] = float("inf")
    with pytest.raises(NonFinite):
        sidco_pipeline.select_split(bad, 20, 5, fits, {}, check_finite=True)
    assert _split(fits, bad, 20) is None


def test_split_that_misses_is_redone_and_lowers_its_margin(monkeypatch):
    # a Gaussian tail is lighter than the exponential stage 1 assumes: a bound near the
    # guessed second threshold (margin 2) falls above it
    fits = compressors.build("sidco_e", ratio=0.001)
    acc = torch.randn(40_000, generator=torch.Generator().manual_seed(1))
    state = {"split_margin": 2.0}
    redone = _no_redo(monkeypatch)
    got = _split(fits, acc, 40, state)
    assert redone == ["select_device"] and state["split_margin"] == 1.0
    ref, threshold = fits.select_reference(acc, fits.initial_stages)
    assert torch.equal(got[0].indices, ref) and got[1] == pytest.approx(threshold, rel=1e-12)
    _split(fits, acc, 40, state)
    assert state["split_margin"] == 0.5  # (1.0 missed too)
    state["split_margin"] = 0.0
    redone.clear()
    _agrees(fits, acc, 40, _split(fits, acc, 40, state))  # g = t₁ always holds
    assert redone == []


@pytest.mark.parametrize("tiny", ["pool", "final"])
def test_split_past_its_buffers_is_redone_and_grows(monkeypatch, tiny):
    fits = compressors.build("sidco_gp", ratio=0.01)
    acc = _laplace(50_000, seed=6)
    state = {"split_capacity": 1e-6}
    if tiny == "final":  # the pool fits (its 4096 spare entries), the final does not
        state = {"split_capacity": 0.05}
        acc = _laplace(500_000, seed=6)[:40_000]
        monkeypatch.setattr(dev.Split, "final", _final_into(10))
    redone = _no_redo(monkeypatch)
    got = _split(fits, acc, 500, state)
    assert redone == ["select_device"]
    assert state["split_capacity"] > (1e-6 if tiny == "pool" else 0.05)
    ref, _ = fits.select_reference(acc, fits.initial_stages)
    assert torch.equal(got[0].indices, ref)


def _final_into(cap: int):
    real = dev.Split.final

    def final(self, slot, out_cap):
        return real(self, slot, cap)
    return final


def test_split_kernels_against_torch():
    # the pass over acc and the passes over its pool, kernel by kernel, at set thresholds
    n = 5 * dev.SPLIT_BLOCK + 123
    acc = _laplace(n, seed=11)
    a = acc.abs()
    t1, g, t2 = (float(a.kthvalue(int(q * n)).values) for q in (0.75, 0.85, 0.9))
    step = dev.Split(acc, 3, capacity=4.0)
    step.set_first(t1, g, single=False)
    step.split(gp=True, wanted=0.001 * n, keep=0.15)
    total = int(step.board[step._done + step.slots])
    assert total == int((a >= g).sum())
    starts = step._words[:step.tiles]
    counts = step._words[step.tiles:2 * step.tiles]
    positions = torch.cat([step.pos[s:s + c] for s, c in zip(starts.tolist(), counts.tolist())])
    want = torch.nonzero(a >= g).squeeze(1)
    assert torch.equal(positions.long(), want)
    assert torch.equal(torch.cat([step.val[s:s + c] for s, c in zip(starts.tolist(),
                                                                     counts.tolist())]),
                       acc[want])
    # stage 2's fit from the exceedances of t1
    y = a[a > t1].double() - t1
    mean, var = float(y.mean()), float(y.var(unbiased=False))
    fits = compressors.build("sidco_gp", ratio=0.001)
    _, _, th = step.read()
    log = sidco_pipeline.math.log(y.numel() / (0.001 * n)) / 2
    assert th[1] == pytest.approx(fits.gpareto_threshold(None, t1, mean, var, log), rel=1e-9)
    # the final selection at a threshold above g, through the pool
    step.set_first(t1, g, single=False)
    step.t32[2] = kernels._f32(t2)
    step.t32[1] = kernels._f32(t2)
    positions, values = step.final(2, n)
    flags, size, _ = step.read()
    want = torch.nonzero(a >= kernels._f32(t2)).squeeze(1)
    assert flags == 0 and size == want.numel()
    assert torch.equal(positions[:size], want) and torch.equal(values[:size], acc[want])
    # a threshold below g: the pool may lack what the stages read
    step.t32[1] = kernels._f32(t1)
    step.final(2, n)
    assert step.read()[0] == dev.FLAG_MISS


def test_split_copies_to_the_host_once(monkeypatch):
    from compressors.kernels import ops

    def waits(*args, **kwargs):
        raise AssertionError("a host-driven call (it waits for the device)")

    for fn in ("stats", "select", "count", "pool", "all_finite"):
        monkeypatch.setattr(ops, fn, waits)
        if hasattr(kernels, fn):
            monkeypatch.setattr(kernels, fn, waits)
    seen = count_step("sidco_gp", _laplace(60_013, seed=2), 60, monkeypatch)
    assert seen["host reads"] == 1 and seen["reads of acc"] == 2


def count_step(name: str, acc: torch.Tensor, k: int, monkeypatch=None,
               path=sidco_pipeline.select_split, **kwargs) -> collections.Counter:
    """What one step of a device path asks for: Triton launches (and those that read
    acc), allocations, cumulative sums and copies to the host (each a wait on a GPU)."""
    import triton.runtime.interpreter as interp

    seen: collections.Counter = collections.Counter()
    patches = []

    def patch(owner, attr, value):
        patches.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    run = interp.InterpretedFunction.run

    def counted_run(self, *args, **kw):
        seen["launches"] += 1
        if any(isinstance(a, torch.Tensor) and a.data_ptr() == acc.data_ptr()
               and a.numel() == acc.numel() for a in args):
            seen["reads of acc"] += 1
        return run(self, *args, **kw)

    patch(interp.InterpretedFunction, "run", counted_run)
    def counted(real, what):
        def wrap(*a, **kw):
            seen[what] += 1
            return real(*a, **kw)
        return wrap

    for fn in ("empty", "zeros", "cumsum"):
        patch(torch, fn, counted(getattr(torch, fn), "torch." + fn))
    for fn in ("tolist", "item", "__int__", "__float__"):
        patch(torch.Tensor, fn, counted(getattr(torch.Tensor, fn), "host reads"))
    try:
        fits = compressors.build(name, ratio=k / acc.numel())
        state = {}
        path(acc, k, fits.initial_stages, fits, state, **kwargs)
    finally:
        for owner, attr, value in reversed(patches):
            setattr(owner, attr, value)
    return seen


def _growing(n: int, steps: int) -> list[torch.Tensor]:
    base = _laplace(n)
    return [base * (1 + 0.02 * s) + 0.1 * _laplace(n, seed=1 + s) for s in range(steps)]


def main() -> int:
    n = 123_457
    for name in ("sidco_e", "sidco_gp", "sidco_p"):
        acc = _laplace(n)
        print(name, "select_split:", dict(count_step(name, acc, 123)))
        print(name, "select_device, plain:",
              dict(count_step(name, acc, 123, path=sidco_pipeline.select_device,
                              speculate=False)))
        fits = compressors.build(name, ratio=0.001)
        state: dict = {}
        grads = _growing(n, 3)
        for g in grads[:2]:
            sidco_pipeline.select_device(g, 123, fits.initial_stages, fits, state)

        def speculative(acc, k, stages, _fits, _state, _f=fits, _s=state):
            return sidco_pipeline.select_device(acc, k, stages, _f, _s)
        print(name, "select_device, speculative:",
              dict(count_step(name, grads[2], 123, path=speculative)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
