"""SIDCo (Abdelmoniem et al., MLSys 2021) figures: Fig. 1 (speed-up over Top-k and
estimation quality on VGG-16 gradients), Fig. 3 (LSTM-PTB: speed-up, throughput,
estimation quality per ratio), Fig. 5 (ResNet-20 / VGG-16), Fig. 9 (smoothed compression
ratio over training) and Fig. 16 (compression latency on synthetic tensors).

The paper ran on 8 machines with one V100 each and 10 Gbps NICs (compression on the GPU,
and on the CPU for Figs. 1(b), 16(e–h)). Here compression is timed on this CPU, and the
training figures run simulated workers on stand-in data with their communication projected
onto 8 workers at 10 Gbps (repro/runs.py says how).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from repro import bench, measure
from repro.figures.base import Context
from repro.figures.common import (
    COLOURS,
    TIMING_REPEATS,
    Spread,
    bench_cpu_note,
    claim_row,
    compressor_overrides,
    errorbars,
    fmt_size,
    highest,
    label,
    link_note,
    link_runs,
    lowest,
    measured_split_text,
    measured_throughput_ratio,
    not_measured_row,
    paired,
    param_count,
    projection_rows,
    pyplot,
    records_as_rows,
    smooth,
    timing_ratio,
    train_grid,
)
from repro.figures.registry import figure
from repro.figures.verdicts import Row, all_of, side
from repro.runs import Run

PAPER_HW = ("8 machines × 1 NVIDIA V100-16GB (2 × 16-core Xeon 4112), 10 Gbps NICs, "
            "PyTorch 1.1, Horovod 0.16.4; compression on GPU, and on CPU for the CPU panels")
RATIOS = (0.1, 0.01, 0.001)
ESTIMATORS = ("dgc", "redsync", "gaussianksgd", "sidco_e", "sidco_gp", "sidco_p")
SPEED_SET = ("topk", *ESTIMATORS)
QUALITY_BAND = (0.8, 1.2)  # SIDCo's ε_L = ε_H = 20%
CPU = "this 2-core CPU, shared"
# Why a CPU timing would not rank the methods as the paper's CPU panels do.
DGC_FUSED = ("hardware: DGC's sampling and threshold are one fused pass here (a C++ kernel "
             "reads a counter-based sample in place, numpy's introselect picks the threshold), "
             "where the paper's PyTorch 1.1 drew random positions and gathered them, which made "
             "DGC the slowest method on its CPU")
CPU_KERNELS = ("hardware: timed on this CPU with this torch; the paper's CPU panels ran "
               "PyTorch 1.1 on a Xeon 4112, and the ranking rests on each library's top-k and "
               "sampling kernels")


def _band(x: float | None) -> bool | None:
    return None if x is None else QUALITY_BAND[0] <= x <= QUALITY_BAND[1]


# -- Fig. 16: latency / speed-up on synthetic tensors --------------------------------------


def _mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


BIG = 260_000_000
PAPER_SMALLEST = 260_000  # the smallest tensor of the paper's Fig. 16
# The 260M tensor, its |x|, Top-k's and the decode destination's copies: ~6 GB at least,
# more while the synthetic draw's float64 temporaries live. Run only when asked
# (GRADCOMP_BIG_TENSORS=1) and when the memory is there: the default set keeps its peak
# memory under 4 GB.
BIG_MEMORY_GIB = 12.0
BIG_ENV = "GRADCOMP_BIG_TENSORS"


def _cell_speedup(cell) -> Spread:
    """A bench cell's speed-up over Top-k, round by round (median, 10th–90th pct.)."""
    return Spread(cell["speedup_over_topk"], cell["speedup_over_topk_p10"],
                  cell["speedup_over_topk_p90"], cell["repeats"])


