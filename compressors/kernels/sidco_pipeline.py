"""SIDCo's stages (Algorithm 1, lines 2-8) on fused passes: the data movement of the
multi-stage fit, with the fits themselves and the schedule taken from the algorithm
object (`fits`: a compressors.sidco variant, which this module never imports).

Three ways to run the same stages, picked per tensor by `select`, all giving the
selection of compressors/sidco.py's torch reference (the same fits, schedule and
thresholds up to the summation order):

- host-driven (`select_host`, CPU and CUDA kernels): one read of acc for the first fit's
  statistics and the nonzeros, one for the second stage's, one that compacts the
  survivors of the second stage (positions and signed values); a later stage reads its
  pool in place, or compacts it first where at most COMPACT_BELOW of it is expected to
  pass; the final selection comes from the last pool;
- speculative (CPU, inside `select_host`): once the previous steps' thresholds are known,
  the first read also takes what the second stage needs near the guessed thresholds
  and the pool above them (cpu.sidco_spec), so acc is read once where the guess holds
  (the same selection where it does not);
- device-side (`select_device`, CUDA): the same stages with their thresholds fitted on
  the device, no host synchronisation between them (cuda_sidco.Stages), and the same
  speculation; what the device cannot decide it flags, and the host-driven path redoes
  the step.

`fits` provides: ratio (δ), first_stage_ratio (δ₁), first_fit / later_fit
("exponential", "gpareto", "gamma"), first_stage(numel, nonzeros, stages) (the plan:
ratio, tail_log, single; None where every nonzero is kept), nominal_ratios(stages),
later_stage_log(pool, wanted, left), and the fits exponential_threshold, gpareto_threshold
and gamma_threshold; its class builds variants for the device check.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from compressors.kernels import cpu, ops
from compressors.kernels.magnitudes import check_sum_finite, pick, pool_index_dtype, safe
from compressors.kernels.numerics import as_dtype, moments_from_sums
from compressors.kernels.types import NonFinite, Selected, Stats

# Speculation: the first read also takes what the second stage needs for a first
# threshold within ±5% of the one guessed from the last two steps', and the pool above
# 95% of the guessed second threshold.
SPECULATION_MARGIN = 0.05

# A later stage compacts its pool to the exceedances of the last threshold when they are
# expected to be at most this fraction of it; above, it reads them in place (a pass that
# skips the others). Compacting writes what passes: at 26M with δ = 0.001, the pool of the
# speculative read (1.9M) took 0.75 ms to compact to its 22% above the third threshold
# against 0.25 for a statistics pass over it, and 0.33 to compact to the 5.5% above the
# fourth: one pass in place and one compaction instead of two compactions saved ~0.4 ms.
COMPACT_BELOW = 0.1

# The device-side stages write each pool into a buffer of POOL_CAPACITY times the
# elements expected to pass; a step whose pool outgrows it is redone by the host-driven
# stages, and the tensor's later steps get twice the capacity, up to POOL_CAPACITY_MAX.
POOL_CAPACITY = 4.0
POOL_CAPACITY_MAX = 64.0

Found = tuple  # (Selected or None where all zero, threshold, whether the guess held)


def select(acc: torch.Tensor, k: int, stages: int, fits, state: dict,
           check_finite: bool = False) -> Found | None:
    """The step's (Selected, threshold in |acc| units, whether the speculation held: None
    when not tried), (None, 0.0, None) for an all-zero acc, or None where the fused paths
    do not take acc or its mean needs the reference's rescaling. On CUDA the device-side
    stages where they passed their check on this device, else the host-driven ones.
    `state`: the tensor's compressor state (the speculation's history, the pool
    capacity); `check_finite`: NonFinite on a NaN or an Inf, found in the first read."""
    if not ops.supports(acc):
        return None
    if acc.device.type == "cuda" and device_stages_usable(acc.device, fits):
        return select_device(acc, k, stages, fits, state, check_finite)
    return select_host(acc, k, stages, fits, state, check_finite)


# -- host-driven stages ----------------------------------------------------------------------


class Speculative(NamedTuple):
    """The speculative first read (cpu.sidco_spec): its bounds and what it found."""

    window: float
    upper: float
    pool_above: float
    mid: Stats  # |acc| ≥ upper
    # views of this thread's stream workspace (cpu.stream_workspace): read before the
    # step returns
    positions: cpu.StreamPositions  # acc positions of the stream (index_select)
    values: torch.Tensor  # their acc (signed): |acc| > pool_above
    window_values: torch.Tensor  # acc at window ≤ |acc| < upper (no positions: not sent)


def select_host(acc: torch.Tensor, k: int, stages: int, fits, state: dict,
                check_finite: bool = False, speculate: bool = True) -> Found | None:
    """The stages driven from the host (see the module docstring); the pools carry acc's
    signed values, so the final selection comes with the values to send. `speculate`:
    False never takes the speculative read."""
    first = fits.first_fit
    bounds = None
    if (speculate and acc.dtype == torch.float32 and acc.device.type == "cpu"
            and acc.is_contiguous() and acc.numel() < ops.NARROW_LIMIT):
        bounds = speculation_bounds(fits, stages, state)
    spec = None
    if bounds is not None:
        # Σ squares for a GP first stage, mid's for its GP fit; logs for a gamma one;
        # the nonzeros always
        st, *rest = cpu.sidco_spec(
            acc, *bounds, squares=first == "gpareto", logs=first == "gamma",
            mid_squares=fits.later_fit != "exponential",
            workspace=cpu.stream_workspace(acc.numel()))
        spec = Speculative(*bounds, *rest)
    else:
        st = ops.stats(acc, squares=first == "gpareto", logs=first == "gamma", nonzeros=True)
    check_sum_finite(acc, st.sum, check_finite)  # the folded NaN/Inf check
    mean = st.sum / st.count
    if mean == 0.0:
        return None, 0.0, None
    if not safe(mean):
        return None
    plan = fits.first_stage(st.count, st.nonzero, stages)
    threshold = first_threshold(fits, acc, st, plan)
    hit = None if spec is None else False  # None: not tried
    if plan is None or plan.single:
        if spec is not None:  # no second threshold: no guess to check next step
            state["speculation"]["would_hold"] = False
        return pick(acc, threshold, expected=k), threshold, hit
    wanted = fits.ratio * st.count
    # Stage 2 fits the exceedances straight from acc (a stats pass with no output), or
    # from the speculative read; from stage 3 on, a stage reads the exceedances of the
    # last threshold from the current pool: in place while they are expected to be more
    # than COMPACT_BELOW of the pool, else compacted first with their positions, so that
    # later passes read only them. maps[0]: acc positions of the first pool; maps[j]:
    # positions in pool j of pool j + 1: only the final selection (about δ·d elements) is
    # mapped back through them. `above`: the pool holds elements at or below it that this
    # stage must not see, else None; `expected`: about how many of the pool exceed
    # `threshold` (the last stage's count times the ratio it fitted at).
    base, maps, pool, above, expected = None, [], acc, None, 0.0
    for stage in range(1, stages):
        left = stages - stage
        if stage == 1:
            first_t = threshold
            found = None
            if spec is not None:
                found = _second_from_speculation(fits, acc, spec, threshold, wanted, left)
                if found is not None and found[1] is not None and _at_least(
                        found[1], spec.pool_above, acc.dtype):
                    hit = True  # the stream's pool holds everything above `new`
                    base, maps, pool = spec.pool_above, [spec.positions], spec.values
            if found is None:
                found = _later_stage(fits, acc, threshold, wanted, left, above=threshold)
            _, new, expected = found
            if new is None:  # no more than wanted exceeds: the stages stop
                break
            remember(fits, state, first_t, new, stages)
            threshold = new
            continue
        if base is None or expected <= COMPACT_BELOW * pool.numel():
            # (acc itself is always compacted)
            local, pool = _compact(pool, threshold, expected / pool.numel())
            maps.append(local)
            base, above = threshold, None
            if pool.numel() == 0:
                break
        else:
            above = threshold
        _, new, expected = _later_stage(fits, pool, threshold, wanted, left, above=above)
        if new is None:  # no more than wanted exceeds: the stages stop
            break
        threshold = new
    if base is None or pool.numel() == 0 or not _above(threshold, base, acc.dtype):
        return pick(acc, threshold, expected=k), threshold, hit
    # the pools carry acc's values (signed): those selected are the ones sent
    indices, values = ops.select(pool, threshold, values=True, signed=True)
    for positions in reversed(maps):
        indices = positions.index_select(0, indices)
    return Selected(indices, values), threshold, hit


def first_threshold(fits, acc: torch.Tensor, st: Stats, plan) -> float:
    """Stage 1's threshold from the first read's Stats of acc (its mean checked nonzero
    and safe): Σ|x| and the nonzeros, with Σx² for a GP fit or Σ ln|x| for a gamma one
    (exact zeros add nothing to the sums: only the divisor leaves them out). A further
    pass only under cancellation or in degenerate cases; the smallest nonzero |x| where
    every nonzero is kept (plan None)."""
    nonzeros = st.nonzero
    # the fitted elements: |x| > 0, or all of acc when it holds no zero (the same)
    above = None if nonzeros == st.count else 0.0

    def min_positive() -> float:
        return ops.stats(acc, above=0.0, extremes=True).min

    if plan is None:
        return min_positive()
    mean = st.sum / nonzeros
    if fits.first_fit == "exponential":
        return fits.exponential_threshold(0.0, mean, plan.tail_log)
    if fits.first_fit == "gpareto":
        mean_g, var = moments_from_sums(
            mean, st.sumsq / nonzeros,
            lambda m: ops.stats(acc, above=above, shift=m, squares=True).sumsq / nonzeros)
        return fits.gpareto_threshold(min_positive, 0.0, mean_g, var, plan.tail_log)
    return fits.gamma_threshold(mean, st.log_sum / nonzeros, plan.ratio, min_positive)


def _later_stage(fits, pool: torch.Tensor, t: float, wanted: float, left: int,
                 above: float | None = None):
    """A later stage on the elements of `pool` above `above` (all of them when None: a
    compacted pool), with `left` stages to go (this one included): (the count of its
    exceedances of t, the new threshold or None where the stages stop, about how many
    exceed the new threshold)."""
    st = ops.stats(pool, above=above, shift=t, squares=fits.later_fit != "exponential")
    tail_log = fits.later_stage_log(st.count, wanted, left)
    if tail_log is None:
        return st.count, None, 0.0
    new = _threshold_from_sums(fits, pool, above, t, tail_log, st.count, st.sum, st.sumsq)
    return st.count, new, st.count * math.exp(-tail_log)


def _threshold_from_sums(fits, source: torch.Tensor, above: float | None, t: float,
                         tail_log: float, n: int, sum_y: float, sumsq_y: float) -> float:
    """A later stage's threshold from the count n, Σy and Σy² (read for the GP fit only)
    of the exceedances y = |x| − t, the elements of `source` above `above` (read again
    only for the GP fit's second pass under cancellation or its point-mass minimum)."""
    if fits.later_fit == "exponential":
        return fits.exponential_threshold(t, sum_y / n, tail_log)
    mean, var = moments_from_sums(
        sum_y / n, sumsq_y / n,
        lambda m: ops.stats(source, above=above, shift=t + m, squares=True).sumsq / n)
    return fits.gpareto_threshold(lambda: ops.stats(source, above=above, extremes=True).min,
                                  t, mean, var, tail_log)


def _second_from_speculation(fits, acc: torch.Tensor, spec: Speculative, t: float,
                             wanted: float, left: int):
    """Stage 2 from the speculative read, when the first threshold `t` lies in its window
    (window ≤ t < upper as float32): what _later_stage returns (the count of the
    exceedances of t is then exact). None when it does not (the caller fits from acc)."""
    window, upper, mid = spec.window, spec.upper, spec.mid
    if not (_at_least(t, window, acc.dtype) and _above(upper, t, acc.dtype)):
        return None
    # the exceedances: mid (|x| ≥ upper) and the window's above t
    gp = fits.later_fit != "exponential"
    st = ops.stats(spec.window_values, above=t, shift=t, squares=gp)
    n = st.count + mid.count
    tail_log = fits.later_stage_log(n, wanted, left)
    if tail_log is None:
        return n, None, 0.0
    if not gp:  # mid holds Σ|x|: Σ(|x| − t) = Σ|x| − n·t
        new = _threshold_from_sums(fits, acc, t, t, tail_log, n,
                                   st.sum + mid.sum - mid.count * t, 0.0)
    else:
        # mid holds Σz, Σz² of z = |x| − u (u: upper as float32); y = z + (u − t)
        d = as_dtype(upper, acc.dtype) - t
        sum_y = st.sum + mid.sum + mid.count * d
        sumsq_y = st.sumsq + mid.sumsq + 2 * d * mid.sum + mid.count * d * d
        new = _threshold_from_sums(fits, acc, t, t, tail_log, n, sum_y, sumsq_y)
    return n, new, n * math.exp(-tail_log)


def _compact(pool: torch.Tensor, t: float, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in `pool` (ascending; int32 on the CPU, see pool_index_dtype) and values
    (signed, as in acc) of its elements with |x| > t; `keep`: the fraction expected to
    pass."""
    if pool.dtype == torch.float32:
        _, local, values = ops.pool(
            pool, t, dense=keep > ops.DENSE_FRACTION,
            reserve=int(1.25 * keep * pool.numel()) + 1024, index_dtype=pool_index_dtype(pool),
            signed=True)
        return local, values
    return ops.select(pool, t, strict=True, values=True, signed=True,
                      reserve=int(2 * keep * pool.numel()))


# -- speculation from the previous steps ------------------------------------------------------


def speculation_bounds(fits, stages: int, state: dict) -> tuple[float, float, float] | None:
    """(window, upper, pool_above) for a speculative first read around this step's guess
    of the first two thresholds, or None: no speculation on the first steps, with one
    stage, after a change of the schedule (the stage count), or when the last guess would
    not have held (thresholds on the move, or no second stage: a miss costs more than the
    plain reads)."""
    history = state.get("speculation")
    if (history is None or not history["would_hold"] or stages < 2
            or fits.ratio >= fits.first_stage_ratio
            or history["schedule"] != _schedule(fits, stages)):
        return None
    first, second = _guess(history["thresholds"])
    bounds = _bounds(first, second)
    return bounds if bounds[1] <= bounds[2] else None


def remember(fits, state: dict, first: float, second: float, stages: int) -> None:
    """Keep the last two steps' first two thresholds, and whether the guess made from the
    earlier ones would have held for this step's."""
    history = state.get("speculation")
    used = _schedule(fits, stages)
    past = history["thresholds"] if history and history["schedule"] == used else []
    would_hold = False
    if past:
        window, upper, pool_above = _bounds(*_guess(past))
        would_hold = window <= first < upper and second >= pool_above
    state["speculation"] = {"thresholds": (past + [(first, second)])[-2:],
                            "schedule": used, "would_hold": would_hold}


def _schedule(fits, stages: int) -> tuple[int, float]:
    """What identifies a step's schedule (the speculation's history is kept per one)."""
    return stages, fits.first_stage_ratio


def _guess(thresholds: list[tuple[float, float]]) -> tuple[float, float]:
    """This step's first two thresholds guessed from the last one or two steps': the last
    pair times its growth over the one before (with error feedback the residual, and so
    every threshold, grows for many steps), or the last pair alone."""
    if len(thresholds) < 2:
        return thresholds[-1]
    (a1, a2), (b1, b2) = thresholds[-2:]
    return b1 * (b1 / a1), b2 * (b2 / a2)


def _bounds(first: float, second: float) -> tuple[float, float, float]:
    """(window, upper, pool_above) of the speculative read around a guess."""
    return (first * (1 - SPECULATION_MARGIN), first * (1 + SPECULATION_MARGIN),
            second * (1 - SPECULATION_MARGIN))


def speculation_shares(ratios: list[float]) -> dict:
    """The fractions of acc expected in the device read's window and pool (their
    buffers' sizes): for an exponential tail fitted at stage 1's and stage 2's nominal
    ratios (a tensor with zeros, whose stages keep fractions of the nonzeros, fills
    less), δ₁·(δ₁^−m − δ₁^m) near the first threshold and (δ₁δ₂)^(1−m) above (1 − m)
    times the second, m = SPECULATION_MARGIN."""
    m, first, both = SPECULATION_MARGIN, ratios[0], ratios[0] * ratios[1]
    return {"keep_window": first * (first ** -m - first ** m), "keep_pool": both ** (1 - m)}


def _above(threshold: float, base: float, dtype: torch.dtype) -> bool:
    """Whether t > base once both are rounded to dtype (how the comparisons see them):
    then {|x| ≥ t} lies inside the pool {|x| > base}."""
    return as_dtype(threshold, dtype) > as_dtype(base, dtype)


def _at_least(threshold: float, base: float, dtype: torch.dtype) -> bool:
    """Whether t ≥ base once both are rounded to dtype: then {|x| > t} lies inside the
    pool {|x| > base}."""
    return as_dtype(threshold, dtype) >= as_dtype(base, dtype)


# -- device-side stages (CUDA) -----------------------------------------------------------------


def select_device(acc: torch.Tensor, k: int, stages: int, fits, state: dict,
                  check_finite: bool = False, speculate: bool = True) -> Found | None:
    """select_host's stages with no host synchronisation between them (cuda_sidco.py):
    the same fits, schedule, compactions (COMPACT_BELOW) and final selection, the
    thresholds fitted on the device, one copy to the host at the end. Stage 1's schedule
    (ρ from the nonzeros counted by the first read) and each later stage's ratio (from its
    pool's count) are decided on the device; a stage that stops leaves the threshold and
    the stop on the board for the stages after it. SIDCo-P's gamma stage is fitted on the
    host (scipy), its later ones on the device. What the device path flags (a GP fit under
    cancellation or at a point mass, every nonzero kept, a pool past its buffer, a final
    threshold not above its pool's) is redone by select_host: the same selection either
    way.

    When the previous steps' thresholds are known, the first read of acc also keeps the
    elements near the guessed first threshold and those above the guessed second one, in
    acc's order (Stages.speculate): stage 2 is fitted from them and the later stages read
    that pool, so acc is read once. Where the guess did not hold (flagged on the device),
    the step is redone without it. Returns what select_host does."""
    from compressors.kernels import cuda_sidco as dev  # noqa: PLC0415 (imports triton)

    # pools sized from the shares expected to pass (the nominal schedule's: a tensor with
    # zeros passes fewer), times `capacity`: doubled for later steps (up to
    # POOL_CAPACITY_MAX) each time one outgrew its buffer
    capacity = state.get("pool_capacity", POOL_CAPACITY)
    nominal = fits.nominal_ratios(stages)
    wanted = fits.ratio * acc.numel()
    bounds = None
    if speculate and acc.numel() < dev.SPEC_LIMIT:
        bounds = speculation_bounds(fits, stages, state)
    last = stages - 1
    board = dev.Stages(acc, stages + (bounds is not None), capacity)
    gp = fits.later_fit != "exponential"
    spec = None
    if bounds is not None:
        spec = board.speculate(*bounds, pa_slot=last + 1,
                               squares=fits.first_fit == "gpareto", mid_squares=gp,
                               logs=fits.first_fit == "gamma", **speculation_shares(nominal))
    # one stage known on the host: δ ≥ δ₁ (so ρ ≥ δ₁), or from the gamma stage's fit
    one_stage = fits.ratio >= fits.first_stage_ratio
    if fits.first_fit == "gamma":
        if spec is None:
            st = ops.stats(acc, logs=True)
        else:
            st = Stats(*dev.gpu.reduce_stats(spec.part))
        check_sum_finite(acc, st.sum, check_finite)
        mean = st.sum / st.count
        if mean == 0.0:
            return None, 0.0, None
        if not safe(mean):
            return None
        plan = fits.first_stage(st.count, st.nonzero, stages)
        board.set(0, first_threshold(fits, acc, st, plan))
        one_stage = one_stage or plan is None or plan.single
    else:
        board.first(gp=fits.first_fit == "gpareto", ratio=fits.ratio,
                    first_ratio=fits.first_stage_ratio, stages=stages, spec=spec)
    if one_stage or stages == 1:
        out = board.final(board.source(), 0, None, 0, cap=math.ceil(capacity * k) + 4096)
        last = 0
    else:
        if spec is None:
            src, base, base_slot, after = board.source(), None, 0, 1
            share = nominal[0] * nominal[1]
        else:  # stage 2 from the read; the later ones from its pool (|x| > pool_above)
            board.second_from(spec, gp=gp, wanted=wanted, left=stages - 1)
            src, base, base_slot, after, share = spec.pool, spec.pool, last + 1, 2, 1.0
        for slot in range(after, stages):
            above = True
            if slot >= 2 and (base is None or share <= COMPACT_BELOW):
                src = board.compact(src, slot - 1, share)
                base, base_slot, above, share = src, slot - 1, False, 1.0
            board.later(src, slot - 1, slot, above=above, gp=gp, wanted=wanted,
                        left=stages - slot)
            if slot >= 2:
                share *= nominal[slot]
        if base is None:  # two stages: from acc, about k of it
            out = board.final(src, last, None, 0, cap=math.ceil(capacity * k) + 4096)
        else:
            out = board.final(src, last, base, base_slot)
    flags, total, thresholds = board.read()
    if flags & dev.FLAG_NONFINITE and check_finite:
        raise NonFinite("the tensor holds NaN or Inf")
    if flags & dev.FLAG_ZERO:
        return None, 0.0, None
    if flags & dev.FLAG_UNSAFE:
        return None
    if flags & dev.FLAG_MISS:
        # The guess did not hold (or stage 1 chose a single stage, or stage 2 stopped: the
        # pool read then holds too little): the step again without it (what overflowed
        # here may be the later pools at thresholds fitted from an incomplete window: the
        # redo sizes its own buffers), and no speculation on the next step either.
        found = select_device(acc, k, stages, fits, state, check_finite, speculate=False)
        state["speculation"]["would_hold"] = False  # (the redo's `remember` set it)
        return found if found is None else (*found[:2], False)
    hit = None if spec is None else True
    if one_stage and spec is not None:  # the read's stream was not needed: no guess
        state["speculation"]["would_hold"] = False  # to check on the next step
        hit = False
    if flags & dev.FLAG_OVERFLOW:
        state["pool_capacity"] = min(2 * capacity, POOL_CAPACITY_MAX)
    if flags & dev.FLAG_REDO:  # (select_host keeps the thresholds for the next guess)
        found = select_host(acc, k, stages, fits, state, check_finite)
        return found if found is None else (*found[:2], hit)
    if last > 0 and thresholds[1] != thresholds[0]:  # (equal: stage 2 stopped)
        remember(fits, state, thresholds[0], thresholds[1], stages)
    indices = out.positions[:total].clone()
    return Selected(indices, out.values[:total].clone()), thresholds[last], hit


_device_checked: dict = {}  # (device, variant) -> whether select_device may be used there


def device_stages_usable(device: torch.device, fits) -> bool:
    """Whether SIDCo's device-side stages (select_device) are used on `device` for this
    variant: checked once per device and variant against the host-driven path on a
    synthetic gradient (a Triton that cannot compile the kernels, or any difference,
    leaves the host-driven path in use, with a warning)."""
    key = (device, type(fits).__name__)
    if key not in _device_checked:
        _device_checked[key] = check_device_stages(device, type(fits))
    return _device_checked[key]


def check_device_stages(device: torch.device, variant: type) -> bool:
    """select_device against select_host on `device`, for a SIDCo `variant` (its class):
    three steps of a growing gradient (the third read speculatively) and one with 90% exact
    zeros, at ratios 0.001 and 0.05 (ρ = 0.5: a single stage whose later pools keep their
    ties). True when every selection and threshold agrees and the speculation was taken."""
    problem = None
    try:
        g = torch.Generator().manual_seed(5)

        def laplace(n: int) -> torch.Tensor:
            u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
            return (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)

        base = laplace(300_007)
        zeros = torch.randperm(base.numel(), generator=g)[:270_000]
        for ratio in (0.001, 0.05):
            fits = variant(ratio=ratio)
            k = max(1, int(ratio * base.numel()))
            stages = fits.initial_stages
            on_device, on_host = {}, {}
            speculated = False
            for step in range(4):
                acc = base * (1 + 0.02 * step) + 0.1 * laplace(base.numel())
                if step == 3:
                    acc[zeros] = 0.0
                acc = acc.to(device)
                got = select_device(acc, k, stages, fits, on_device)
                want = select_host(acc, k, stages, fits, on_host)
                if not (same_selection(got[0], want[0])
                        and abs(got[1] - want[1]) <= 1e-12 * abs(want[1])):
                    problem = (f"its selection at ratio {ratio}, step {step} differs from the "
                               "host-driven path's")
                    break
                speculated |= got[2] is True
            if problem is None and not speculated:
                problem = f"its speculative read was not taken at ratio {ratio}"
            if problem is not None:
                break
    except Exception as exc:  # noqa: BLE001 (whatever fails: report it, use the host path)
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        warnings.warn(f"SIDCo's device-side stages are unusable on {device} ({problem}); "
                      "using the host-driven stages", RuntimeWarning, stacklevel=4)
    return problem is None


def same_selection(a: Selected, b: Selected) -> bool:
    """The same positions (whatever their integer dtype) and the same values."""
    return (torch.equal(a.indices.to(torch.int64), b.indices.to(torch.int64))
            and torch.equal(a.values, b.values))
