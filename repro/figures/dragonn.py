"""DRAGONN (Wang et al., ICML 2023) figures: Fig. 1(b) total overhead vs tensor size,
Fig. 5(a) encoding time, Fig. 5(b) dense vs sparse decoding, Lemma A.10 memory coverage,
Table 2 (with Fig. 4's convergence curves) and Fig. 7 (XML).

The paper ran on 16 V100 GPUs (2 machines × 8, 25 Gbps). Here every time is measured on
this CPU; network times come from the cost model of DRAGONN Eq. 1 (repro.costmodel)
for the paper's cluster (16 workers, 25 Gbps), and training runs are simulated workers on
stand-in data whose communication is projected onto that cluster (see repro/runs.py
for how).
"""

from __future__ import annotations

import numpy as np
import torch

from repro import bench
from repro.costmodel import Network, sent_fraction
from repro.figures.base import Context
from repro.figures.common import (
    COLOURS,
    LINK_GBPS,
    LINK_WORKERS,
    TIMING_REPEATS,
    Spread,
    bench_cpu_note,
    cell_spread,
    claim_row,
    compressor_overrides,
    encode_cell,
    errorbars,
    fmt_size,
    highest,
    label,
    link_note,
    link_unavailable,
    not_measured_row,
    paired,
    param_count,
    pyplot,
    timing_ratio,
    train_grid,
)
from repro.figures.registry import figure
from repro.figures.verdicts import Row, all_of, any_of, side

PAPER_HW = "16 NVIDIA V100-32GB (2 machines × 8 GPUs, PCIe), 25 Gbps network, PyTorch 1.8, Horovod"
CPU = "this 2-core CPU"
PAPER_NET = Network(workers=16, bandwidth_gbps=25.0, latency_us=5.0)
RATIO = 0.001  # the ratio of Figs. 1, 5, 7 and the micro-benchmarks


# -- Fig. 5(a): encoding time vs tensor size ---------------------------------------------


def _encode(report, n: str, s: int, ratio: float) -> Spread:
    """A bench cell's encode time (ms): median and 10th–90th percentile over rounds."""
    return cell_spread(encode_cell(report, n, s, ratio), "encode")


def _samples(report, n: str, s: int, ratio: float) -> list[float]:
    return encode_cell(report, n, s, ratio)["encode_samples_ms"]


@figure(
    id="dragonn-fig5a", paper="dragonn",
    title="Encoding time vs tensor size at δ=0.001: Top-k, DGC, DRAGONN (CPU-measured, "
          "interleaved rounds)",
    kind="benchmark", hardware=PAPER_HW,
    expected="DRAGONN's encoding is up to 70% faster than DGC's (512 MB: 13.2 ms vs 35.4 ms); "
             "exact Top-k is much slower than both; DRAGONN's time is almost constant in δ "
             "from 0.0001 to 0.01",
    est_seconds={"smoke": 3, "full": 30},
)
def fig5a(ctx: Context) -> list[Row]:
    if ctx.smoke:
        sizes, repeats, ratio_size = [2**12, 2**16], 3, 2**16
    else:
        sizes, repeats, ratio_size = [2**14, 2**16, 2**18, 2**20, 2**22, 2**24], 7, 2**22
    names = ["topk", "dgc", "dragonn"]
    report = bench.run_bench(names, sizes=sizes, ratios=[RATIO], repeats=repeats,
                             devices="cpu", decode_workers=[], budget_s=8.0, progress=ctx.say)
    ratios = [1e-4, 1e-3, 1e-2]
    by_ratio = bench.run_bench(["dragonn"], sizes=[ratio_size], ratios=ratios, repeats=repeats,
                               devices="cpu", decode_workers=[], budget_s=8.0)
    data = []
    for e in report["encode"] + by_ratio["encode"]:
        data.append({"numel": e["numel"], "bytes": 4 * e["numel"], "compressor": e["compressor"],
                     "ratio": e["ratio"], "k_hat": e["k_hat"], "encode_ms": e["encode_ms"],
                     "encode_p10_ms": e["encode_p10_ms"], "encode_p90_ms": e["encode_p90_ms"],
                     "encode_min_ms": e["encode_min_ms"], "repeats": e["repeats"],
                     "sweep": "ratio" if e in by_ratio["encode"] else "size"})
    ctx.write_csv("encode_time", data)

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        cells = [_encode(report, n, s, RATIO) for s in sizes]
        xs = [4 * s for s in sizes]
        ax.plot(xs, [c.median for c in cells], "o-", color=COLOURS[n], label=label(n))
        ax.fill_between(xs, [c.lo for c in cells], [c.hi for c in cells], color=COLOURS[n],
                        alpha=0.2, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes, fp32)")
    ax.set_ylabel("encoding time (ms; median, band 10–90%)")
    ax.set_title(f"(a) encode, δ={RATIO}, {repeats} interleaved rounds")
    ax.legend()
    ax.grid(alpha=0.3)
    cells = [_encode(by_ratio, "dragonn", ratio_size, r) for r in ratios]
    ax2.bar([f"{r:g}" for r in ratios], [c.median for c in cells], color=COLOURS["dragonn"],
            yerr=errorbars(cells), capsize=3, ecolor="0.3")
    ax2.set_xlabel("ratio δ")
    ax2.set_ylabel("DRAGONN encoding time (ms; median, 10–90%)")
    ax2.set_title(f"DRAGONN vs δ at d = {fmt_size(ratio_size)} ({4 * ratio_size / 2**20:g} MB)")
    fig.suptitle(f"DRAGONN Fig. 5(a) on CPU ({bench_cpu_note(report)}); paper: V100 GPU")
    ctx.save_plot(fig)

    rows = []
    caveat = "CPU vs the paper's V100 GPU: the paper's gain comes from parallel hashed writes " \
             "replacing the GPU's prefix sum; on a CPU both are one compare pass + compaction"
    reductions = {}
    for s in sizes:
        dgc, drg, top = (_samples(report, n, s, RATIO) for n in ("dgc", "dragonn", "topk"))
        # Round by round: DRAGONN's reduction over DGC, Top-k over the faster of the two.
        reductions[s] = paired(drg, dgc).map(lambda v: 100 * (1 - v))
        over = Spread.of([t / min(a, b) for t, a, b in zip(top, dgc, drg) if min(a, b) > 0])
        rows.append(claim_row(
            f"d = {fmt_size(s)} ({4 * s} B), δ={RATIO}", "Top-k encode / fastest approximate encode",
            None, over.median, None,
            "exact Top-k is much slower than the approximate (threshold) methods", CPU, "×",
            interval=over.interval, threshold=1.0, op=">",
            cause="hardware: torch.topk on this CPU is a partial selection, quick on small "
                  "tensors, where the threshold methods' fixed costs weigh most; the paper's "
                  "top-k is the V100's"))
    best_size = max(reductions, key=lambda s: reductions[s].median)
    best = highest(reductions.values())
    rows.insert(0, claim_row(
        f"largest reduction over sizes {fmt_size(sizes[0])}–{fmt_size(sizes[-1])}, δ={RATIO}",
        "encode-time reduction of DRAGONN vs DGC (max over sizes)",
        ctx.reference_value("max over tensor sizes, δ=0.001", "encode-time reduction vs DGC"),
        best.median, None,
        f"DRAGONN up to 70% lower encoding time than DGC (largest median here at d = "
        f"{fmt_size(best_size)})", caveat, "%", interval=best.interval, threshold=70.0,
        op=">=", cause="hardware: the paper's gain comes from DRAGONN's parallel hashed writes "
                       "replacing DGC's prefix sum on a V100; on this CPU both are one compare "
                       "pass and a compaction, and DGC's sampling is one fused pass"))
    big = sizes[-1]
    for n, metric in (("dragonn", "DRAGONN encode time"), ("dgc", "DGC encode time")):
        t = _encode(report, n, big, RATIO)
        rows.append(claim_row(
            f"512 MB tensor in the paper; {4 * big / 2**20:g} MB here (largest size run)", metric,
            ctx.reference_value("512 MB tensor, δ=0.001", metric), t.median, None,
            "the paper's absolute GPU time for a 512 MB tensor",
            f"10–90% here {t.lo:.3g}–{t.hi:.3g} ms", "ms", rule_name="CPU vs GPU"))
    per_round = list(zip(*(_samples(by_ratio, "dragonn", ratio_size, r) for r in ratios)))
    flat = Spread.of([max(t) / min(t) for t in per_round if min(t) > 0])
    rows.append(claim_row(
        f"DRAGONN, d = {fmt_size(ratio_size)}, δ = 0.0001 / 0.001 / 0.01",
        "max/min encoding time over δ", None, flat.median, None,
        "encoding time almost constant with δ from 0.0001 to 0.01 (checked as max/min ≤ 1.5, "
        "round by round)", CPU, "×", interval=flat.interval, threshold=1.5, op="<=",
        cause="hardware: on this CPU the compaction and hashed writes after the compare pass "
              "cost in proportion to the elements selected, which grow 100× over these δ; on "
              "the paper's V100 the pass over the tensor and the kernels' fixed costs "
              "dominate"))
    return rows