@figure(
    id="sidco-fig16", paper="sidco",
    title="Compression speed-up over Top-k on synthetic tensors of 0.26M–26M elements "
          "(260M on request), CPU-measured in interleaved rounds",
    kind="benchmark", hardware=PAPER_HW,
    expected="on the CPU, threshold estimators (SIDCo) are faster than Top-k and DGC, and DGC is "
             "the slowest (Top-k beats it); SIDCo improves over DGC by ≥ 2× on GPU and more on CPU",
    est_seconds={"smoke": 4, "full": 90},
)
def fig16(ctx: Context) -> list[Row]:
    names = ["dgc", "redsync", "gaussianksgd", "sidco_e", "sidco_gp", "sidco_p"]
    if ctx.smoke:
        sizes, ratios, repeats = [26_000, 260_000], [0.01, 0.001], 3
    else:
        sizes, ratios, repeats = [260_000, 2_600_000, 26_000_000], list(RATIOS), 7
    report = bench.run_bench(names, sizes=sizes, ratios=ratios, repeats=repeats, devices="cpu",
                             decode_workers=[], budget_s=4.0, progress=ctx.say)
    big_note = None
    encode = list(report["encode"])
    if not ctx.smoke:
        avail = _mem_available_gib()
        if os.environ.get(BIG_ENV) != "1":
            big_note = (f"260M not run: it needs about {BIG_MEMORY_GIB:g} GiB (set {BIG_ENV}=1 "
                        "to run it: δ=0.001, Top-k/DGC/SIDCo-E, 3 rounds)")
        elif avail >= BIG_MEMORY_GIB:
            big = bench.run_bench(["dgc", "sidco_e"], sizes=[BIG], ratios=[0.001], repeats=3,
                                  devices="cpu", decode_workers=[], budget_s=4.0,
                                  progress=ctx.say)
            encode += big["encode"]
            big_note = "260M: δ=0.001, Top-k/DGC/SIDCo-E only, 3 interleaved rounds"
        else:
            big_note = (f"260M not run: {avail:.1f} GiB available, {BIG_MEMORY_GIB:g} GiB needed")
        ctx.say(big_note)
    ctx.write_csv("latency", [
        {k: e[k] for k in ("numel", "compressor", "ratio", "k", "k_hat", "encode_ms",
                           "encode_p10_ms", "encode_p90_ms", "encode_min_ms", "decode_ms",
                           "speedup_over_topk", "speedup_over_topk_p10",
                           "speedup_over_topk_p90", "encode_over_floor", "repeats")}
        for e in encode])
    all_sizes = sorted({e["numel"] for e in encode})
    cells = {(e["compressor"], e["numel"], e["ratio"]): e for e in encode}

    plt = pyplot()
    fig, axes = plt.subplots(1, len(all_sizes), figsize=(4.2 * len(all_sizes), 4), sharey=True)
    axes = np.atleast_1d(axes)
    width = 0.8 / (len(names) + 1)
    for ax, s in zip(axes, all_sizes):
        for j, n in enumerate(["topk", *names]):
            sp = [_cell_speedup(cells[(n, s, r)]) if (n, s, r) in cells else None for r in ratios]
            ax.bar(np.arange(len(ratios)) + j * width,
                   [np.nan if x is None else x.median for x in sp], width, color=COLOURS[n],
                   label=label(n), yerr=errorbars(sp), capsize=2, ecolor="0.3")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(ratios)) + 0.4 - width / 2, [f"{r:g}" for r in ratios])
        ax.set_xlabel("ratio δ")
        ax.set_yscale("log")
        ax.set_title(f"{fmt_size(s)} elements ({4 * s / 1e6:.3g} MB)")
    axes[0].set_ylabel("speed-up over Top-k (×; median, 10–90% over rounds)")
    axes[0].legend(fontsize=7)
    title = (f"SIDCo Fig. 16(e–h) on this CPU ({bench_cpu_note(report)}), Laplace tensors, "
             f"{repeats} interleaved rounds")
    if big_note:
        title += f"\n{big_note}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    ctx.save_plot(fig)

    rows = []
    for s in all_sizes:
        rs = [r for r in ratios if ("sidco_e", s, r) in cells]
        sp_e = lowest(_cell_speedup(cells[("sidco_e", s, r)]) for r in rs)
        sp_dgc = highest(_cell_speedup(cells[("dgc", s, r)]) for r in rs)
        e_over_dgc = lowest(paired(cells[("dgc", s, r)]["encode_samples_ms"],
                                   cells[("sidco_e", s, r)]["encode_samples_ms"]) for r in rs)
        setting = f"{fmt_size(s)} elements, δ ∈ {{{', '.join(f'{r:g}' for r in rs)}}}, CPU"
        rows.append(claim_row(
            setting, "SIDCo-E speed-up over Top-k (min over δ)",
            ctx.reference_value("synthetic tensors, CPU", "SIDCo-E speed-up over Top-k (lower bound)"),
            sp_e.median, None, "SIDCo-E compresses faster than Top-k on the CPU", CPU, "×",
            interval=sp_e.interval, threshold=1.0, op=">",
            cause=CPU_KERNELS if s >= PAPER_SMALLEST else
            f"scale: {fmt_size(s)} elements, below the paper's smallest tensor (0.26M), where "
            "SIDCo-E's fixed costs per call weigh against a quick torch.topk"))
        rows.append(claim_row(
            setting, "DGC speed-up over Top-k (max over δ)",
            ctx.reference_value("synthetic tensors, CPU", "DGC speed-up over Top-k (upper bound)"),
            sp_dgc.median, None,
            "on the CPU DGC is the slowest and Top-k beats it (random sampling is slow on CPU)",
            CPU + "; torch's CPU sampling and top-k differ from PyTorch 1.1's", "×",
            interval=sp_dgc.interval, threshold=1.0, op="<", cause=DGC_FUSED))
        rows.append(claim_row(
            setting, "SIDCo-E speed-up over DGC (min over δ)",
            ctx.reference_value("synthetic tensors, CPU", "SIDCo-E speed-up over DGC (lower bound)"),
            e_over_dgc.median, None,
            "SIDCo improves over DGC by at least 2× (GPU), more on the CPU", CPU, "×",
            interval=e_over_dgc.interval, threshold=2.0, op=">=", cause=DGC_FUSED))
    if big_note and "not run" in big_note:
        rows.append(claim_row("260M elements", "SIDCo-E speed-up over Top-k", None, None, None,
                              "SIDCo-E compresses faster than Top-k on the CPU", big_note,
                              "×", rule_name="not run"))
    return rows


# -- Fig. 1: VGG-16 gradients --------------------------------------------------------------


def vgg16_gradients(ctx: Context, workers: int, folder: str) -> str:
    """Real gradients of the tasks' VGG-16 (paper size: 14.7M parameters in the full
    variant) on stand-in images, one batch per worker, flattened over all layers and saved
    as a list of per-worker tensors in `folder` (a temporary folder: 118 MB that the
    figure needs only while it runs). Returns the file's path."""
    import tasks

    size = "smoke" if ctx.smoke else "paper"
    path = os.path.join(folder, f"vgg16_{size}_grads_w{workers}.pt")
    task = tasks.build_task("cifar10_vgg16", size=size, data="standin", batch_size=8, seed=0)
    model = task.build_model()
    grads = []
    for rank in range(workers):
        batch = next(iter(task.train_batches(rank, workers, 0)))
        model.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    from repro.checkpoints import save

    save(grads, path)
    ctx.say(f"computed {workers} VGG-16 gradients of {grads[0].numel():,} elements")
    return path


