"""Encode/decode latency of compressors over tensor sizes (`repro bench`).

Reproduces the micro-benchmarks of SIDCo Figs. 16–17 (compression latency and speed-up
over Top-k on synthetic tensors of 0.26M, 2.6M and 26M elements at ratios 0.1, 0.01,
0.001) and DRAGONN Fig. 5 ((a) encoding time over tensor sizes, (b) batched sparse
decoding vs dense per-rank decoding over K workers).

How each number is taken:
- encode / decode: a single-worker Session (no error feedback, no extra statistics, no
  NaN/Inf check: the compressor alone) runs the compressor's protocol; encode is the
  compute before its requests (and between rounds), decode the compute after the last
  answer, into a destination allocated once (`out`, as the DDP hook decodes into the
  gradient itself; compressors that return a tensor of their own leave it). The driver
  here answers the requests itself and synchronises the device at every boundary, so
  CUDA times are kernel times, not launch times. Median of `repeats` calls after one
  warm-up call.
- floor: one read pass over the same tensor, `torch.sum` of a precomputed |x| (what any
  selection must at least do), with `torch.linalg.vector_norm(x, 1)` (abs fused into the
  reduction) as a second reference. Every encode time is reported over the floor and
  over exact Top-k at the same size and ratio (Top-k is always measured, as reference).
- decode, batched vs dense per rank: K ranks' k (index, value) pairs decoded either by
  ONE index_add of all pairs (compressors.base.sparse_mean, DRAGONN's sparse decoding) or
  by densifying every rank's payload into a full tensor and adding those (the dense
  decoding of GRACE-style code). Both write into the same destination and the dense one
  reuses one scratch tensor (allocated once, outside the timing): the comparison is of
  the work, d + K·k against K·d, not of the allocator.
- THC against one fast Walsh–Hadamard transform (FWHT) of the zero-padded vector
  (`fwht_ms` in the floor; `encode_over_fwht`, `decode_over_fwht` per thc cell). With
  THC's default allreduce aggregation, its protocol yields twice (the preliminary
  max-norm round, then the allreduce of the table values), so "encode" is exactly: the
  preliminary norm; the RHT (padded copy with 1/ℓ and the hashed Rademacher signs, the
  FWHT); the clamp and the stochastic rounding (noise hashed in the same pass); the table
  values T[z] to send (and the copy handed to the allreduce, which overwrites it). The
  decode side is all after the last answer: the decompression of the aggregate and of
  the worker's own contribution (error feedback), each an affine map, an FWHT and the
  sign flip. (With aggregation="ps" the parameter server's lookup and sum would run
  between the rounds and count as encode: the bench builds the default.)
- Interleaved rounds: every cell of one tensor size (each compressor at each ratio; each
  decoding of K ranks) is warmed up once, then timed in `repeats` rounds, one call per
  cell a round, the order rotated by one cell each round (A B C, B C A, C A B, ...). A
  slow spell of a shared machine then hits every cell alike instead of a few cells'
  whole samples, and a ratio of two cells (a speed-up over Top-k, dense over batched
  decoding) is taken round by round, so the two numbers of each ratio were measured
  moments apart. Each cell keeps its per-round samples (`encode_samples_ms`, ...).
- Spread: beside each median the 10th and 90th percentiles of the samples (`*_p10_*`,
  `*_p90_*`; `SPREAD_PERCENTILES`) and the minimum: on a shared machine a call
  preempted by another process (with 2 threads on 2 busy cores, a parallel region waits
  a whole scheduler slice, ~4-16 ms) inflates single calls, which the interval shows.
- Bounded run: when the warm-up calls show that `repeats` rounds would take longer than
  `budget_s` per cell, fewer rounds are run (at least one); every cell so capped is
  listed in `capped`.
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import compressors
from compressors.base import check_ratio, index_dtype, sparse_mean, target_k
from compressors.kernels import ops
from compressors.requests import AllGather, AllReduce, Broadcast, as_round
from compressors.session import Session
from repro import sources

# SIDCo Fig. 16–17's compressors (Top-k, DGC, RedSync, GaussianKSGD, the three SIDCo
# variants) with DRAGONN Fig. 5a's and the other linear-time estimator (MSTopK).
# Names that are not registered are left out.
DEFAULT_COMPRESSORS = (
    "topk", "dgc", "redsync", "gaussianksgd", "sidco_e", "sidco_gp", "sidco_p", "mstopk",
    "dragonn",
)
REFERENCE = "topk"
DEFAULT_SIZES = (260_000, 2_600_000, 26_000_000)
DEFAULT_RATIOS = (0.1, 0.01, 0.001)
DEFAULT_DECODE_WORKERS = (2, 4, 8)
QUICK_SIZES = (20_000, 200_000)
QUICK_RATIOS = (0.1, 0.01)
QUICK_DECODE_WORKERS = (2, 4)
QUICK_REPEATS = 3
DEFAULT_REPEATS = 5
DEFAULT_THREADS = 2
DEFAULT_BUDGET_S = 10.0
DEFAULT_SOURCE = "laplace"
TENSOR_NAME = "bench"

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_size(text: str | int) -> int:
    """'260000', '2.6e6', '2.6M', '260k' → an integer element count ≥ 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMgG]?)\s*", str(text))
        if not m:
            raise ValueError(f"size {text!r} is not a number of elements "
                             "(examples: 260000, 2.6e6, 2.6M)")
        number = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if number != int(number):
            raise ValueError(f"size {text!r} is not a whole number of elements")
        value = int(number)
    if value < 1:
        raise ValueError(f"size {text!r} must be ≥ 1 element")
    return value