# -- Fig. 5(b): dense vs sparse decoding vs number of workers ------------------------------


@figure(
    id="dragonn-fig5b", paper="dragonn",
    title="Decoding K workers' sparse payloads: dense per worker vs batched sparse (CPU-measured, "
          "interleaved rounds)",
    kind="benchmark", hardware=PAPER_HW,
    expected="dense decoding time grows linearly with the number of GPUs, sparse decoding stays "
             "nearly constant, and sparse decoding is more than K× faster (64 MB tensor, δ=0.001)",
    est_seconds={"smoke": 3, "full": 20},
)
def fig5b(ctx: Context) -> list[Row]:
    numel = 2**16 if ctx.smoke else 16 * 2**20  # 64 MB of fp32 in the full variant, as the paper
    workers = [2, 4] if ctx.smoke else [2, 4, 8, 16]
    repeats = 3 if ctx.smoke else 7
    # run_bench always times Top-k's encode as its reference; the decoding cells are what
    # this figure reads.
    report = bench.run_bench(["topk"], sizes=[numel], ratios=[RATIO], repeats=repeats,
                             devices="cpu", decode_workers=workers, budget_s=8.0, progress=ctx.say)
    dec = sorted(report["decode"], key=lambda d: d["workers"])
    ctx.write_csv("decode_time", [
        {k: d[k] for k in ("numel", "ratio", "k", "workers", "batched_ms", "batched_p10_ms",
                           "batched_p90_ms", "dense_per_rank_ms", "dense_per_rank_p10_ms",
                           "dense_per_rank_p90_ms", "batched_min_ms", "dense_per_rank_min_ms",
                           "dense_over_batched", "dense_over_batched_p10",
                           "dense_over_batched_p90", "repeats")} for d in dec])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [d["workers"] for d in dec]
    dense = [cell_spread(d, "dense_per_rank") for d in dec]
    sparse = [cell_spread(d, "batched") for d in dec]
    ax.errorbar(ks, [x.median for x in dense], yerr=errorbars(dense), fmt="s-", capsize=3,
                color="tab:orange", label="dense decoding (densify each worker, add)")
    ax.errorbar(ks, [x.median for x in sparse], yerr=errorbars(sparse), fmt="o-", capsize=3,
                color=COLOURS["dragonn"], label="sparse decoding (one index_add of all pairs)")
    ax.set_xlabel("number of workers K")
    ax.set_ylabel("decoding time (ms; median, 10–90%)")
    ax.set_xticks(ks)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(f"DRAGONN Fig. 5(b) on CPU: d = {fmt_size(numel)} ({4 * numel / 2**20:g} MB), "
                 f"δ={RATIO}, {repeats} interleaved rounds\n{bench_cpu_note(report)}; paper: "
                 "V100 GPU", fontsize=9)
    ctx.save_plot(fig)

    rows = []
    cpu_decode = (f"scale: smoke size, a {4 * numel / 2**20:g} MB tensor (the paper's 64 MB), "
                  "where fixed per-call costs weigh on both decoders" if ctx.smoke else
                  "hardware: decoding is timed on this CPU, where one index_add of K·k pairs "
                  "costs in proportion to them and a densify per worker is a memory pass; the "
                  "paper's decoders are V100 kernels")
    for d in dec:
        k = d["workers"]
        ratio = Spread(d["dense_over_batched"], d["dense_over_batched_p10"],
                       d["dense_over_batched_p90"], d["repeats"])
        rows.append(claim_row(
            f"K = {k}, {4 * numel / 2**20:g} MB, δ={RATIO}", "dense / sparse decoding time",
            ctx.reference_value(f"K = {k}, 64 MB, δ=0.001", "dense / sparse decoding time"),
            ratio.median, None, f"sparse decoding more than K× (= {k}×) faster than dense decoding",
            CPU, "×", interval=ratio.interval, threshold=float(k), op=">", cause=cpu_decode))
    first, last = dec[0], dec[-1]
    growth_k = last["workers"] / first["workers"]
    growth_dense = paired(last["dense_per_rank_samples_ms"], first["dense_per_rank_samples_ms"])
    rows.append(claim_row(
        f"K = {first['workers']} → {last['workers']}", "dense decoding time growth", growth_k,
        growth_dense.median, None,
        f"dense decoding grows linearly with K (checked: growth ≥ half of {growth_k:g}×)", CPU, "×",
        interval=growth_dense.interval, threshold=0.5 * growth_k, op=">=", cause=cpu_decode))
    growth_sparse = paired(last["batched_samples_ms"], first["batched_samples_ms"])
    rows.append(claim_row(
        f"K = {first['workers']} → {last['workers']}", "sparse decoding time growth", 1.0,
        growth_sparse.median, None,
        "sparse decoding time keeps nearly constant in K (checked: growth ≤ 1.5×)", CPU, "×",
        interval=growth_sparse.interval, threshold=1.5, op="<=", cause=cpu_decode))
    return rows