def _time_on_tensor(names, ratios, x: torch.Tensor, repeats: int, budget_s: float):
    """bench's single-worker timing on a given tensor, every (name, ratio) cell in the
    same interleaved rounds (repro.bench.interleaved): {(name, ratio): (encode seconds
    per round, k_hat)}."""
    import compressors
    from compressors.session import Session

    cells = []
    for n in names:
        for r in ratios:
            session = Session(compressors.build(n, ratio=r), rank=0, world_size=1, feedback="none",
                              seed=0, check_finite=False, measure=False)
            cells.append({"key": (n, r), "session": session, "step": 0, "outcome": None})

    def sampler(cell):
        def sample():
            outcome, enc, dec = bench.exchange_once(cell["session"], x, cell["step"])
            cell["step"] += 1
            cell["outcome"] = outcome
            return enc, dec
        return sample

    samples, _ = bench.interleaved([sampler(c) for c in cells], repeats, budget_s)
    out = {}
    for cell, s in zip(cells, samples):
        sel = cell["outcome"].selected
        out[cell["key"]] = ([r[0] for r in s], int(sel) if sel is not None else None)
    return out


@figure(
    id="sidco-fig1", paper="sidco",
    title="Speed-up over Top-k (CPU, interleaved rounds) and estimation quality k̂/k on real "
          "VGG-16 gradients (stand-in data: Fashion-MNIST)",
    kind="benchmark", hardware=PAPER_HW,
    expected="on the CPU DGC is slower than Top-k while threshold estimators are faster than both; "
             "SIDCo's k̂/k ≈ 1 while RedSync and GaussianKSGD miss the target",
    est_seconds={"smoke": 5, "full": 150},
)
def fig1(ctx: Context) -> list[Row]:
    import tempfile

    workers = 2
    ratios = [0.01] if ctx.smoke else list(RATIOS)
    steps = 2 if ctx.smoke else 6  # SIDCo adapts its stage count after Q = 5 steps
    speed_set = ("topk", "dgc", "sidco_e") if ctx.smoke else SPEED_SET
    estimators = ("dgc", "redsync", "sidco_e") if ctx.smoke else ESTIMATORS
    rounds = 3 if ctx.smoke else 7
    quality = {}
    with tempfile.TemporaryDirectory(prefix="sidco-fig1-") as tmp:
        path = vgg16_gradients(ctx, workers, tmp)
        grads = torch.load(path, weights_only=True)
        x = grads[0]
        del grads
        old = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            timing = _time_on_tensor(speed_set, ratios, x, rounds, 4.0)
        finally:
            torch.set_num_threads(old)
        for r in ratios:
            for res in measure.measure(list(estimators), ratio=r, workers=workers, steps=steps,
                                       source=f"file:{path}"):
                quality[(res["compressor"], r)] = res
    numel = x.numel()
    del x
    speed = {(n, r): paired(timing[("topk", r)][0], enc) for (n, r), (enc, _) in timing.items()}
    data = []
    for (n, r), (enc, k_hat) in timing.items():
        q = quality.get((n, r), {})
        e = Spread.of(enc)
        data.append({"numel": numel, "compressor": n, "ratio": r, "encode_ms": 1e3 * e.median,
                     "encode_p10_ms": 1e3 * e.lo, "encode_p90_ms": 1e3 * e.hi,
                     "speedup_over_topk": speed[(n, r)].median,
                     "speedup_over_topk_p10": speed[(n, r)].lo,
                     "speedup_over_topk_p90": speed[(n, r)].hi, "rounds": e.n,
                     "k_hat_single": k_hat,
                     "k_ratio_mean": q.get("k_ratio_mean", 1.0 if n == "topk" else None),
                     "k_ratio_p5": q.get("k_ratio_p5"), "k_ratio_p95": q.get("k_ratio_p95"),
                     "workers": workers, "steps": steps})
    ctx.write_csv("vgg16_speedup_quality", data)

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(speed_set)
    for j, n in enumerate(speed_set):
        sp = [speed[(n, r)] for r in ratios]
        ax.bar(np.arange(len(ratios)) + j * width, [v.median for v in sp], width,
               color=COLOURS[n], label=label(n), yerr=errorbars(sp), capsize=2, ecolor="0.3")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(ratios)) + 0.4 - width / 2, [f"{r:g}" for r in ratios])
    ax.set_xlabel("ratio δ")
    ax.set_ylabel("speed-up over Top-k (×; median, 10–90% over rounds)")
    ax.set_title(f"(b) compression on this CPU, d = {numel:,}, {rounds} interleaved rounds")
    ax.legend(fontsize=7)
    width = 0.8 / len(estimators)
    for j, n in enumerate(estimators):
        m = np.array([quality[(n, r)]["k_ratio_mean"] for r in ratios])
        lo = m - np.array([quality[(n, r)]["k_ratio_p5"] for r in ratios])
        hi = np.array([quality[(n, r)]["k_ratio_p95"] for r in ratios]) - m
        ax2.bar(np.arange(len(ratios)) + j * width, m, width, yerr=[lo, hi], color=COLOURS[n],
                label=label(n), capsize=2)
    ax2.axhline(1, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_xticks(np.arange(len(ratios)) + 0.4 - width / 2, [f"{r:g}" for r in ratios])
    ax2.set_xlabel("ratio δ")
    ax2.set_ylabel("estimation quality k̂/k (mean, 5–95%)")
    ax2.set_title(f"(c) {workers} simulated workers × {steps} steps, error feedback")
    ax2.legend(fontsize=7)
    fig.suptitle("SIDCo Fig. 1 on real VGG-16 gradients (Fashion-MNIST stand-in for CIFAR-10, "
                 "batch 8, untrained), CPU-measured; paper: V100 + Xeon", fontsize=9)
    ctx.save_plot(fig)

    rows = []
    caveat = CPU + f"; real VGG-16 gradients of {numel:,} elements on stand-in data"
    few = (f"scale: {workers} simulated workers × {steps} steps from one untrained VGG-16 "
           f"gradient ({numel:,} elements) on stand-in data; the paper's k̂/k spans training")
    dgc = highest(speed[("dgc", r)] for r in ratios)
    rows.append(claim_row(
        "VGG-16 gradients, CPU, all δ", "DGC speed-up over Top-k (max over δ)",
        ctx.reference_value("VGG-16, CPU", "DGC speed-up over Top-k (upper bound)"),
        dgc.median, None, "DGC performs significantly worse than Top-k on the CPU (Fig. 1(b))",
        caveat, "×", interval=dgc.interval, threshold=1.0, op="<", cause=DGC_FUSED))
    for n in [v for v in ("sidco_e", "sidco_gp", "sidco_p") if v in speed_set]:
        sp = lowest(speed[(n, r)] for r in ratios)
        rows.append(claim_row(
            "VGG-16 gradients, CPU, all δ", f"{label(n)} speed-up over Top-k (min over δ)",
            ctx.reference_value("VGG-16, CPU", "SIDCo speed-up over Top-k (lower bound)"),
            sp.median, None,
            "threshold estimators impose lower compression overhead than Top-k on CPU", caveat,
            "×", interval=sp.interval, threshold=1.0, op=">", cause=CPU_KERNELS))
    over_dgc = lowest(paired(timing[("dgc", r)][0], timing[("sidco_e", r)][0]) for r in ratios)
    rows.append(claim_row(
        "VGG-16 gradients, CPU, all δ", "SIDCo-E speed-up over DGC (min over δ)",
        ctx.reference_value("VGG-16, CPU", "SIDCo-E speed-up over DGC (lower bound)"),
        over_dgc.median, None,
        "SIDCo improves over DGC by at least 2× on GPU and more on the CPU", caveat, "×",
        interval=over_dgc.interval, threshold=2.0, op=">=", cause=DGC_FUSED))
    for r in ratios:
        for n in [v for v in ("sidco_e", "sidco_gp", "sidco_p", "dgc") if v in estimators]:
            km = quality[(n, r)]["k_ratio_mean"]
            rows.append(claim_row(
                f"VGG-16 gradients, δ={r:g}", f"{label(n)} mean k̂/k",
                ctx.reference_value("VGG-16", "mean k̂/k of SIDCo and DGC"), km, _band(km),
                f"k̂/k ≈ 1 (checked: within [{QUALITY_BAND[0]}, {QUALITY_BAND[1]}], SIDCo's ε = 20%)",
                f"{workers} workers × {steps} steps on one gradient pair", "", cause=few))
    heur = {n: [quality[(n, r)]["k_ratio_mean"] for r in ratios]
            for n in ("redsync", "gaussianksgd") if n in estimators}
    for n, ks in heur.items():
        off = [k for k in ks if not _band(k)]
        rows.append(claim_row(
            f"VGG-16 gradients, δ ∈ {{{', '.join(f'{r:g}' for r in ratios)}}}",
            f"{label(n)} worst k̂/k", None, max(ks, key=lambda k: abs(np.log(k))) if ks else None,
            bool(off), "the heuristic estimators fail to obtain the right threshold (k̂/k outside "
            f"[{QUALITY_BAND[0]}, {QUALITY_BAND[1]}] at some δ)", "", "", cause=few))
    return rows


# -- training figures: Fig. 3 (LSTM-PTB), Fig. 5 (ResNet-20, VGG-16), Fig. 9 ---------------


def _grid(ctx: Context, task: str, compressors_, ratios, baseline: bool = True,
          extra: tuple[str, ...] = (), timed: bool = True
          ) -> dict[tuple[str, float | None], Run]:
    """The figure's runs by (compressor, ratio); `timed`: the figure compares their step
    times, so each is trained TIMING_REPEATS times (train_grid)."""
    specs = []
    if baseline:
        specs.append([f"task={task}", *compressor_overrides("none", None), *extra])
    for n in compressors_:
        for r in ratios:
            specs.append([f"task={task}", *compressor_overrides(n, r), *extra])
    if ctx.smoke:
        specs = [[*s, "steps=2", "eval_batches=1"] for s in specs]
    runs = train_grid(ctx, specs, repeats=TIMING_REPEATS if timed else 1)
    return {(r.compressor, r.ratio): r for r in runs}


TRAIN_CAVEAT = ("{n} simulated workers on stand-in data, smoke-size model ({p:,} parameters) "
                "trained {s} steps; communication projected onto 8 workers at 10 Gbps from the "
                "bytes sent, compute and compression measured on this CPU")


def _caveat(runs: dict, params: int) -> str:
    r = next(iter(runs.values()))
    return TRAIN_CAVEAT.format(n=r.workers, p=params, s=r.steps)


def _small(runs: dict, params: int) -> str:
    """What is small in a training figure's runs, for a cause's specifics."""
    r = next(iter(runs.values()))
    return (f"a smoke-size model ({params:,} parameters) trained {r.steps} steps with "
            f"{r.workers} simulated workers")


def _params(task: str) -> int:
    return param_count(task)


def quality_per_time(run: Run) -> float | None:
    """SIDCo's "normalized training speed-up" numerator: model quality at the end of
    training over the (projected) time to get there; quality is accuracy, or 1/perplexity
    for language models (lower is better)."""
    final, step_s = run.final_eval, run.projection().step_s
    if final is None or step_s is None:
        return None
    quality = final if run.higher_is_better else 1.0 / final
    return quality / (run.steps * step_s)


def _k_ratios(run: Run) -> list[float]:
    """The run's k̂/k, one per step."""
    return run.series("estimation_quality")[1]


def _speedup(runs, r, who: str, base: str) -> Spread | None:
    """who's quality_per_time over base's at ratio r, with the interval of its timing
    part (a bootstrap of both runs' projected step times)."""
    a, b = runs[(who, r)], runs[(base, None if base == "none" else r)]
    qa, qb = quality_per_time(a), quality_per_time(b)
    if not qa or not qb:
        return None
    return timing_ratio(qa / qb, b, a)


def _speedups(runs, ratios, who: str, base: str) -> list[Spread | None]:
    return [_speedup(runs, r, who, base) for r in ratios]


def _throughput(runs, r, who: str, base: str = "none") -> Spread | None:
    """who's projected samples/s over base's, with the interval of the timing part."""
    a, b = runs[(who, r)], runs[(base, None if base == "none" else r)]
    ta, tb = a.projection().samples_per_s, b.projection().samples_per_s
    if not ta or not tb:
        return None
    return timing_ratio(ta / tb, b, a)


def _bars(ax, runs, ratios, names, value, ylabel, title, log=False):
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        ys = [value(n, r) for r in ratios]
        ax.bar(np.arange(len(ratios)) + j * width, [np.nan if y is None else y.median for y in ys],
               width, color=COLOURS[n], label=label(n), yerr=errorbars(ys), capsize=2,
               ecolor="0.3")
    ax.set_xticks(np.arange(len(ratios)) + 0.4 - width / 2, [f"{r:g}" for r in ratios])
    ax.set_xlabel("ratio δ")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.axhline(1, color="k", lw=0.8)
    if log:
        ax.set_yscale("log")


def _quality_bars(ax, runs, ratios, names, title):
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        st = [runs[(n, r)].k_ratio_stats() for r in ratios]
        m = np.array([s[0] for s in st])
        ax.bar(np.arange(len(ratios)) + j * width, m, width, color=COLOURS[n], label=label(n),
               yerr=[m - np.array([s[1] for s in st]), np.array([s[2] for s in st]) - m], capsize=2)
    ax.set_xticks(np.arange(len(ratios)) + 0.4 - width / 2, [f"{r:g}" for r in ratios])
    ax.set_yscale("log")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xlabel("ratio δ")
    ax.set_ylabel("estimation quality k̂/k (mean, 5–95%)")
    ax.set_title(title, fontsize=9)


PAPER_SET = ("topk", "dgc", "redsync", "gaussianksgd", "sidco_e")


def _speed_rows(ctx, runs, ratios, bench_name, caveat, paper_key, small):
    rows = []
    for base in [b for b in ("none", "topk", "dgc") if (b, None if b == "none" else ratios[0]) in runs]:
        sp = [s for s in _speedups(runs, ratios, "sidco_e", base) if s is not None]
        best = highest(sp) if sp else None
        rows.append(claim_row(
            f"{bench_name}, best over δ ∈ {{{', '.join(f'{r:g}' for r in ratios)}}}",
            f"SIDCo-E training speed-up over {label(base)}",
            ctx.reference_value(paper_key, f"SIDCo-E speed-up over {label(base)}"),
            None if best is None else best.median, None,
            f"SIDCo-E reaches its end-of-training quality faster than {label(base)} (speed-up "
            "> 1; the paper's magnitude needs its communication-bound cluster)", caveat, "×",
            interval=None if best is None else best.interval, threshold=1.0, op=">",
            projected=True,
            cause=f"scale: {small}: its communication, which compression saves, is a small "
                  "part of a projected step, and its end-of-training quality swings from run "
                  "to run"))
    return rows


def _quality_rows(ctx, runs, ratios, bench_name, caveat, paper_key, small):
    rows = []
    for r in ratios:
        km = runs[("sidco_e", r)].k_ratio_stats()[0]
        rows.append(claim_row(
            f"{bench_name}, δ={r:g}", "SIDCo-E mean k̂/k over training",
            ctx.reference_value(paper_key, "SIDCo-E mean k̂/k"), km, _band(km),
            f"SIDCo estimates the target accurately (k̂/k within [{QUALITY_BAND[0]}, {QUALITY_BAND[1]}])",
            caveat, "",
            cause=f"scale: {small}: SIDCo fits the distribution of a small model's gradients, "
                  "its stage count adapting every 5 steps of a short run"))
    return rows


@figure(
    id="sidco-fig3", paper="sidco",
    title="LSTM-PTB: training speed-up, throughput (projected to 8 workers at 10 Gbps) and "
          "estimation quality per ratio (simulated workers, CPU, PTB valid split)",
    kind="training", hardware=PAPER_HW,
    expected="SIDCo-E speeds up LSTM-PTB training by up to 41.7× over no compression, 7.6× over "
             "Top-k and 1.9× over DGC; threshold estimators have the highest throughput; only "
             "DGC and SIDCo hit the target ratio (GaussianKSGD at 0.001 and RedSync at 0.01/0.001 "
             "select ~100× fewer elements)",
    est_seconds={"smoke": 20, "full": 170}, experiment="sidco-fig3",
)
def fig3(ctx: Context) -> list[Row]:
    task = "ptb_lstm"
    ratios = [0.01] if ctx.smoke else list(RATIOS)
    names = ["sidco_e"] if ctx.smoke else list(PAPER_SET)
    runs = _grid(ctx, task, names, ratios)
    caveat = _caveat(runs, _params(task))
    small = _small(runs, _params(task))
    ctx.write_csv("runs", records_as_rows(list(runs.values()), task))

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _bars(axes[0], runs, ratios, names, lambda n, r: _speedup(runs, r, n, "none"),
          "training speed-up over no compression (×)", "(a) speed-up: (1/ppl)/projected time")
    _bars(axes[1], runs, ratios, names, lambda n, r: _throughput(runs, r, n),
          "throughput / no compression (×)", "(b) projected throughput, 8 workers @ 10 Gbps")
    _quality_bars(axes[2], runs, ratios, [n for n in names if n != "topk"], "(c) estimation quality")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SIDCo Fig. 3(a–c), LSTM on PTB (stand-in: {runs[('none', None)].data_source[:60]}); "
                 "simulated workers on CPU, communication projected", fontsize=9)
    ctx.save_plot(fig)

    rows = _speed_rows(ctx, runs, ratios, "LSTM-PTB", caveat, "LSTM-PTB", small)
    for r in ratios:
        tp = _throughput(runs, r, "sidco_e")
        over = [_throughput(runs, r, "sidco_e", b) for b in ("topk", "dgc") if b in names]
        holds = all_of(side(None if o is None else o.interval, 1.0, ">=") for o in over)
        rows.append(claim_row(
            f"LSTM-PTB, δ={r:g}", "SIDCo-E projected throughput / no compression",
            None, None if tp is None else tp.median, holds,
            "threshold estimators incl. SIDCo have the highest throughput (checked: SIDCo-E ≥ "
            "Top-k and DGC, on the intervals of SIDCo-E's throughput over each)", caveat, "×",
            interval=None if tp is None else tp.interval, projected=True,
            cause="hardware: compression is timed on this CPU, where Top-k (torch.topk) and "
                  "DGC (one fused sampling pass) cost about as much as SIDCo-E's stages; the "
                  "paper's throughput ranks V100 kernels"))
    rows += _quality_rows(ctx, runs, ratios, "LSTM-PTB", caveat, "LSTM-PTB", small)
    rows += _fig3_link_rows(ctx, task, ["sidco_e"] if ctx.smoke else ["topk", "dgc", "sidco_e"],
                            ratios[-1], steps=3 if ctx.smoke else 20)
    for n, r in (("gaussianksgd", 0.001), ("redsync", 0.01), ("redsync", 0.001)):
        if (n, r) in runs:
            km = runs[(n, r)].k_ratio_stats()[0]
            rows.append(claim_row(
                f"LSTM-PTB, δ={r:g}", f"{label(n)} mean k̂/k",
                ctx.reference_value("LSTM-PTB", f"{label(n)} mean k̂/k at δ={r:g}"), km,
                None if km is None else km <= 0.1,
                "selects about two orders of magnitude fewer elements than the target "
                "(checked: k̂/k ≤ 0.1)", caveat, "",
                cause=f"scale: {small}: how far a heuristic's threshold misses rests on the "
                      "distribution of the model's gradients (the paper: a full-size LSTM)"))
    return rows


