"""SIDCo's speculative first read (compressors/kernels/sidco_pipeline.py, cpu.sidco_spec):
the kernel
against its definition in torch, and the selection against the pure-torch reference
whether the speculation holds, misses its window, misses its pool or is not tried."""

from __future__ import annotations

import math

import pytest
import torch

import compressors
from compressors import Session, drive
from compressors.kernels import cpu, ops
from compressors.kernels.numerics import as_dtype
from compressors.kernels.sidco_pipeline import SPECULATION_MARGIN
from repro.testing import with_threads

needs_native = pytest.mark.skipif(not ops.available(),
                                  reason=f"native kernels unavailable: {ops.error()}")


def _laplace(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


@needs_native
@pytest.mark.parametrize("n, threads", [(5, 1), (5, 2), (1000, 2), (2**15 + 13, 2),
                                        (300_001, 1), (300_001, 2), (600_007, 3),
                                        (600_007, 4)])
@pytest.mark.parametrize("squares, mid_squares, logs",
                         [(False, False, False), (False, True, False), (True, True, False),
                          (False, True, True), (True, False, True)])
@pytest.mark.parametrize("share", ["narrow", "wide window", "wide stream"])
def test_kernel_matches_its_definition(n, threads, squares, mid_squares, logs, share):
    """The first statistics equal gc_stats' bit for bit (Σy² only when asked; the nonzeros
    always, which every first fit divides by; with `logs` Σ ln|x| the gamma fit reads
    too); mid (|x| ≥ b)'s count is exact and
    its sums (Σ|x|, or Σz and Σz² with mid_squares) equal float64 sums; the stream is
    {|x| > g}, ascending, with its positions and x itself (signed: what is finally sent),
    the window {w ≤ |x| < b}, ascending, with x; bounds equal to elements (ties) compare as
    torch compares in float32. Each thread writes its part of the stream and of the window
    where its elements start, then the parts are moved together: by all threads where a
    part's new place is clear of its old one (a narrow run, about 8% of x), by one
    overlapping move where not (a wide one, 88% or 95%)."""
    x = _laplace(n, seed=n)
    x[::17] = 0.0
    mag = x.abs()
    bounds = {"narrow": (0.70, 0.78, 0.93), "wide window": (0.02, 0.90, 0.92),
              "wide stream": (0.01, 0.03, 0.05)}[share]
    w, b, g = (float(mag.kthvalue(max(1, int(f * n))).values) for f in bounds)
    b = b + 1e-12  # not a float32: rounded as torch rounds it
    first, mid, idx, val, win = with_threads(
        threads, lambda: cpu.sidco_spec(x, w, b, g, squares=squares, logs=logs,
                                            mid_squares=mid_squares))
    plain = cpu.stats(x, squares=squares, logs=logs, nonzeros=True)
    assert (first.count, first.sum, first.sumsq) == (plain.count, plain.sum, plain.sumsq)
    assert (first.sumsq > 0) == squares
    assert first.nonzero == plain.nonzero == int((x != 0).sum()) < n
    if logs:
        assert first.log_sum == plain.log_sum
    wf, bf, gf = _f32(w), _f32(b), _f32(g)
    in_mid = mag >= bf
    assert mid.count == int(in_mid.sum())
    a = mag[in_mid].double()
    if mid_squares:
        z = a - bf
        assert mid.sum == pytest.approx(float(z.sum()), rel=1e-12, abs=1e-300)
        assert mid.sumsq == pytest.approx(float((z * z).sum()), rel=1e-12, abs=1e-300)
    else:
        assert mid.sum == pytest.approx(float(a.sum()), rel=1e-12, abs=1e-300)
    expected = (mag > gf).nonzero().view(-1)
    positions = idx.tensor()
    assert positions.dtype == torch.int32 and torch.equal(positions.long(), expected)
    assert idx.count == val.numel()
    assert torch.equal(val, x[expected])
    near = ((mag >= wf) & (mag < bf)).nonzero().view(-1)
    assert torch.equal(win, x[near])
    assert expected.numel() > 0 and (near.numel() > 0 or n < 1000)


@needs_native
def test_kernel_writes_the_stream_into_the_workspace_it_is_given():
    """With `workspace` the stream is views of it (nothing allocated per call), and a later
    call into the same workspace gives the same stream for the same input; a workspace
    holding old bits past the tensor's end (the last bitmap word) does not change the
    positions."""
    x = _laplace(300_001, seed=4)
    t = float(x.abs().quantile(0.9))
    kept_buffers = (
        torch.full((cpu.stream_bitmap_bytes(x.numel()) + 5,), 255, dtype=torch.uint8),
        torch.full((x.numel() + 5,), -7.0), torch.full((x.numel() + 5,), -7.0))
    _, _, idx, val, win = with_threads(
        2, lambda: cpu.sidco_spec(x, t / 2, t / 1.5, t, workspace=kept_buffers))
    assert idx.bitmap.data_ptr() == kept_buffers[0].data_ptr()
    assert val.data_ptr() == kept_buffers[1].data_ptr()
    assert win.data_ptr() == kept_buffers[2].data_ptr() and win.numel() > 0
    fresh = with_threads(2, lambda: cpu.sidco_spec(x, t / 2, t / 1.5, t))
    assert torch.equal(idx.tensor(), fresh[2].tensor()) and torch.equal(val, fresh[3])
    assert torch.equal(win, fresh[4])
    kept = idx.tensor()
    assert int(kept[-1]) < x.numel() and idx.count == kept.numel() > 0
    # an empty stream: the workspace reused
    cpu.sidco_spec(x * 0, 1.0, 2.0, 3.0, workspace=kept_buffers)
    again = cpu.sidco_spec(x, t / 2, t / 1.5, t, workspace=kept_buffers)
    assert torch.equal(again[2].tensor(), kept)
    assert cpu.stream_workspace(10)[0].numel() >= cpu.stream_bitmap_bytes(10) == 76
    assert (cpu.stream_workspace(10)[0].data_ptr()
            == cpu.stream_workspace(5)[0].data_ptr())


@needs_native
@pytest.mark.parametrize("n, threads", [(1, 1), (63, 1), (64, 1), (65, 1), (1000, 1),
                                        (2**15 + 13, 1), (300_001, 2), (600_007, 3)])
def test_stream_positions_select_what_a_positions_tensor_would(n, threads):
    """StreamPositions.index_select(0, j) equals the written-out positions' index_select
    for ascending j, at every word, checkpoint, block and thread edge (the later threads'
    checkpoints follow their runs' move); out-of-order or out-of-range j raise."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x[n // 3: n // 3 + 5000] = 0.0  # a stretch with no stream: checkpoints that repeat
    mag = x.abs()
    w, b, gg = 0.5, 1.0, 1.5
    _, _, pos, val, _ = with_threads(threads, lambda: cpu.sidco_spec(x, w, b, gg))
    keep = mag > gg
    expected = keep.nonzero().view(-1).int()
    assert pos.count == expected.numel() == val.numel()
    for j in (torch.arange(expected.numel()), torch.arange(0, expected.numel(), 7),
              torch.arange(expected.numel())[-3:], torch.zeros(0, dtype=torch.int64)):
        got = pos.index_select(0, j)
        assert got.dtype == torch.int32 and torch.equal(got, expected.index_select(0, j))
    if expected.numel() >= 2:
        with pytest.raises(ValueError, match="ascending"):
            pos.index_select(0, torch.tensor([1, 0]))
    with pytest.raises(IndexError, match="out of range"):
        pos.index_select(0, torch.tensor([expected.numel()]))
    with pytest.raises(IndexError, match="one-dimensional"):
        pos.index_select(1, torch.tensor([0]))


@needs_native
def test_kernel_refuses_what_it_does_not_take():
    for bad in (torch.zeros(10, dtype=torch.float64), torch.zeros(20)[::2]):
        with pytest.raises(TypeError, match="float32"):
            cpu.sidco_spec(bad, 0.1, 0.2, 0.3)
    x = torch.ones(100)
    for given in ((torch.empty(83, dtype=torch.uint8), torch.empty(100), torch.empty(100)),
                  (torch.empty(84, dtype=torch.int32), torch.empty(100), torch.empty(100)),
                  (torch.empty(84, dtype=torch.uint8), torch.empty(99), torch.empty(100)),
                  (torch.empty(84, dtype=torch.uint8), torch.empty(100), torch.empty(99)),
                  (torch.empty(84, dtype=torch.uint8), torch.empty(200)[::2], torch.empty(100)),
                  (torch.empty(84, dtype=torch.uint8), torch.empty(100),
                   torch.empty(100, dtype=torch.float64))):
        with pytest.raises(TypeError, match="workspace for a bitmap of 84"):
            cpu.sidco_spec(x, 0.1, 0.2, 0.3, workspace=given)
    shared = torch.empty(150)
    for val, win in ((shared[:100], shared[50:]), (shared[:100], shared[:100])):
        with pytest.raises(ValueError, match="two separate buffers"):
            cpu.sidco_spec(x, 0.1, 0.2, 0.3, workspace=(torch.empty(84, dtype=torch.uint8),
                                                            val, win))


def _session(name: str) -> Session:
    comp = compressors.build(name, ratio=0.001, adaptive=False)
    return Session(comp, world_size=1, feedback="none", seed=1)


def _indices(session: Session, x: torch.Tensor, step: int) -> torch.Tensor:
    return drive([session.exchange("g", x, step)])[0].sent.indices


def _reference_indices(monkeypatch, name: str, x: torch.Tensor) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv("GRADCOMP_NATIVE", "0")
        return _indices(_session(name), x, 0)


@needs_native
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("case, scale1, scale2, expected", [
    ("hit", 1.0, 1.0, True),
    ("first threshold above the window", 1 / (1 + 2 * SPECULATION_MARGIN), 1.0, False),
    ("first threshold below the window", 1.5, 1.5, False),
    ("second threshold below the pool", 1.0, 1.3, False),
])
def test_selection_is_the_reference_one_whatever_the_guess(monkeypatch, name, case, scale1,
                                                          scale2, expected):
    """The guess is set by hand around the true thresholds of x: the speculation holds,
    or misses (η₁ outside its window, η₂ below the pool's bound) and the plain reads
    finish the stages: the selection is the reference path's in every case."""
    x = _laplace(400_003, seed=3)
    session = _session(name)
    first = _indices(session, x, 0)  # no history yet: not tried
    state = session.states["g"]["compressor"]
    assert state["speculated"] is None
    eta1, eta2 = state["speculation"]["thresholds"][-1]
    state["speculation"] = {"thresholds": [(eta1 * scale1, eta2 * scale2)],
                            "schedule": state["speculation"]["schedule"], "would_hold": True}
    again = _indices(session, x, 1)
    assert state["speculated"] is expected, case
    reference = _reference_indices(monkeypatch, name, x)
    assert torch.equal(first, reference)
    assert torch.equal(again, reference)
    assert reference.numel() > 0


@needs_native
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
def test_speculation_follows_growing_thresholds_and_stops_after_a_miss(monkeypatch, name):
    """Thresholds that grow by a steady factor are guessed from the last two steps (the
    speculation holds from the third step on); after a jump it is not tried until a guess
    would have held again. Every step selects what the reference path selects."""
    x = _laplace(300_007, seed=5)
    session = _session(name)
    scales = [1.0, 1.04, 1.04**2, 1.04**3, 2.0, 2.0 * 1.04, 2.0 * 1.04**2, 2.0 * 1.04**3]
    flags = []
    for step, s in enumerate(scales):
        y = x * s
        got = _indices(session, y, step)
        flags.append(session.states["g"]["compressor"]["speculated"])
        assert torch.equal(got, _reference_indices(monkeypatch, name, y)), step
    # step 1: one threshold pair known, the guess not yet checked; 2, 3: extrapolated;
    # 4: the jump misses; 5: not tried; 6: the guess from steps 4 and 5 is off (the jump
    # doubled the growth), 7: held again
    assert flags == [None, None, True, True, False, None, None, True]


def _zero_heavy(n: int, zeros: float, seed: int) -> torch.Tensor:
    """Laplace values with round(zeros·n) of them (fixed positions) exactly zero."""
    x = _laplace(n, seed=seed)
    x[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:round(zeros * n)]] = 0
    return x


@needs_native
@pytest.mark.parametrize("name", ["sidco_e", "sidco_gp", "sidco_p"])
@pytest.mark.parametrize("zeros, ratio, speculates", [
    (0.9, 0.001, True), (0.99, 0.001, True), (0.9, 0.01, True),
    (0.97, 0.01, False),  # ρ = δ·d/n₀ ≥ δ₁: one stage, no second threshold to guess
    (0.995, 0.01, False),  # fewer nonzeros than k: every one is kept
])
def test_selection_on_zero_heavy_tensors_is_the_reference_one(monkeypatch, name, zeros,
                                                              ratio, speculates):
    """On tensors with 90–99.5% exact zeros whose thresholds grow by a steady factor, every
    step selects exactly what the reference path selects, whether the first read is
    speculative (and the guess holds: from the third step on), plain, or the stages
    end after stage 1 (then nothing is guessed)."""
    x = _zero_heavy(300_007, zeros, seed=int(zeros * 1000))
    session = Session(compressors.build(name, ratio=ratio, adaptive=False), world_size=1,
                      feedback="none", seed=1)
    flags = []
    for step in range(5):
        y = x * 1.04**step
        got = _indices(session, y, step)
        flags.append(session.states["g"]["compressor"]["speculated"])
        with monkeypatch.context() as m:
            m.setenv("GRADCOMP_NATIVE", "0")
            reference = _indices(Session(compressors.build(name, ratio=ratio, adaptive=False),
                                         world_size=1, feedback="none", seed=1), y, 0)
        assert torch.equal(got, reference), (step, flags)
        wanted = min(ratio * x.numel(), int(torch.count_nonzero(x)))  # (at most all nonzeros)
        assert 0.8 * wanted <= got.numel() <= 1.25 * wanted
    assert flags == ([None, None, True, True, True] if speculates else [None] * 5)


@needs_native
def test_no_speculation_for_inputs_it_does_not_take():
    """float64 inputs keep the plain reads."""
    for name in ("sidco_e", "sidco_p"):
        session = _session(name)
        x = _laplace(100_003, seed=7).double()
        for step in range(4):
            _indices(session, x, step)
            assert session.states["g"]["compressor"]["speculated"] is None


@needs_native
def test_a_nan_leaves_the_speculation_state_as_it_was():
    """The speculative read is the folded NaN/Inf check too: a step that finds a NaN
    raises before it writes any state, and the next clean step selects what it would
    have selected without the bad one."""
    x = _laplace(200_003, seed=9)
    clean, bad = _session("sidco_e"), _session("sidco_e")
    for step in range(3):
        _indices(clean, x, step)
        _indices(bad, x, step)
    before = dict(bad.states["g"]["compressor"]["speculation"])
    poisoned = x.clone()
    poisoned[1234] = math.nan
    with pytest.raises(FloatingPointError, match="NaN"):
        _indices(bad, poisoned, 3)
    assert bad.states["g"]["compressor"]["speculation"] == before
    assert torch.equal(_indices(bad, x, 3), _indices(clean, x, 3))
    assert bad.states["g"]["compressor"]["speculated"] is True


def test_rounding_to_the_tensor_dtype_is_torchs():
    """The bounds and thresholds are compared as a float32 tensor sees them: the struct
    shortcut rounds exactly as torch's conversion, at ties, subnormals, the edge of the
    range (past it: ±∞) and for non-finite values."""
    g = torch.Generator().manual_seed(3)
    values = (torch.rand(20_000, generator=g, dtype=torch.float64) * 2 - 1) * torch.pow(
        10.0, torch.rand(20_000, generator=g, dtype=torch.float64) * 84 - 46)
    edges = [0.0, -0.0, 1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, 2.0**-149, 2.0**-150,
             3 * 2.0**-151, 1e-46, 3.4028234663852886e38, 3.4028235677973366e38, 1e39,
             -1e39, math.inf, -math.inf, math.nan]
    for v in values.tolist() + edges:
        for dtype in (torch.float32, torch.float64, torch.float16):
            want = float(torch.tensor(v, dtype=dtype))
            got = as_dtype(v, dtype)
            assert (got == want and math.copysign(1, got) == math.copysign(1, want)) or (
                math.isnan(got) and math.isnan(want)), (v, dtype)