# -- Lemma A.10: memory coverage -----------------------------------------------------------


@figure(
    id="dragonn-lemmaA10", paper="dragonn",
    title="DRAGONN memory coverage: empty-slot ratio of the hashed memory vs (1−1/m)^n",
    kind="analysis", hardware="analysis (balls into bins); no hardware",
    expected="writing n indices into m slots leaves a fraction (1−1/m)^n empty; m = n = 1024: "
             "0.36 ≤ x ≤ 0.38 with probability ≥ 0.95; m = 512, n = 1024: 0.13 ≤ x ≤ 0.14 with "
             "probability ≥ 0.8",
    est_seconds={"smoke": 2, "full": 10},
)
def lemma_a10(ctx: Context) -> list[Row]:
    from compressors.dragonn import (
        draw_hash_seeds,
        empty_fraction_tail_bound,
        expected_empty_fraction,
        write_slots,
    )

    trials = 200 if ctx.smoke else 2000
    gen = torch.Generator().manual_seed(0)

    def empty_fractions(n: int, m: int, keys_from: int, spread: bool) -> np.ndarray:
        """Empty fraction over trials; keys are n distinct indices of a tensor of
        `keys_from` elements: consecutive (0..n−1) or random (as gradient indices above a
        threshold are), a fresh hash seed per trial as DRAGONN draws per call."""
        out = np.empty(trials)
        for t in range(trials):
            if spread:
                keys = distinct_keys(n, keys_from)
            else:
                keys = torch.arange(n, dtype=torch.int64)
            slots = write_slots(keys, m, draw_hash_seeds(gen), keys_from)
            out[t] = float((slots < 0).sum()) / m
        return out

    def distinct_keys(n: int, space: int) -> torch.Tensor:
        """n distinct random indices below `space` (oversample, drop repeats, shuffle)."""
        while True:
            keys = torch.unique(torch.randint(0, space, (2 * n + 64,), generator=gen))
            if keys.numel() >= n:
                return keys[torch.randperm(keys.numel(), generator=gen)[:n]]

    rows, data = [], []
    cases = [(1024, 1024, 0.36, 0.38, 0.95), (1024, 512, 0.13, 0.14, 0.8)]
    results = {}
    for n, m, lo, hi, prob in cases:
        for spread in (False, True):
            x = empty_fractions(n, m, 2**24, spread)
            results[(n, m, spread)] = x
            p = expected_empty_fraction(n, m)
            keys = "random indices of a 16M tensor" if spread else "consecutive indices 0..n−1"
            inside = float(np.mean((x >= lo) & (x <= hi)))
            within_eps = float(np.mean(np.abs(x - p) < 0.1))
            data.append({"n": n, "m": m, "keys": keys, "trials": trials, "expected_p": p,
                         "mean": float(x.mean()), "std": float(x.std()),
                         "p05": float(np.percentile(x, 5)), "p95": float(np.percentile(x, 95)),
                         "P(lo<=x<=hi)": inside, "lo": lo, "hi": hi,
                         "P(|x-p|<0.1)": within_eps,
                         "bound P(|x-p|>=0.1)": empty_fraction_tail_bound(n, m, 0.1)})
            setting = f"m = {m}, n = {n}, {keys}, {trials} hash seeds"
            if spread:
                continue  # the paper's statements are checked on one key set; both are plotted
            rows.append(claim_row(
                setting, "mean empty-slot ratio", ctx.reference_value(f"m = {m}, n = {n}", "expected empty-slot ratio"),
                float(x.mean()), abs(float(x.mean()) - p) <= 0.01,
                f"E[x] = (1−1/m)^n = {p:.4f} (checked: |mean − p| ≤ 0.01)", "exact analysis", "",
                cause=f"refuted: DRAGONN's own hash writing n = {n} indices into m = {m} "
                      f"slots, the lemma's setting, over {trials} hash seeds"))
            rows.append(claim_row(
                setting, f"P({lo} ≤ x ≤ {hi})", ctx.reference_value(f"m = {m}, n = {n}", f"P({lo} <= x <= {hi})"),
                inside, inside >= prob,
                f"{lo} ≤ x ≤ {hi} with probability at least {prob}",
                "the paper's interval is narrower than its own ε = 0.1; the empty fraction's "
                f"standard deviation here is {x.std():.4f}", "",
                cause=f"refuted: the lemma's setting (n = {n} indices into m = {m} slots) with "
                      f"DRAGONN's own hash over {trials} seeds; the interval spans "
                      f"{(hi - lo) / max(float(x.std()), 1e-12):.2g} standard deviations of x, "
                      "the spread of random hashing that the lemma's own ε = 0.1 allows for"))
            bound = empty_fraction_tail_bound(n, m, 0.1)
            rows.append(claim_row(
                setting, "P(|x − p| ≥ 0.1)", bound, 1 - within_eps, 1 - within_eps <= bound,
                f"the bound 2·exp(−mε²/3p)/√m = {bound:.3g} at ε = 0.1", "", "",
                cause=f"refuted: the lemma's setting (n = {n} into m = {m}) with DRAGONN's own "
                      f"hash over {trials} seeds"))
    # The curve: empty ratio vs load n/m (m = 4096), measured vs (1−1/m)^n; and the load a
    # DRAGONN memory of m = 4k slots sees (n ≈ k candidates: ratio n/m ≈ 1/4).
    m = 1024 if ctx.smoke else 4096
    loads = [0.25, 0.5, 1, 1.5, 2, 3, 4]
    curve = []
    sub = max(20, trials // 20)
    for load in loads:
        n = int(load * m)
        x = np.empty(sub)
        for t in range(sub):
            keys = distinct_keys(n, 2**24)
            x[t] = float((write_slots(keys, m, draw_hash_seeds(gen), 2**24) < 0).sum()) / m
        curve.append({"m": m, "n": n, "load": load, "trials": sub, "mean": float(x.mean()),
                      "std": float(x.std()), "expected_p": expected_empty_fraction(n, m)})
    ctx.write_csv("empty_ratio", data)
    ctx.write_csv("empty_ratio_vs_load", curve)
    at_quarter = next(c for c in curve if c["load"] == 0.25)
    rows.append(claim_row(
        f"m = {m}, n = m/4 (DRAGONN's m = 4k with ≈ k candidates)", "mean empty-slot ratio",
        None, at_quarter["mean"], abs(at_quarter["mean"] - at_quarter["expected_p"]) <= 0.01,
        f"(1−1/m)^n = {at_quarter['expected_p']:.4f} also at the memory load DRAGONN runs at",
        "", "", cause=f"refuted: DRAGONN's own hash at the load it runs at (m = {m}, n = m/4), "
                      f"over {sub} seeds"))

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (n, m_, spread), x in results.items():
        if spread:
            continue
        ax.hist(x, bins=40, alpha=0.6, label=f"m = {m_}, n = {n} (p = {expected_empty_fraction(n, m_):.3f})")
        ax.axvline(expected_empty_fraction(n, m_), color="k", lw=0.8)
    for lo, hi in ((0.36, 0.38), (0.13, 0.14)):
        ax.axvspan(lo, hi, color="green", alpha=0.12)
    ax.set_xlabel("empty-slot ratio x (fraction of m)")
    ax.set_ylabel(f"count over {trials} hash seeds")
    ax.set_title("distribution of x (green: the paper's intervals)")
    ax.legend(fontsize=8)
    ax2.plot([c["load"] for c in curve], [c["mean"] for c in curve], "o", color=COLOURS["dragonn"],
             label="measured (DRAGONN's hash, random indices)")
    xs = np.linspace(0.2, 4.2, 100)
    ax2.plot(xs, [(1 - 1 / m) ** (v * m) for v in xs], "k-", lw=1, label="(1 − 1/m)^n")
    ax2.set_xlabel("load n / m")
    ax2.set_ylabel("mean empty-slot ratio")
    ax2.set_title(f"m = {m}")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle("DRAGONN Lemma A.10: memory coverage of the hashed index memory (exact analysis, CPU)")
    ctx.save_plot(fig)
    return rows


# -- Fig. 1(b): total overhead vs tensor size ----------------------------------------------


@figure(
    id="dragonn-fig1b", paper="dragonn",
    title="Total overhead (compression + communication) vs tensor size, 16 workers at 25 Gbps: "
          "CPU-measured compression + cost-model communication",
    kind="benchmark", hardware=PAPER_HW,
    expected="below 2^21 bytes full synchronisation beats DGC (δ=0.001); exact Top-k is always "
             "worse than full synchronisation; above 2^24 bytes compression is more than half "
             "of DGC's total overhead (Fig. 1(a))",
    est_seconds={"smoke": 4, "full": 20},
)
def fig1b(ctx: Context) -> list[Row]:
    import compressors

    exps = [10, 14] if ctx.smoke else [10, 12, 14, 16, 18, 20, 22, 24]
    sizes = [2**e for e in exps]
    names = ["topk", "dgc", "dragonn"]
    net = PAPER_NET
    repeats = 3 if ctx.smoke else 7
    report = bench.run_bench(names, sizes=sizes, ratios=[RATIO], repeats=repeats,
                             devices="cpu", decode_workers=[net.workers], budget_s=8.0,
                             progress=ctx.say)
    gamma = {n: sent_fraction(compressors.build(n, ratio=RATIO), numel=2**16 if ctx.smoke else 2**20)
             for n in names}
    data, spans = [], {}
    for s in sizes:
        dense = 4 * s
        decode = cell_spread(next(d for d in report["decode"] if d["numel"] == s), "batched")
        row = {"numel": s, "bytes": dense, "full_allreduce_s": net.allreduce_s(dense)}
        for n in names:
            enc = _encode(report, n, s, RATIO)
            comm = net.allgather_s(gamma[n] * dense)
            # Compression (encode + decode) in s: median, and the ends of both intervals.
            comp = Spread((enc.median + decode.median) / 1e3, (enc.lo + decode.lo) / 1e3,
                          (enc.hi + decode.hi) / 1e3, enc.n)
            spans[(n, s)] = (comp, comm)
            row[f"{n}_encode_s"] = enc.median / 1e3
            row[f"{n}_decode_s"] = decode.median / 1e3
            row[f"{n}_allgather_s"] = comm
            row[f"{n}_total_s"] = comp.median + comm
            row[f"{n}_total_p10_s"] = comp.lo + comm
            row[f"{n}_total_p90_s"] = comp.hi + comm
            row[f"{n}_compression_share"] = comp.median / (comp.median + comm)
        data.append(row)
    link = _fig1b_link(ctx, ["none", *names], sizes, repeats)
    if isinstance(link, dict):
        for row in data:
            for n in ["none", *names]:
                m = Spread.of(link[(n, row["numel"])])
                row[f"{n}_link_total_s"] = m.median
                row[f"{n}_link_total_p10_s"], row[f"{n}_link_total_p90_s"] = m.interval
    ctx.write_csv("total_overhead", data)
    for n in names:
        ctx.say(f"{n}: γ = {gamma[n]:.4g} of dense bytes")

    def total(n: str, s: int) -> tuple[float, float]:
        comp, comm = spans[(n, s)]
        return (comp.lo + comm, comp.hi + comm)

    def share(n: str, s: int) -> tuple[float, float]:
        comp, comm = spans[(n, s)]
        return (comp.lo / (comp.lo + comm), comp.hi / (comp.hi + comm))

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    b = [r["bytes"] for r in data]
    ax.plot(b, [r["full_allreduce_s"] * 1e3 for r in data], "k^-", label="full sync (ring allreduce, model)")
    for n in names:
        ax.plot(b, [r[f"{n}_total_s"] * 1e3 for r in data], "o-", color=COLOURS[n],
                label=f"{label(n)} (CPU enc+dec, median, + allgather model)")
        ax.fill_between(b, [r[f"{n}_total_p10_s"] * 1e3 for r in data],
                        [r[f"{n}_total_p90_s"] * 1e3 for r in data], color=COLOURS[n], alpha=0.2,
                        lw=0)
    if isinstance(link, dict):
        for n in ["none", *names]:
            ax.plot(b, [r[f"{n}_link_total_s"] * 1e3 for r in data], "x--", lw=0.8,
                    color=COLOURS[n], label=f"{label(n)}, {link_note()}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes, fp32)")
    ax.set_ylabel("total overhead (ms; band 10–90% over rounds)")
    ax.set_title(f"(b) total overhead, δ={RATIO}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for n in ("dgc", "dragonn"):
        ax2.plot(b, [r[f"{n}_compression_share"] for r in data], "o-", color=COLOURS[n], label=label(n))
        ax2.fill_between(b, [share(n, s)[0] for s in sizes], [share(n, s)[1] for s in sizes],
                         color=COLOURS[n], alpha=0.2, lw=0)
    ax2.axhline(0.5, color="k", lw=0.8, ls="--")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("tensor size (bytes, fp32)")
    ax2.set_ylabel("compression / total overhead")
    ax2.set_title("(a) share of compression in the total overhead")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(f"DRAGONN Fig. 1: compression measured on CPU ({bench_cpu_note(report)}, "
                 f"{repeats} interleaved rounds), communication projected for {net.workers} "
                 f"workers at {net.bandwidth_gbps:g} Gbps", fontsize=9)
    ctx.save_plot(fig)

    caveat = ("compression measured on this CPU: a projection onto a cluster of these CPUs on "
              "the paper's network, not onto its V100s (GPU compression: the row below); "
              f"communication from the cost model, {net.workers} workers, "
              f"{net.bandwidth_gbps:g} Gbps, α = {net.latency_us:g} µs; each size decided on "
              "the 10–90% interval of its total")
    size_range = f"sizes 2^{exps[0] + 2}–2^{exps[-1] + 2} B"
    cpu_compression = ("hardware: compression is timed on this CPU, against V100 kernels with "
                       "a constant launch cost in the paper; where compression pays rests on "
                       "how its time compares with the network's")
    topk_on_cpu = ("hardware: torch.topk on this CPU takes microseconds on a small tensor, "
                   "while the paper's V100 top-k cost more than the allreduce it replaced at "
                   "every size")
    rows = []
    wins = [r["bytes"] for r in data if r["dgc_total_s"] < r["full_allreduce_s"]]
    crossover = min(wins) if wins else None
    below = [r for r in data if r["bytes"] < 2**21]
    above = [r for r in data if r["bytes"] >= 2**21]
    claim = "full synchronisation beats DGC below 2^21 bytes and DGC wins above" + (
        "" if crossover else " (here DGC's median never beats full sync: no crossover)")
    ref = ctx.reference_value("16 workers, 25 Gbps, δ=0.001", "DGC-vs-full crossover size")
    if below and above:
        holds = all_of([side(total("dgc", r["numel"]), r["full_allreduce_s"], ">=") for r in below]
                       + [side(total("dgc", r["numel"]), r["full_allreduce_s"], "<") for r in above])
        rows.append(claim_row(f"{size_range}, δ={RATIO}", "smallest size where DGC beats full sync",
                              ref, float(crossover) if crossover else None, holds, claim, caveat,
                              "bytes", missing_ok=True, timed=True, projected=True,
                              cause=cpu_compression))
    else:
        rows.append(claim_row(f"{size_range}, δ={RATIO}", "smallest size where DGC beats full sync",
                              ref, float(crossover) if crossover else None, None, claim,
                              "sizes on both sides of 2^21 B are not run at this size", "bytes",
                              rule_name="not run"))
    topk_worse = [r["topk_total_s"] > r["full_allreduce_s"] for r in data]
    rows.append(claim_row(
        size_range, "sizes where Top-k is worse than full sync",
        None, float(sum(topk_worse)),
        all_of(side(total("topk", r["numel"]), r["full_allreduce_s"], ">") for r in data),
        f"exact Top-k always performs worse than full synchronisation (medians: {sum(topk_worse)} "
        f"of {len(data)} sizes here)", caveat, "sizes", timed=True, projected=True,
        cause=topk_on_cpu))
    shares = [r["bytes"] for r in data if r["dgc_compression_share"] > 0.5]
    first_half = min(shares) if shares else None
    small = [r for r in data if r["bytes"] < 2**24]
    big = [r for r in data if r["bytes"] >= 2**24]
    claim = "compression outweighs the other overheads only when the tensor exceeds 2^24 bytes"
    ref = ctx.reference_value("16 workers, 25 Gbps, δ=0.001", "compression-dominated from size")
    if big:
        holds = all_of([all_of(side(share("dgc", r["numel"]), 0.5, "<=") for r in small),
                        any_of(side(share("dgc", r["numel"]), 0.5, ">") for r in big)])
        rows.append(claim_row(
            "Fig. 1(a): DGC, δ=0.001", "smallest size where compression > 50% of total overhead",
            ref, float(first_half) if first_half else None, holds, claim, caveat, "bytes",
            missing_ok=True, timed=True, projected=True, cause=cpu_compression))
    else:
        rows.append(claim_row(
            "Fig. 1(a): DGC, δ=0.001", "smallest size where compression > 50% of total overhead",
            ref, float(first_half) if first_half else None, None, claim,
            "no size of 2^24 B or more is run at this size", "bytes", rule_name="not run"))
    return rows + _fig1b_gpu_rows(ctx, names, data, gamma, net, size_range) \
        + _fig1b_link_rows(ctx, link, data, size_range)


def _fig1b_gpu_rows(ctx: Context, names: list[str], data: list[dict], gamma: dict,
                    net: Network, size_range: str) -> list[Row]:
    """Fig. 1(b)'s crossover projected onto the paper's GPU cluster: compression time from
    the committed GPU benches (repro.gpubench, interpolated between measured sizes, never
    extrapolated), communication from the cost model; one "not run" row naming what is
    missing when the benches do not cover every size."""
    from repro.figures.registry import default_results_root
    from repro.gpubench import GpuBench, NotCovered

    setting = f"{size_range}, δ={RATIO}, GPU compression"
    metric = "smallest size where DGC beats full sync (projected, GPU compression)"
    bench = GpuBench.load(ctx.reference_root or default_results_root())
    try:
        times = {(n, r["numel"]): bench.time(n, RATIO, r["numel"]) for n in ("dgc", "topk")
                 for r in data}
    except NotCovered as exc:
        return [claim_row(setting, metric, None, None, None,
                          "full synchronisation beats DGC below 2^21 bytes and DGC wins above",
                          f"not projected onto GPUs: {exc}", "bytes", rule_name="not run")]
    total = {key: t.seconds + net.allgather_s(gamma[key[0]] * 4 * key[1]) for key, t in times.items()}
    wins = [r["bytes"] for r in data if total[("dgc", r["numel"])] < r["full_allreduce_s"]]
    holds = all((total[("dgc", r["numel"])] >= r["full_allreduce_s"]) == (r["bytes"] < 2**21)
                for r in data)
    labels = sorted({t.label for t in times.values()})
    return [claim_row(
        setting, metric, ctx.reference_value("16 workers, 25 Gbps, δ=0.001",
                                             "DGC-vs-full crossover size"),
        float(min(wins)) if wins else None, holds,
        "full synchronisation beats DGC below 2^21 bytes and DGC wins above",
        "; ".join(labels) + f"; communication from the cost model, {net.workers} workers, "
        f"{net.bandwidth_gbps:g} Gbps", "bytes", missing_ok=True, projected=True,
        cause=f"hardware: compression times from the committed GPU benches "
              f"({'; '.join(labels)}), not the paper's V100s")]


def _fig1b_link(ctx: Context, names: list[str], sizes: list[int], repeats: int
                ) -> dict[tuple[str, int], list[float]] | str:
    """Round times of whole exchanges (encode, collectives, decode) per compressor and
    size on real gloo ranks joined by an emulated link, or why they cannot run here."""
    from repro import netcheck

    reason = link_unavailable()
    if reason is not None:
        return reason
    ctx.say(f"exchanges {link_note()}: {', '.join(names)} at {len(sizes)} sizes")
    return netcheck.exchange_times(names, sizes, RATIO, LINK_WORKERS, LINK_GBPS,
                                   repeats=repeats)


def _fig1b_link_rows(ctx: Context, link, data: list[dict], size_range: str) -> list[Row]:
    """Fig. 1(b)'s claims on exchanges measured on the emulated link."""
    setting = f"{size_range}, δ={RATIO}, {link_note()}"
    metric = "smallest size where DGC beats full sync (measured)"
    if isinstance(link, str):
        return [not_measured_row(setting, metric, link)]

    def span(n: str, numel: int) -> tuple[float, float]:
        return Spread.of(link[(n, numel)]).interval

    caveat = ("whole exchanges (CPU encode and decode, gloo collectives through the suite's "
              "driver) of a Laplace tensor, each size decided on the 10–90% intervals of the "
              "per-round times; the paper: 16 V100 workers at 25 Gbps, beyond what this host "
              "carries as a link")
    wins = [r["bytes"] for r in data if r["dgc_link_total_s"] < r["none_link_total_s"]]
    dgc_vs_full = [side(span("dgc", r["numel"]), r["none_link_total_s"],
                        ">=" if r["bytes"] < 2**21 else "<") for r in data]
    rows = [claim_row(
        setting, metric, ctx.reference_value("16 workers, 25 Gbps, δ=0.001",
                                             "DGC-vs-full crossover size"),
        float(min(wins)) if wins else None, all_of(dgc_vs_full),
        "full synchronisation beats DGC below 2^21 bytes and DGC wins above (medians here: "
        + (f"DGC first wins at {min(wins)} B" if wins else "DGC never wins") + ")",
        caveat, "bytes", missing_ok=True, timed=True,
        cause="hardware: CPU compression and 2 gloo ranks on a 2.5 Gbps emulated link, against "
              "V100 kernels and 16 workers at 25 Gbps in the paper; where DGC starts to pay "
              "rests on how its compression time compares with the link's")]
    worse = [r["topk_link_total_s"] > r["none_link_total_s"] for r in data]
    rows.append(claim_row(
        setting, "sizes where Top-k is worse than full sync (measured)", None, float(sum(worse)),
        all_of(side(span("topk", r["numel"]), r["none_link_total_s"], ">") for r in data),
        f"exact Top-k always performs worse than full synchronisation (medians: {sum(worse)} "
        f"of {len(data)} sizes here)", caveat, "sizes", timed=True,
        cause="hardware: torch.topk on this CPU takes microseconds on a small tensor, while the "
              "paper's V100 top-k cost more than the allreduce it replaced at every size"))
    return rows


# -- Table 2 (and Fig. 4's convergence curves), Fig. 7: training --------------------------

TABLE2_TASKS = (("cifar10_vit", "ViT"), ("cifar10_mixer", "MLP-Mixer"), ("wiki10_xml", "XML"))
TARGET_FRACTION = 0.8  # the target: 80% of the best metric full synchronisation reaches
# DRAGONN as its paper runs it: the hash compressor with the efficiency-aware selection of
# §4.1 (a tensor is compressed only where Eq. 1 says it saves time on the target
# network). The paper's speed-ups are this system's; "dragonn" alone is the compressor.
FULL = "dragonn_ea"


def _train_set(ctx: Context, task: str, names, extra=()) -> dict:
    """The runs of `names` (compressors, or FULL) on `task`, by name."""
    specs = []
    for n in names:
        if n == FULL:
            o = [f"task={task}", *compressor_overrides("dragonn", RATIO),
                 "compressor.efficiency_aware=true", f"name={FULL}-r{RATIO:g}-{task}", *extra]
        else:
            o = [f"task={task}", *compressor_overrides(n, None if n in ("none", "signsgd") else RATIO),
                 *extra]
        if ctx.smoke:
            o += ["steps=4", "eval_every=2", "eval_batches=1"]
        specs.append(o)
    # The figures compare these runs' step times: each is trained TIMING_REPEATS times.
    return dict(zip(names, train_grid(ctx, specs, repeats=TIMING_REPEATS)))


def _time_to(run, target: float) -> tuple[int | None, float | None]:
    steps = run.steps_to(target)
    if steps is None:
        return None, None
    return steps, run.projection().time_at(steps)


def _caveat(runs: dict) -> str:
    r = next(iter(runs.values()))
    return (f"{r.workers} simulated workers, smoke-size model on stand-in data, {r.steps} steps; "
            f"target = {TARGET_FRACTION:.0%} of the best {r.metric} full sync reaches here "
            "(the paper's 94% / 80% are out of reach at this scale); time = steps × step "
            f"projected onto {r.target_workers} workers at 25 Gbps with CPU compute/compression")


def _iterations_cause(runs: dict) -> str:
    """Why iteration counts to the target would not order as the paper's do."""
    r = next(iter(runs.values()))
    return (f"scale: iterations to the target are counted at the evaluations of {r.steps} "
            f"steps of a smoke-size model on stand-in data with {r.workers} simulated workers; "
            "the paper trains to convergence on 16 GPUs")


def _convergence_panel(ax, runs: dict, title: str, target: float | None) -> None:
    for n, r in runs.items():
        ax.plot([s for s, _ in r.eval_curve], [v for _, v in r.eval_curve], "o-", ms=3,
                color=COLOURS.get(n, None), label=label(n))
    if target is not None:
        ax.axhline(target, color="k", lw=0.8, ls="--", label="target")
    ax.set_xlabel("iteration")
    r0 = next(iter(runs.values()))
    ax.set_ylabel(f"test {r0.metric}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)


@figure(
    id="dragonn-table2", paper="dragonn",
    title="Speed-up of DRAGONN to target accuracy over DGC and full sync, with convergence "
          "curves (Fig. 4): simulated workers on stand-in data, time projected to 16 workers "
          "at 25 Gbps",
    kind="training", hardware=PAPER_HW,
    expected="to reach the target accuracy DRAGONN is faster than DGC (ResNet50 1.42×, ViT 2.15×, "
             "MLP-Mixer 1.72×, XML 3.52×) and than full synchronisation (2.40×, 2.45×, 6.04×, "
             "35.9×); DGC needs 1.6× more iterations than DRAGONN on XML",
    est_seconds={"smoke": 20, "full": 150}, experiment="dragonn-table2",
)
def table2(ctx: Context) -> list[Row]:
    tasks_ = TABLE2_TASKS[1:] if ctx.smoke else TABLE2_TASKS
    names = (["none", "dgc", "dragonn", FULL] if ctx.smoke
             else ["none", "topk", "dgc", "dragonn", FULL])
    all_runs, rows, data = {}, [], []
    for task, col in tasks_:
        runs = _train_set(ctx, task, names)
        all_runs[col] = runs
        best_full = runs["none"].best()
        target = None if best_full is None else TARGET_FRACTION * best_full
        for n, r in runs.items():
            steps, t = _time_to(r, target) if target is not None else (None, None)
            data.append({"task": task, "column": col, "compressor": n, "ratio": r.ratio,
                         "target": target, "steps_to_target": steps, "projected_time_to_target_s": t,
                         "projected_step_s": r.projection().step_s, "final": r.final_eval,
                         "best": r.best(), "projected_samples_per_s": r.projection().samples_per_s,
                         "data_source": r.data_source})
        caveat = _caveat(runs)
        d_steps = runs[FULL].steps_to(target) if target else None
        for who, base, name in ((FULL, "dgc", "DGC"), (FULL, "none", "full sync"),
                                ("dragonn", "dgc", "DGC"), ("dragonn", "none", "full sync")):
            w_time = _time_to(runs[who], target)[1] if target else None
            b_steps, b_time = _time_to(runs[base], target) if target else (None, None)
            claim = f"DRAGONN reaches the target faster than {name}"
            if who != FULL:
                claim = ("context, DRAGONN's compressor without efficiency-aware selection: "
                         + claim)
            interval = None
            if w_time and b_time:
                span = timing_ratio(b_time / w_time, runs[base], runs[who])
                sp, holds = b_time / w_time if span is None else span.median, None
                interval = None if span is None else span.interval
                if interval is None:
                    holds = b_time > w_time
            elif w_time:  # the baseline never reached the target within the run
                sp, holds, claim = None, True, claim + f" ({name} never reached it)"
            elif b_time:  # DRAGONN never reached it: SIDCo's convention, speed-up 0
                sp, holds, claim = 0.0, False, claim + " (DRAGONN never reached the target)"
            else:
                sp, holds, claim = None, None, claim + " (neither reached the target)"
            metric = f"DRAGONN speed-up over {name}"
            why = (f"scale: DRAGONN did not reach the target within {runs[who].steps} steps of "
                   "a smoke-size model on stand-in data" if sp == 0.0 else
                   "scale: a smoke-size model's communication, which compression saves, is a "
                   f"small part of its projected step, and {runs[who].steps} steps on stand-in "
                   "data decide when the target is reached")
            rows.append(claim_row(
                f"{col} ({task}, stand-in), δ={RATIO}",
                metric if who == FULL else f"DRAGONN compressor alone: speed-up over {name}",
                ctx.reference_value(col, metric) if who == FULL else None, sp, holds, claim,
                caveat, "×", missing_ok=sp is not None or holds is not None,
                interval=interval, threshold=1.0, op=">", projected=True, cause=why))
        if col == "XML":
            b_steps = runs["dgc"].steps_to(target) if target else None
            ratio = b_steps / d_steps if b_steps and d_steps else None
            rows.append(claim_row(
                f"{col} ({task}, stand-in), δ={RATIO}", "DGC iterations / DRAGONN iterations to converge",
                ctx.reference_value(col, "DGC iterations / DRAGONN iterations to converge"), ratio,
                None if ratio is None else ratio > 1,
                "DGC needs more iterations than DRAGONN to converge on XML", caveat, "×",
                cause=_iterations_cause(runs)))
    rows.append(claim_row("ResNet50 (ImageNet)", "DRAGONN speed-up over DGC",
                          ctx.reference_value("ResNet50", "DRAGONN speed-up over DGC"), None, None,
                          "DRAGONN reaches the target faster than DGC",
                          "an ImageNet ResNet-50 to 94% does not fit a 2-core CPU budget", "×",
                          rule_name="not run"))
    ctx.write_csv("time_to_target", data)

    plt = pyplot()
    fig, axes = plt.subplots(1, len(all_runs) + 1, figsize=(4.6 * (len(all_runs) + 1), 4))
    for ax, (col, runs) in zip(axes, all_runs.items()):
        best_full = runs["none"].best()
        _convergence_panel(ax, runs, f"Fig. 4: {col} (stand-in data)",
                           None if best_full is None else TARGET_FRACTION * best_full)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    cols = list(all_runs)
    for j, (base, name) in enumerate((("dgc", "over DGC"), ("none", "over full sync"))):
        ys = []
        for c in cols:
            d = [x for x in data if x["column"] == c]
            tb = next(x for x in d if x["compressor"] == base)["projected_time_to_target_s"]
            td = next(x for x in d if x["compressor"] == FULL)["projected_time_to_target_s"]
            ys.append(tb / td if tb and td else np.nan)
        ax.bar(np.arange(len(cols)) + 0.4 * j, ys, 0.4, label=f"DRAGONN {name}")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(cols)) + 0.2, cols)
    ax.set_ylabel("speed-up to target (×, projected time)")
    ax.set_title("Table 2 (missing bar: a run never reached the target)", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle("DRAGONN Table 2 / Fig. 4 on stand-in data (Fashion-MNIST for CIFAR-10, MovieLens "
                 "for Wiki10-31K), simulated workers on CPU, time projected to 16 workers at 25 Gbps",
                 fontsize=9)
    ctx.save_plot(fig)
    return rows


@figure(
    id="dragonn-fig7", paper="dragonn",
    title="XML (wiki10_xml on MovieLens stand-in): accuracy vs iteration and projected training "
          "speed of SignSGD, DGC, Random-k, DRAGONN (simulated workers, 16 workers at 25 Gbps)",
    kind="training", hardware=PAPER_HW,
    expected="DRAGONN converges in fewer iterations than SignSGD, DGC and Random-k; Random-k is "
             "faster per iteration but needs 15.1× more iterations, so DRAGONN is 14.1× faster to "
             "converge; DRAGONN trains faster than DGC and SignSGD",
    est_seconds={"smoke": 15, "full": 20}, experiment="dragonn-fig7",
)
def fig7(ctx: Context) -> list[Row]:
    names = (["none", "dragonn", FULL, "randomk"] if ctx.smoke
             else ["none", "signsgd", "dgc", "randomk", "dragonn", FULL])
    runs = _train_set(ctx, "wiki10_xml", names)
    best_full = runs["none"].best()
    target = None if best_full is None else TARGET_FRACTION * best_full
    caveat = _caveat(runs)
    full_tp = runs["none"].projection().samples_per_s
    data = []
    for n, r in runs.items():
        steps, t = _time_to(r, target) if target is not None else (None, None)
        p = r.projection()
        data.append({"compressor": n, "ratio": r.ratio, "target": target, "steps_to_target": steps,
                     "projected_time_to_target_s": t, "projected_samples_per_s": p.samples_per_s,
                     "throughput_over_full": p.samples_per_s / full_tp if full_tp else None,
                     "final": r.final_eval, "best": r.best(), "projected_step_s": p.step_s})
    ctx.write_csv("xml_runs", data)
    curves = [{"compressor": n, "iteration": s, r.metric: v} for n, r in runs.items() for s, v in r.eval_curve]
    ctx.write_csv("xml_accuracy_curves", curves)

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _convergence_panel(ax, runs, "(a) P@1 vs iteration", target)
    ax.legend(fontsize=7)
    comp = [n for n in names if n != "none"]

    def tp_over(den: str, num: str) -> Spread:
        """num's projected samples/s over den's, with the interval of its timing part."""
        point = runs[num].projection().samples_per_s / runs[den].projection().samples_per_s
        return timing_ratio(point, runs[den], runs[num]) or Spread(point, point, point)

    tp = {n: tp_over("none", n) for n in comp}
    ax2.bar([label(n) for n in comp], [tp[n].median for n in comp],
            color=[COLOURS[n] for n in comp], yerr=errorbars([tp[n] for n in comp]), capsize=3,
            ecolor="0.3")
    ax2.axhline(1, color="k", lw=0.8)
    ax2.set_ylabel("projected samples/s / full sync (×; 10–90% step by step)")
    ax2.set_title("(b) training speed, 16 workers at 25 Gbps (projected)", fontsize=9)
    fig.suptitle(f"DRAGONN Fig. 7, XML on MovieLens-100K stand-in ({runs['none'].data_source[:50]}…), "
                 f"δ={RATIO} (SignSGD: 1/32), simulated workers on CPU", fontsize=9)
    ctx.save_plot(fig)

    rows = []
    xml_params = param_count("wiki10_xml")
    d_steps, d_time = _time_to(runs[FULL], target) if target else (None, None)
    setting = f"XML stand-in, δ={RATIO}"
    r_steps, r_time = _time_to(runs["randomk"], target) if target else (None, None)
    it_ratio = r_steps / d_steps if r_steps and d_steps else None
    rows.append(claim_row(
        setting, "Random-k iterations / DRAGONN iterations to converge",
        ctx.reference_value("XML, 16 GPUs, δ=0.001", "Random-k iterations / DRAGONN iterations to converge"),
        it_ratio, None if d_steps is None else (r_steps is None or it_ratio > 1),
        "Random-k needs many more iterations than DRAGONN to converge"
        + (" (Random-k never reached the target)" if d_steps and r_steps is None else ""), caveat, "×",
        missing_ok=True, cause=_iterations_cause(runs)))
    t_ratio = r_time / d_time if r_time and d_time else None
    t_span = timing_ratio(t_ratio, runs["randomk"], runs[FULL])
    rows.append(claim_row(
        setting, "DRAGONN speed-up over Random-k to converge",
        ctx.reference_value("XML, 16 GPUs, δ=0.001", "DRAGONN speed-up over Random-k to converge"),
        t_ratio if t_span is None else t_span.median, None if d_time is None or t_span is not None else r_time is None,
        "DRAGONN converges faster in time than Random-k despite Random-k's higher throughput",
        caveat, "×", missing_ok=True, interval=None if t_span is None else t_span.interval,
        threshold=1.0, op=">", projected=True,
        cause="scale: the time to the target is the iterations counted at the evaluations of a "
              "short run on stand-in data times a projected step"))
    for n in [v for v in ("signsgd", "dgc") if v in runs]:
        b_steps = runs[n].steps_to(target) if target else None
        rows.append(claim_row(
            setting, f"{label(n)} iterations − DRAGONN iterations to target", None,
            None if d_steps is None else (float(b_steps - d_steps) if b_steps else None),
            None if d_steps is None else (b_steps is None or b_steps >= d_steps),
            f"DRAGONN needs no more iterations than {label(n)} to converge", caveat, "iterations",
            missing_ok=True, cause=_iterations_cause(runs)))
    for n in [v for v in ("dgc", "signsgd") if v in tp]:
        span = tp_over(n, FULL)
        rows.append(claim_row(
            setting, f"DRAGONN / {label(n)} projected throughput", None, span.median, None,
            f"DRAGONN trains faster (samples/s) than {label(n)}", caveat, "×",
            interval=span.interval, threshold=1.0, op=">", projected=True,
            cause=(f"scale: the XML stand-in's layer has {xml_params:,} parameters (the "
                   "paper's 126.7M), so communication, where DRAGONN sends less than SignSGD, "
                   "is a small part of a projected step and compression on this CPU decides"
                   if n == "signsgd" else
                   "hardware: DRAGONN and DGC send alike at δ = 0.001, so their throughput "
                   "rests on compression, timed on this CPU (DGC's sampling one fused pass) "
                   "where the paper's gain is DRAGONN's GPU hash")))
    span = tp_over(FULL, "randomk")
    rows.append(claim_row(
        setting, "Random-k / DRAGONN projected throughput", None, span.median, None,
        "Random-k outperforms DRAGONN in training speed", caveat, "×",
        interval=span.interval, threshold=1.0, op=">", projected=True,
        cause="hardware: both compressions are timed on this CPU against communication "
              "projected at 25 Gbps; the paper's Random-k is faster per iteration on V100s"))
    for n, metric in ((FULL, "DRAGONN throughput over full sync"),
                      ("dgc", "DGC throughput over full sync")):
        if n in tp:
            rows.append(claim_row(
                setting, metric, ctx.reference_value("XML, 16 GPUs, δ=0.001", metric), tp[n].median,
                None, "compression speeds up XML training over full sync (paper: 22.4× DRAGONN, "
                "10.2× DGC with a 126.7M-parameter layer on 16 GPUs)", caveat + "; here the layer "
                f"has {param_count('wiki10_xml'):,} parameters on {runs[n].workers} simulated "
                f"workers (10–90% {tp[n].lo:.3g}–{tp[n].hi:.3g}×)", "×", rule_name="stand-in",
                projected=True))
    off = tp["dragonn"]
    rows.append(claim_row(
        setting, "DRAGONN compressor alone: throughput over full sync", None, off.median, None,
        "context: DRAGONN's compressor without efficiency-aware selection (the paper's speed-ups "
        f"are the full system's: {tp[FULL].median:.3g}× here)", caveat, "×",
        interval=off.interval, threshold=1.0, op=">", projected=True,
        cause=f"scale: the XML stand-in's layer has {xml_params:,} parameters (the paper's "
              "126.7M), so the communication compression saves is a small part of a "
              "projected step"))
    return rows