def _fig3_link_rows(ctx: Context, task: str, names: list[str], ratio: float,
                   steps: int) -> list[Row]:
    """Throughput over no compression measured with real gloo ranks on an emulated link
    (SIDCo-E against the others), and those runs' projection onto that link beside their
    measurement."""
    setting = f"LSTM-PTB, δ={ratio:g}, {link_note()}"
    metric = "SIDCo-E measured throughput / no compression"
    specs = {"none": [f"task={task}", *compressor_overrides("none", None)]}
    specs.update({n: [f"task={task}", *compressor_overrides(n, ratio)] for n in names})
    runs = link_runs(ctx, specs, steps)
    if isinstance(runs, str):
        return [not_measured_row(setting, metric, runs)]
    tp = measured_throughput_ratio(runs["sidco_e"], runs["none"])
    over = [measured_throughput_ratio(runs["sidco_e"], runs[b]) for b in names if b != "sidco_e"]
    holds = all_of([side(None if tp is None else tp.interval, 1.0, ">"),
                    *(side(None if o is None else o.interval, 1.0, ">=") for o in over)])
    rows = [claim_row(
        setting, metric, None, None if tp is None else tp.median, holds,
        "SIDCo raises throughput over no compression and has the highest throughput of the "
        "sparsifiers (checked on measured intervals: SIDCo-E over no compression > 1"
        + "".join(f", over {label(b)} ≥ 1" for b in names if b != "sidco_e") + ")",
        f"{steps} steps each; " + "; ".join(measured_split_text(runs[n], label(n)) for n in runs)
        + "; the paper: 8 V100 workers at 10 Gbps, where communication is most of a step", "×",
        interval=None if tp is None else tp.interval, timed=True,
        cause="hardware: compression runs on this CPU (the measured split follows) and 2 "
              "ranks share a 2.5 Gbps emulated link, against V100s at 10 Gbps in the paper")]
    return rows + projection_rows(setting, runs, {n: label(n) for n in runs})