def split_list(items: Sequence[str] | str | None) -> list[str]:
    """Repeated and/or comma-separated values, in order, without duplicates."""
    if items is None:
        return []
    if isinstance(items, str):
        items = [items]
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


def default_compressors() -> list[str]:
    registered = set(compressors.list_compressors())
    return [n for n in DEFAULT_COMPRESSORS if n in registered]


def resolve_devices(spec: str | Sequence[str] | None) -> list[torch.device]:
    """'auto' (cpu, plus cuda when available), or a comma list of cpu / cuda[:N]."""
    names = split_list(spec) or ["auto"]
    out: list[torch.device] = []
    for name in names:
        if name == "auto":
            cands = [torch.device("cpu")]
            if torch.cuda.is_available():
                cands.append(torch.device("cuda"))
        else:
            try:
                dev = torch.device(name)
            except RuntimeError:
                raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda[:N]") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device {name!r} is not supported; use auto, cpu or cuda[:N]")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device; "
                                 "use --device cpu")
            cands = [dev]
        out += [d for d in cands if d not in out]
    return out


def machine_info(threads: int, devices: Sequence[torch.device]) -> dict[str, Any]:
    """Where the numbers come from: results are meaningless without it."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": threads,
        "devices": [str(d) for d in devices],
    }
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        info["cuda"] = torch.version.cuda
        info["gpu"] = [torch.cuda.get_device_name(d) for d in cuda]
    return info


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def answer_alone(item: Any) -> Any:
    """What a one-rank collective answers: the reduction/broadcast of one tensor is that
    tensor (in place); an allgather is a fresh list holding a copy of it."""
    requests, is_round = as_round(item)
    answers = []
    for r in requests:
        if isinstance(r, AllGather):
            answers.append([r.tensor.clone()])
        elif isinstance(r, (AllReduce, Broadcast)):
            answers.append(r.tensor)
        else:  # pragma: no cover - as_round refuses anything else
            raise TypeError(f"unknown request {type(r).__name__}")
    return tuple(answers) if is_round else answers[0]


def exchange_once(session: Session, x: torch.Tensor, step: int,
                  out: torch.Tensor | None = None) -> tuple[Any, float, float]:
    """Run one single-worker exchange of `x`; (Outcome, encode seconds, decode seconds).
    `out`: where the aggregate may be decoded (Session.exchange). Answering the requests
    (the collective) is not timed."""
    if session.world_size != 1:
        raise ValueError("exchange_once drives a single-worker session (world_size=1)")
    device = x.device
    gen = session.exchange(TENSOR_NAME, x, step, out=out)
    answer: Any = None
    encode = 0.0
    synchronize(device)
    t0 = time.perf_counter()
    while True:
        try:
            item = gen.send(answer)
        except StopIteration as stop:
            synchronize(device)
            return stop.value, encode, time.perf_counter() - t0
        synchronize(device)
        encode += time.perf_counter() - t0
        answer = answer_alone(item)
        synchronize(device)
        t0 = time.perf_counter()


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of `fn`, device work included."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


SPREAD_PERCENTILES = (10, 90)  # the interval reported beside every median


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `samples`, linearly interpolated between the two
    nearest order statistics (numpy's default), without numpy."""
    if not samples:
        raise ValueError("percentile of no samples")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, 10th percentile, 90th percentile) of timing samples."""
    lo_q, hi_q = SPREAD_PERCENTILES
    return (statistics.median(samples), percentile(samples, lo_q), percentile(samples, hi_q))


def interleaved(
    samplers: Sequence[Callable[[], tuple[float, ...]]],
    repeats: int,
    budget_s: float,
) -> tuple[list[list[tuple[float, ...]]], int]:
    """Time several cells in interleaved rounds: one warm-up call of each sampler, then
    `repeats` rounds, each calling every sampler once, the order rotated by one per round
    (A B C, B C A, C A B, ...) so that each cell takes each place in the round alike.
    Fewer rounds (at least one) when the warm-up calls show that `repeats` rounds would
    exceed `budget_s` per sampler. Returns the samples of each sampler, round by round
    (`samples[i][r]` is sampler i's tuple in round r), and the number of rounds."""
    if not samplers:
        return [], 0
    warm = [s() for s in samplers]
    per_round = max(sum(sum(w) for w in warm), 1e-9)  # every component is a timed call
    budget = budget_s * len(samplers)
    n = repeats if per_round * repeats <= budget else max(1, int(budget // per_round))
    samples: list[list[tuple[float, ...]]] = [[] for _ in samplers]
    count = len(samplers)
    for r in range(n):
        for j in range(count):
            i = (r + j) % count
            samples[i].append(samplers[i]())
    return samples, n


def repeat_median(
    sample: Callable[[], tuple[float, ...]],
    repeats: int,
    budget_s: float,
) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """One warm-up call, then up to `repeats` calls; the per-component medians, minima
    (robust to a busy machine preempting a call) and the number of calls used (fewer
    than `repeats` when they would exceed `budget_s`)."""
    (runs,), n = interleaved([sample], repeats, budget_s)
    width = len(runs[0])
    medians = tuple(statistics.median(r[i] for r in runs) for i in range(width))
    minima = tuple(min(r[i] for r in runs) for i in range(width))
    return medians, minima, n


def floor_calibration(numel: int = 2**22, calls: int = 21, threads: int | None = None
                      ) -> dict[str, float]:
    """The one-read-pass floor (`torch.sum` of a precomputed |x|, 16 MB) timed `calls`
    times after a warm-up: its median and its 10th/90th percentiles in ms, and their
    ratio (`spread`, 1.0 on a quiet machine). A quick gauge of how noisy this machine's
    timings are right now, recorded beside a figure's results."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        abs_x = torch.rand(numel)
        (runs,), _ = interleaved([lambda: (timed(lambda: torch.sum(abs_x), abs_x.device),)],
                                 calls, budget_s=float("inf"))
    finally:
        torch.set_num_threads(old)
    med, p10, p90 = spread([1e3 * r[0] for r in runs])
    return {"numel": numel, "calls": len(runs), "floor_ms": med, "floor_p10_ms": p10,
            "floor_p90_ms": p90, "spread": p90 / p10 if p10 > 0 else float("inf"),
            "threads": threads if threads is not None else old}


def sparse_payloads(
    numel: int, k: int, workers: int, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`workers` ranks' k unique indices each (int32/int64 as on the wire, in random
    order, spread over the whole tensor, overlapping partly across ranks) and values."""
    g = torch.Generator().manual_seed(seed)
    stride = max(1, numel // k)
    k = min(k, numel)
    base = torch.arange(k, dtype=torch.int64) * stride
    indices, values = [], []
    for _ in range(workers):
        offsets = torch.randint(0, stride, (k,), generator=g)
        idx = (base + offsets).clamp_(max=numel - 1)[torch.randperm(k, generator=g)]
        indices.append(idx.to(index_dtype(numel)).to(device))
        values.append(torch.randn(k, generator=g).to(device))
    return indices, values


def dense_per_rank_decode(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], numel: int,
    world_size: int, dtype: torch.dtype, out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense decoding: each rank's payload becomes a full dense tensor, then the K dense
    tensors are summed and divided by K (cost grows with K·d). `out` (the destination)
    and `scratch` (one rank's dense tensor): flat buffers of numel reused across calls;
    new ones when None."""
    device = values[0].device
    out = torch.zeros(numel, dtype=dtype, device=device) if out is None else out.zero_()
    dense = torch.empty(numel, dtype=dtype, device=device) if scratch is None else scratch
    for idx, val in zip(indices, values):
        dense.zero_()
        dense.index_copy_(0, idx.long(), val.to(dtype))
        out.add_(dense)
    if world_size > 1:
        out.div_(world_size)
    return out


def batched_decode(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], numel: int,
    world_size: int, dtype: torch.dtype, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """DRAGONN's sparse decoding: all ranks' pairs in one index_add (sparse_mean), into
    `out` (overwritten; a new tensor when None)."""
    return sparse_mean(list(indices), list(values), numel, world_size, dtype, out=out)


def cell_params(name: str, ratio: float | None, x: torch.Tensor,
                 quantiles: dict[float, float]) -> dict[str, Any]:
    """Constructor arguments of one cell. A fixed-threshold sparsifier (a `lam` argument,
    e.g. hard_threshold) gets the λ that keeps δ of this tensor (the k-th largest |x|,
    computed once per ratio, outside the timing): its default λ is tuned for a real
    model's gradient scale and would select a different fraction of the synthetic tensor
    (5.3% for the Laplace source at δ = 0.001), so the cell would time a different k."""
    params: dict[str, Any] = {} if ratio is None else {"ratio": ratio}
    if ratio is not None and "lam" in compressors.default_params(name):
        if ratio not in quantiles:
            k = max(1, target_k(x.numel(), ratio))
            lam = float(x.abs().flatten().kthvalue(x.numel() - k + 1).values)
            quantiles[ratio] = lam if lam > 0 else float("inf")
        if math.isfinite(quantiles[ratio]):
            params["lam"] = quantiles[ratio]
    return params


def accepts_ratio(name: str) -> bool:
    return "ratio" in compressors.default_params(name)


def validate(
    names: Sequence[str], sizes: Sequence[int], ratios: Sequence[float], repeats: int,
    threads: int, budget_s: float, decode_workers: Sequence[int], source: str,
) -> None:
    registered = compressors.list_compressors()
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise ValueError(f"unknown compressor {', '.join(map(repr, unknown))}; "
                         f"registered: {', '.join(registered)}")
    if not names:
        raise ValueError("no compressor to benchmark: name at least one with --compressor")
    if not sizes or not ratios:
        raise ValueError("--sizes and --ratios need at least one value each")
    for what, v in (("--repeats", repeats), ("--threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what}={v!r} must be an integer ≥ 1")
    if not budget_s > 0:
        raise ValueError(f"--budget={budget_s!r} must be > 0 seconds")
    for k in decode_workers:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"--decode-workers: {k!r} must be an integer ≥ 1")
    for r in ratios:
        check_ratio(r, "--ratios value")
    for s in sizes:
        parse_size(s)
    if source not in sources.SYNTHETIC:
        raise ValueError(f"unknown source {source!r}; bench draws synthetic tensors: "
                         f"{', '.join(sources.SYNTHETIC)}")
    # Build every (compressor, ratio) once: a bad combination fails before any timing.
    for n in names:
        for r in (ratios if accepts_ratio(n) else [None]):
            try:
                compressors.build(n, **({} if r is None else {"ratio": r}))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"compressor {n!r}: {exc}") from None


def run_bench(
    compressor_names: Sequence[str] | str | None = None,
    sizes: Sequence[int | str] | None = None,
    ratios: Sequence[float] | None = None,
    repeats: int = DEFAULT_REPEATS,
    threads: int = DEFAULT_THREADS,
    devices: str | Sequence[str] | None = "auto",
    source: str = DEFAULT_SOURCE,
    seed: int = 0,
    budget_s: float = DEFAULT_BUDGET_S,
    decode_workers: Sequence[int] = DEFAULT_DECODE_WORKERS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; a JSON-ready dict with machine, config, floor, encode, decode
    and capped sections (see the module docstring)."""
    names = split_list(compressor_names) or default_compressors()
    sizes = [parse_size(s) for s in (sizes or DEFAULT_SIZES)]
    ratios = [float(r) for r in (ratios or DEFAULT_RATIOS)]
    decode_workers = list(decode_workers)
    validate(names, sizes, ratios, repeats, threads, budget_s, decode_workers, source)
    devs = resolve_devices(devices)
    if REFERENCE in compressors.list_compressors():
        # The reference every speed-up is relative to: always measured, and first.
        names = [REFERENCE, *(n for n in names if n != REFERENCE)]

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    report: dict[str, Any] = {
        "machine": machine_info(threads, devs),
        "config": {
            "compressors": names, "sizes": sizes, "ratios": ratios, "repeats": repeats,
            "threads": threads, "devices": [str(d) for d in devs], "source": source,
            "seed": seed, "budget_s": budget_s, "decode_workers": decode_workers,
        },
        "floor": [], "encode": [], "decode": [], "capped": [],
    }
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    try:
        for dev in devs:
            for size in sizes:
                say(f"bench: {dev}, d = {size:,}")
                x = sources.synthetic(source, size, 1, seed, 0)[0].to(dev)
                _bench_size(report, names, ratios, repeats, budget_s, decode_workers, x, seed)
                del x
    finally:
        torch.set_num_threads(old_threads)
    report["elapsed_s"] = time.perf_counter() - started
    return report


def _ms_stats(prefix: str, samples_s: Sequence[float]) -> dict[str, Any]:
    """median / 10th / 90th percentile / minimum (ms) of one timed component."""
    med, p10, p90 = spread(samples_s)
    return {f"{prefix}_ms": 1e3 * med, f"{prefix}_p10_ms": 1e3 * p10,
            f"{prefix}_p90_ms": 1e3 * p90, f"{prefix}_min_ms": 1e3 * min(samples_s)}


def _ratio_stats(prefix: str, num: Sequence[float], den: Sequence[float]) -> dict[str, Any]:
    """The round-by-round ratio num[r] / den[r] of two interleaved cells: median and
    10th / 90th percentiles (None where a denominator is 0)."""
    ratios = [a / b for a, b in zip(num, den) if b > 0]
    if not ratios:
        return {prefix: None, f"{prefix}_p10": None, f"{prefix}_p90": None}
    med, p10, p90 = spread(ratios)
    return {prefix: med, f"{prefix}_p10": p10, f"{prefix}_p90": p90}


def _bench_size(report, names, ratios, repeats, budget_s, decode_workers, x, seed) -> None:
    dev, size = x.device, x.numel()
    held = {"abs": x.abs()}  # |x| for the floor, released once the rounds are done
    (sum_s, l1_s), (sum_min, l1_min), _ = repeat_median(
        lambda: (timed(lambda: torch.sum(held["abs"]), dev),
                 timed(lambda: torch.linalg.vector_norm(x, 1), dev)),
        max(3 * repeats, 15), budget_s)  # sub-millisecond: more samples
    floor = {"device": str(dev), "numel": size, "sum_abs_ms": 1e3 * sum_s,
             "l1_norm_ms": 1e3 * l1_s, "sum_abs_min_ms": 1e3 * sum_min,
             "l1_norm_min_ms": 1e3 * l1_min}
    if "thc" in names or "thc_uniform" in names:
        # THC's reference: one fast Walsh–Hadamard transform of the padded vector.
        from compressors.thc import fwht_, next_power_of_two

        padded = torch.zeros(next_power_of_two(size), dtype=torch.float32, device=dev)
        (fwht_s,), (fwht_min,), _ = repeat_median(
            lambda: (timed(lambda: fwht_(padded, normalize=False), dev),), repeats, budget_s)
        floor.update(fwht_ms=1e3 * fwht_s, fwht_min_ms=1e3 * fwht_min,
                     fwht_numel=padded.numel())
        del padded
    floor["native_kernels"] = ops.supports(x)
    report["floor"].append(floor)

    def cap_note(what: str, n: int) -> None:
        if n < repeats:
            report["capped"].append(
                f"{what} on {dev}, d = {size:,}: {n} repeat(s) instead of {repeats} "
                f"(one call × {repeats} would exceed the {budget_s:g} s budget)")

    # The destination every decode writes into (the gradient, in a DDP hook), and the
    # dense per-rank decoding's scratch: allocated once per size.
    dest = torch.empty_like(x)
    scratch = torch.empty_like(x) if decode_workers else None
    quantiles: dict[float, float] = {}
    cells: list[dict[str, Any]] = []
    for name in names:
        for ratio in (ratios if accepts_ratio(name) else [None]):
            params = cell_params(name, ratio, x, quantiles)
            session = Session(compressors.build(name, **params), rank=0, world_size=1,
                              feedback="none", seed=seed, check_finite=False, measure=False)
            cells.append({"name": name, "ratio": ratio, "params": params, "session": session,
                          "step": 0, "outcome": None})

    def encode_sampler(cell: dict[str, Any]) -> Callable[[], tuple[float, float]]:
        def sample() -> tuple[float, float]:
            outcome, enc, dec = exchange_once(cell["session"], x, cell["step"], out=dest)
            cell["step"] += 1
            cell["outcome"] = outcome
            return enc, dec
        return sample

    # The floor (one read pass) is a cell of the rounds too, so that every encode time
    # has a floor time taken in the same round.
    samplers = [lambda: (timed(lambda: torch.sum(held["abs"]), dev), 0.0)]
    samplers += [encode_sampler(c) for c in cells]
    samples, n = interleaved(samplers, repeats, budget_s)
    held.clear()
    floor_round = [r[0] for r in samples[0]]
    floor.update(_ms_stats("sum_abs_rounds", floor_round))
    reference = {c["ratio"]: [r[0] for r in s]
                 for c, s in zip(cells, samples[1:]) if c["name"] == REFERENCE}
    for cell, cell_samples in zip(cells, samples[1:]):
        name, ratio, params = cell["name"], cell["ratio"], cell["params"]
        enc_s = [r[0] for r in cell_samples]
        dec_s = [r[1] for r in cell_samples]
        enc, dec = statistics.median(enc_s), statistics.median(dec_s)
        cap_note(f"{name} ratio {ratio}", n)
        ref = reference.get(ratio) if ratio is not None else None
        ref_med = statistics.median(ref) if ref else None
        outcome = cell["outcome"]
        selected = outcome.selected
        probes = outcome.extra.get("probes")
        fwht = floor.get("fwht_ms")
        entry = {
            "device": str(dev), "numel": size, "compressor": name, "ratio": ratio,
            "k": target_k(size, ratio) if ratio is not None else None,
            "k_hat": int(selected) if selected is not None else None,
            "params": {k: v for k, v in params.items() if k != "ratio"} or None,
            "repeats": n,
            **_ms_stats("encode", enc_s), **_ms_stats("decode", dec_s),
            "encode_over_floor": enc / sum_s if sum_s > 0 else None,
            "encode_over_l1": enc / l1_s if l1_s > 0 else None,
            "encode_over_topk": enc / ref_med if ref_med else None,
        }
        entry.update(_ratio_stats("speedup_over_topk", ref, enc_s) if ref
                     else {"speedup_over_topk": None, "speedup_over_topk_p10": None,
                           "speedup_over_topk_p90": None})
        entry.update(_ratio_stats("encode_over_floor_rounds", enc_s, floor_round))
        entry.update({
            # RedSync: the goal is per iteration of its threshold search.
            "probes": probes,
            "encode_per_probe_over_floor": (enc / probes / sum_s
                                            if probes and sum_s > 0 else None),
            "encode_over_fwht": (1e3 * enc / fwht
                                 if fwht and name.startswith("thc") else None),
            "decode_over_fwht": (1e3 * dec / fwht
                                 if fwht and name.startswith("thc") else None),
            "encode_samples_ms": [1e3 * t for t in enc_s],
        })
        report["encode"].append(entry)
    del cells, samplers

    decode_cells = []
    for ratio in ratios:
        k = target_k(size, ratio)
        for workers in decode_workers:
            idx, val = sparse_payloads(size, k, workers, seed=seed, device=dev)
            decode_cells.append((ratio, k, workers, (idx, val, size, workers, x.dtype)))

    def decode_sampler(args) -> Callable[[], tuple[float, float]]:
        return lambda: (timed(lambda: batched_decode(*args, out=dest), dev),
                        timed(lambda: dense_per_rank_decode(*args, out=dest, scratch=scratch),
                              dev))

    samples, n = interleaved([decode_sampler(c[3]) for c in decode_cells], repeats, budget_s)
    for (ratio, k, workers, _), cell_samples in zip(decode_cells, samples):
        batched = [r[0] for r in cell_samples]
        dense = [r[1] for r in cell_samples]
        cap_note(f"decoding K={workers} ratio {ratio}", n)
        entry = {"device": str(dev), "numel": size, "ratio": ratio, "k": k, "workers": workers,
                 **_ms_stats("batched", batched), **_ms_stats("dense_per_rank", dense),
                 **_ratio_stats("dense_over_batched", dense, batched), "repeats": n,
                 "batched_samples_ms": [1e3 * t for t in batched],
                 "dense_per_rank_samples_ms": [1e3 * t for t in dense]}
        report["decode"].append(entry)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _table(cols: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(cols), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_report(report: dict[str, Any]) -> str:
    """The report as text: per device and size, the floor, then the encode table; then
    the decoding comparison and what was capped."""
    m = report["machine"]
    out = [f"{m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}, {m['threads']} threads"
           + (f", GPU {', '.join(m['gpu'])}" if m.get("gpu") else "")]
    for floor in report["floor"]:
        dev, size = floor["device"], floor["numel"]
        out += ["", f"{dev}, d = {size:,}: floor sum(|x|) {floor['sum_abs_ms']:.3f} ms "
                    f"(min {floor['sum_abs_min_ms']:.3f}), ||x||_1 {floor['l1_norm_ms']:.3f} ms "
                    f"(min {floor['l1_norm_min_ms']:.3f})"]
        rows = [[e["compressor"], _fmt(e["ratio"], "g"), _fmt(e["k_hat"], "d"),
                 f"{e['encode_ms']:.3f}", f"{e['encode_min_ms']:.3f}", f"{e['decode_ms']:.3f}",
                 _fmt(e["encode_over_floor"], ".1f"), _fmt(e["encode_over_topk"], ".3f"),
                 _fmt(e["speedup_over_topk"], ".2f"), str(e["repeats"])]
                for e in report["encode"] if e["device"] == dev and e["numel"] == size]
        out += _table(["compressor", "ratio", "k̂", "enc ms", "enc min", "dec ms", "enc/floor",
                       "enc/topk", "speed-up", "n"], rows)
        if floor.get("fwht_ms"):
            out.append(f"one FWHT of {floor['fwht_numel']:,} floats: {floor['fwht_ms']:.3f} ms "
                       f"(min {floor['fwht_min_ms']:.3f})")
            for e in report["encode"]:
                if (e["device"] == dev and e["numel"] == size
                        and e.get("encode_over_fwht") is not None):
                    out.append(f"  {e['compressor']}: encode {e['encode_ms']:.3f} ms = "
                               f"{e['encode_over_fwht']:.2f} x one FWHT; decode "
                               f"{e['decode_ms']:.3f} ms = {e['decode_over_fwht']:.2f} x")
    if report["decode"]:
        out += ["", "decoding K ranks' sparse payloads: batched (one index_add) vs dense per rank"]
        rows = [[d["device"], f"{d['numel']:,}", f"{d['ratio']:g}", str(d["workers"]),
                 f"{d['batched_ms']:.3f}", f"{d['dense_per_rank_ms']:.3f}",
                 _fmt(d["dense_over_batched"], ".1f")] for d in report["decode"]]
        out += _table(["device", "d", "ratio", "K", "batched ms", "dense ms", "dense/batched"],
                      rows)
    if report["capped"]:
        out += ["", "capped:", *(f"  {c}" for c in report["capped"])]
    out += ["", f"medians of {report['config']['repeats']} interleaved rounds after a warm-up "
                "(min: fastest call); encode excludes error feedback; enc/floor: over one read "
                "pass sum(|x|); speed-up: topk / enc, round by round",
            f"elapsed {report['elapsed_s']:.1f} s"]
    return "\n".join(out)