@figure(
    id="sidco-fig5", paper="sidco",
    title="ResNet-20 (speed-up, estimation quality) and VGG-16 (speed-up) on CIFAR-10 stand-in: "
          "simulated workers on CPU, communication projected to 8 workers at 10 Gbps",
    kind="training", hardware=PAPER_HW,
    expected="ResNet-20: all compressors give comparable, modest speed-ups and only SIDCo hits "
             "the target ratio; VGG-16: SIDCo speeds up training by up to 5× over no "
             "compression, 1.5× over Top-k and 1.2× over DGC",
    est_seconds={"smoke": 20, "full": 230}, experiment="sidco-fig5",
)
def fig5(ctx: Context) -> list[Row]:
    r_ratios = [0.01] if ctx.smoke else list(RATIOS)
    r_names = ["sidco_e"] if ctx.smoke else list(PAPER_SET)
    resnet = _grid(ctx, "cifar10_resnet20", r_names, r_ratios)
    v_ratios = [0.01] if ctx.smoke else [0.01, 0.001]
    v_names = ["sidco_e"] if ctx.smoke else ["topk", "dgc", "sidco_e"]
    # VGG-16 is the costly one: fewer steps (and ratios), as its panel needs speed-ups only.
    vgg = _grid(ctx, "cifar10_vgg16", v_names, v_ratios,
                extra=() if ctx.smoke else ("steps=16",))
    ctx.write_csv("runs", records_as_rows(list(resnet.values()), "cifar10_resnet20")
                  + records_as_rows(list(vgg.values()), "cifar10_vgg16"))
    cav_r = _caveat(resnet, _params("cifar10_resnet20"))
    cav_v = _caveat(vgg, _params("cifar10_vgg16"))
    small_r = _small(resnet, _params("cifar10_resnet20"))
    small_v = _small(vgg, _params("cifar10_vgg16"))

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _bars(axes[0], resnet, r_ratios, r_names, lambda n, r: _speedup(resnet, r, n, "none"),
          "training speed-up over no compression (×)", "(a) ResNet-20 speed-up")
    _quality_bars(axes[1], resnet, r_ratios, [n for n in r_names if n != "topk"],
                  "(b) ResNet-20 estimation quality")
    _bars(axes[2], vgg, v_ratios, v_names, lambda n, r: _speedup(vgg, r, n, "none"),
          "training speed-up over no compression (×)", "(c) VGG-16 speed-up")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle("SIDCo Fig. 5 on Fashion-MNIST (stand-in for CIFAR-10), smoke-size models, "
                 "simulated workers on CPU; speed-up = accuracy / projected time (8 workers, 10 Gbps)",
                 fontsize=9)
    ctx.save_plot(fig)

    rows = []
    sp = [v for n in r_names for v in _speedups(resnet, r_ratios, n, "none") if v]
    top, bottom = (highest(sp), lowest(sp)) if sp else (None, None)
    band = None if not sp else (max(1.0, top.lo / bottom.hi), top.hi / bottom.lo)
    rows.append(claim_row(
        "ResNet-20, all compressors and δ", "spread of speed-ups over no compression (max/min)",
        None, None if not sp else top.median / bottom.median, None,
        "all compressors give comparable, modest speed-ups (ResNet-20 is not network-bound; "
        "checked: max/min ≤ 1.5)", cav_r, "×", interval=band, threshold=1.5, op="<=",
        projected=True,
        cause=f"scale: {small_r} on stand-in data: each speed-up divides an end-of-training "
              "accuracy that swings from run to run after so few steps"))
    rows += _quality_rows(ctx, resnet, r_ratios, "ResNet-20", cav_r, "ResNet-20", small_r)
    if not ctx.smoke:
        for n in ("redsync", "gaussianksgd"):
            ks = [resnet[(n, r)].k_ratio_stats()[0] for r in r_ratios]
            rows.append(claim_row(
                "ResNet-20, all δ", f"{label(n)} worst mean k̂/k", None,
                max(ks, key=lambda k: abs(np.log(k))), any(not _band(k) for k in ks),
                "unlike SIDCo, the other estimators miss the target ratio (outside "
                f"[{QUALITY_BAND[0]}, {QUALITY_BAND[1]}] at some δ)", cav_r, "",
                cause=f"scale: {small_r}: how far a heuristic's threshold misses rests on the "
                      "distribution of the model's gradients"))
    rows += _speed_rows(ctx, vgg, v_ratios, "VGG-16", cav_v, "VGG-16", small_v)
    return rows


SIDCO = ("sidco_e", "sidco_gp", "sidco_p")
# The paper's start-up: one stage, then stage adaptation (compressors/sidco.py).
START_UP = "compressor.params.initial_stages=1"
START_UP_WINDOW = 5  # the first adaptation window (Q = 5 steps)


def _start_up_runs(ctx: Context, task: str, names, ratios) -> dict[tuple[str, float], Run]:
    """The SIDCo runs started at one stage (initial_stages=1), by (compressor, ratio)."""
    specs = []
    for n in names:
        for r in ratios:
            specs.append([f"task={task}", *compressor_overrides(n, r), START_UP,
                          f"name={n}-r{r:g}-initial_stages1"])
    if ctx.smoke:
        specs = [[*s, "steps=2", "eval_batches=1"] for s in specs]
    runs = train_grid(ctx, specs)
    return {(r.compressor, r.ratio): r for r in runs}


def _worst_deviation(runs, names_ratios, window: int, late: bool = False) -> float:
    """max over the runs of max(k̂/k, k/k̂) of the smoothed k̂/k (its second half: late)."""
    worst = 1.0
    for key in names_ratios:
        sm = smooth(_k_ratios(runs[key]), window)
        if late:
            sm = sm[len(sm) // 2:]
        if sm.size:
            worst = max(worst, float(np.max(np.maximum(sm, 1 / sm))))
    return worst


@figure(
    id="sidco-fig9", paper="sidco",
    title="Smoothed compression ratio k̂/k over training steps, LSTM-PTB (PTB valid split), "
          "simulated worker on CPU; SIDCo from its default stage count and from one stage",
    kind="training", hardware=PAPER_HW,
    expected="SIDCo's smoothed k̂/k stays near 1 like DGC's (SIDCo-GP over-estimates at most 2×) "
             "while RedSync and GaussianKSGD oscillate, off by up to ±60×; started single-stage, "
             "SIDCo over-sends for the first steps until its stages settle",
    est_seconds={"smoke": 25, "full": 85}, experiment="sidco-fig9",
)
def fig9(ctx: Context) -> list[Row]:
    task = "ptb_lstm"
    ratios = [0.01] if ctx.smoke else list(RATIOS)
    names = ["sidco_e"] if ctx.smoke else list(ESTIMATORS)
    runs = _grid(ctx, task, names, ratios, baseline=False, timed=False)
    sidco_names = [n for n in SIDCO if n in names]
    start_runs = _start_up_runs(ctx, task, sidco_names, ratios)
    window = 2 if ctx.smoke else 10
    data = []
    for start, grid in (("default", runs), ("single-stage", start_runs)):
        for (n, r), run in grid.items():
            steps, ks = run.series("estimation_quality")
            for step, raw, s in zip(steps, ks, smooth(ks, window)):
                data.append({"compressor": n, "ratio": r, "start": start, "step": step,
                             "k_ratio": raw, "smoothed": float(s)})
    ctx.write_csv("compression_ratio", data)
    caveat = (f"{next(iter(runs.values())).workers} simulated worker, smoke-size LSTM "
              f"({_params(task):,} parameters), {next(iter(runs.values())).steps} steps, layer-wise")
    short = (f"scale: {caveat}: the first stage-adaptation windows (5 steps each) are a large "
             "share of so short a run, and a small model's layers give the fit few elements; "
             "the paper's curves span its full-size LSTM's training")

    plt = pyplot()
    fig, axes = plt.subplots(2, len(ratios), figsize=(5 * len(ratios), 8), squeeze=False)
    for ax, r in zip(axes[0], ratios):
        for n in names:
            steps, ks = runs[(n, r)].series("estimation_quality")
            ax.plot(steps, smooth(ks, window), color=COLOURS[n], label=label(n))
        ax.set_title(f"δ = {r:g}")
    for ax, r in zip(axes[1], ratios):
        for n in sidco_names:
            for grid, style, how in ((runs, "-", "default start"),
                                     (start_runs, "--", "initial_stages=1")):
                steps, ks = grid[(n, r)].series("estimation_quality")
                ax.plot(steps, smooth(ks, window), style, color=COLOURS[n],
                        label=f"{label(n)}, {how}")
        ax.set_title(f"SIDCo start-up, δ = {r:g}", fontsize=9)
    for ax in axes.flat:
        ax.axhline(1, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
    for row in axes:
        row[0].set_ylabel(f"k̂/k (running mean over {window} steps)")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle("SIDCo Fig. 9 (j–l), LSTM on PTB stand-in (valid split), simulated on CPU; "
                 "bottom: SIDCo from its default stage count (solid) and from one stage, "
                 "initial_stages=1 (dashed)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    ctx.save_plot(fig)

    all_ratios = f"δ ∈ {{{', '.join(f'{r:g}' for r in ratios)}}}"
    max_over = ctx.reference_value("all benchmarks", "SIDCo max over-estimation")
    rows = []
    for n in ("sidco_e", "sidco_gp", "sidco_p", "dgc"):
        if n not in names:
            continue
        keys = [(n, r) for r in ratios]
        worst = _worst_deviation(runs, keys, window)
        rows.append(claim_row(
            f"LSTM-PTB, {all_ratios}", f"{label(n)} worst smoothed deviation max(k̂/k, k/k̂)",
            max_over, worst, worst <= 2.0,
            "SIDCo (and DGC) stay within 2× of the target over training (smoothed)", caveat, "×",
            cause=short))
        late = _worst_deviation(runs, keys, window, late=True)
        rows.append(claim_row(
            f"LSTM-PTB, second half of training, {all_ratios}",
            f"{label(n)} worst smoothed deviation max(k̂/k, k/k̂), after stage adaptation",
            max_over, late, late <= 2.0,
            "SIDCo stays within 2× of the target once its stage count has adapted (the paper "
            "notes start-up deviations while the stages settle)", caveat, "×", cause=short))
    for n in ("redsync", "gaussianksgd"):
        if n not in names:
            continue
        worst = _worst_deviation(runs, [(n, r) for r in ratios], window)
        rows.append(claim_row(
            f"LSTM-PTB, {all_ratios}",
            f"{label(n)} worst smoothed deviation max(k̂/k, k/k̂)",
            ctx.reference_value("all benchmarks", "RedSync/GaussianKSGD max deviation"), worst,
            worst > 2.0, "the heuristic estimators over/under-estimate strongly (paper: up to "
            "±60×; checked: beyond 2×)", caveat, "×",
            cause=f"scale: {caveat}: how far a heuristic's threshold misses rests on the "
                  "distribution of the model's gradients"))
    rows += _start_up_rows(ctx, runs, start_runs, sidco_names, ratios, window, caveat, short)
    return rows


def _start_up_rows(ctx, runs, start_runs, names, ratios, window, caveat, short) -> list[Row]:
    """SIDCo started at one stage: it over-sends in the first adaptation window (at the
    smallest δ, the paper's case), then stays within 2× of the target like the default."""
    rows = []
    r = min(ratios)
    all_ratios = f"δ ∈ {{{', '.join(f'{x:g}' for x in ratios)}}}"
    for n in names:
        first = _k_ratios(start_runs[(n, r)])[:START_UP_WINDOW]
        default = _k_ratios(runs[(n, r)])[:START_UP_WINDOW]
        mean = float(np.mean(first)) if first else None
        rows.append(claim_row(
            f"LSTM-PTB, δ={r:g}, first {len(first)} steps",
            f"{label(n)} started at one stage (initial_stages=1): mean k̂/k",
            ctx.reference_value("LSTM-AN4, δ=0.001", "SIDCo start-up k̂/k from one stage "
                                "(lower bound)"),
            mean, None if mean is None else mean > 1.0,
            "started single-stage, SIDCo over-estimates k and sends more during the first "
            "steps (k̂/k > 1)",
            f"{caveat}; from the default stage count the same steps' mean k̂/k is "
            f"{float(np.mean(default)):.3g}" if default else caveat, "",
            cause=f"scale: {caveat}; the paper's start-up is LSTM-AN4's at δ = 0.001"))
        late = _worst_deviation(start_runs, [(n, x) for x in ratios], window, late=True)
        rows.append(claim_row(
            f"LSTM-PTB, second half of training, {all_ratios}",
            f"{label(n)} started at one stage: worst smoothed deviation max(k̂/k, k/k̂)",
            ctx.reference_value("all benchmarks", "SIDCo max over-estimation"), late,
            late <= 2.0, "started single-stage, SIDCo settles within 2× of the target once "
            "its stages have adapted", caveat, "×", cause=short))
    return rows
