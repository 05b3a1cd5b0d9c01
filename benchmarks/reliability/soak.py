"""Soak: long runs on 2 gloo ranks, one compressor of each family, watching what must stay
flat: each rank's resident memory, the error-feedback norm and the step time.

    python benchmarks/reliability/soak.py --out results/reliability

For each compressor, `repro train` runs in a subprocess (cluster=local_cpu: 2 spawned gloo
ranks, one thread each; the smoke task; a checkpoint every 500 steps) and this program
samples the resident set size (VmRSS) of both rank processes every second, with the
step the run had logged by then. Afterwards it reads metrics.jsonl (step_s, ef_norm,
loss) through repro.runs and judges:

- memory growth: median RSS over the last 200 steps against the median over steps
  200-400 (after the warm-up: allocator pools, data, the native library), per rank;
  goal < 2 %. Samples taken from the last step on (its final evaluation, the last
  checkpoint, the exit) are left out;
- step-time drift: median step time of the last 200 steps against steps 1-200 (step 0
  carries one-off costs); it counts as drift only where the medians differ by more than
  the larger interquartile range of the two windows (the spread of steps inside one
  window on this shared machine is the noise);
- error-feedback norm bounded: finite everywhere, and level over the second half of the
  run: the median of the last 250 steps exceeds the median of the 250 steps from the
  half-way point by no more than the larger interquartile range of the two windows (the
  same noise rule as the step time). A residual that keeps accumulating rises by more.

A compressor may carry extra overrides after "+": `--compressors sidco_e+compressor.min_numel=1024`.
Writes soak.json (the numbers above, the command, the load average around each run;
rewritten after each compressor) and soak.png (RSS, step time and EF norm against the
step) into --out (--report names them); each run's samples and series go to
WORK/<name>.series.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

FAMILIES = {
    "topk": ["compressor=topk", "compressor.ratio=0.01"],
    "sidco_e": ["compressor=sidco_e", "compressor.ratio=0.01"],
    "dgc": ["compressor=dgc", "compressor.ratio=0.01"],
    "dragonn": ["compressor=dragonn", "compressor.ratio=0.01"],
    "deft": ["compressor=deft", "compressor.ratio=0.01"],
    "thc": ["compressor=thc"],
    "powersgd": ["compressor=powersgd"],
}


def rank_pids(launcher: int) -> list[int]:
    """The spawned rank processes of a `repro train` process, by start order."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if "spawn_main" in cmd:
            pids.append(int(entry))
    return sorted(pids)


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def last_step(metrics_path: str) -> int | None:
    """The step of the last complete line of metrics.jsonl (read from its end)."""
    try:
        with open(metrics_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            tail = f.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def soak_one(name: str, args, work: str) -> dict[str, Any]:
    from repro import launch, runs

    base, *extra = name.split("+")
    label = re.sub(r"[^A-Za-z0-9_]+", "-", name).strip("-")
    overrides = [*FAMILIES[base], *extra, f"name=soak-{label}", f"task={args.task}", "task.size=smoke", f"steps={args.steps}",
                 "cluster=local_cpu", "cluster.workers=2", "cluster.threads_per_worker=1",
                 "eval_every=0", "eval_batches=1", f"checkpoint_every={args.checkpoint_every}",
                 "logger=local", "logger.progress=false", f"seed={args.seed}",
                 f"runs_root={work}"]
    run_dir = launch.plan(overrides, multirun=False)[0].run_dir
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    load_before = os.getloadavg()
    started = time.time()
    log_path = os.path.join(work, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "repro.cli", "train", "--restart",
                                 *overrides], stdout=log, stderr=subprocess.STDOUT, env=env)
        samples: list[dict[str, Any]] = []
        metrics_path = os.path.join(run_dir, "metrics.jsonl")
        while proc.poll() is None:
            pids = rank_pids(proc.pid)
            if len(pids) == 2:
                rss = [rss_kib(p) for p in pids]
                step = last_step(metrics_path)
                if None not in rss and step is not None:
                    samples.append({"t": round(time.time() - started, 2), "step": step,
                                    "rss_kib": rss})
            time.sleep(args.sample_s)
    wall = time.time() - started
    load_after = os.getloadavg()
    if proc.returncode != 0:
        with open(log_path) as f:
            raise RuntimeError(f"{name}: repro train exited with {proc.returncode}:\n"
                               f"{f.read()[-3000:]}")
    run = runs.load_run(run_dir)
    result = judge(name, run, samples, wall, load_before, load_after, overrides, args)
    result["run_dir"] = run_dir
    return result


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def judge(name: str, run, samples: list[dict[str, Any]], wall: float, load_before, load_after,
          overrides: list[str], args) -> dict[str, Any]:
    steps = args.steps
    step_s = {r["step"]: r["step_s"] for r in run.metrics if r.get("step_s") is not None}
    first = [step_s[s] for s in range(1, 201) if s in step_s]
    last = [step_s[s] for s in range(steps - 200, steps) if s in step_s]
    med_first, med_last = statistics.median(first), statistics.median(last)
    noise = max(_iqr(first), _iqr(last))
    drift = med_last - med_first
    # Samples taken from the last step on (its final evaluation, then the last checkpoint
    # and the exit) are not training steps.
    training = [s for s in samples if s["step"] < steps - 2]
    memory = []
    for rank in range(2):
        base = [s["rss_kib"][rank] for s in training if 200 <= s["step"] < 400]
        end = [s["rss_kib"][rank] for s in training if s["step"] >= steps - 200]
        if not base or not end:
            memory.append({"rank": rank, "error": "too few samples in a window"})
            continue
        b, e = statistics.median(base), statistics.median(end)
        memory.append({"rank": rank, "baseline_mib": round(b / 1024, 1),
                       "end_mib": round(e / 1024, 1), "growth_pct": round(100 * (e - b) / b, 3),
                       "peak_mib": round(max(s["rss_kib"][rank] for s in training) / 1024, 1),
                       "samples": [len(base), len(end)]})
    ef = [(r["step"], r.get("ef_norm")) for r in run.metrics if "ef_norm" in r]
    ef_result: dict[str, Any]
    if not ef:
        ef_result = {"logged": False}
    else:
        values = [v for _, v in ef]
        finite = all(v is not None and math.isfinite(v) for v in values)
        half = steps // 2
        mid = [v for s, v in ef if half <= s < half + 250 and v is not None]
        end = [v for s, v in ef if s >= steps - 250 and v is not None]
        rise = statistics.median(end) - statistics.median(mid)
        noise = max(_iqr(mid), _iqr(end))
        quarters = [statistics.median(v for s, v in ef if q * steps // 4 <= s < (q + 1) * steps // 4
                                      and v is not None) for q in range(4)]
        ef_result = {"logged": True, "finite": finite,
                     "median_by_quarter": [round(q, 3) for q in quarters],
                     "median_mid": round(statistics.median(mid), 4),
                     "median_end": round(statistics.median(end), 4),
                     "rise": round(rise, 4), "noise_iqr": round(noise, 4),
                     "rise_pct": round(100 * rise / statistics.median(mid), 2),
                     "bounded": bool(finite and rise <= noise)}
    growth = [m.get("growth_pct") for m in memory]
    return {
        "compressor": name, "overrides": overrides, "wall_s": round(wall, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "steps_logged": len(run.metrics), "final_loss": run.last("loss"),
        "memory": memory,
        "memory_ok": all(g is not None and g < 2.0 for g in growth),
        "step_time": {"median_first_ms": round(1000 * med_first, 2),
                      "median_last_ms": round(1000 * med_last, 2),
                      "iqr_first_ms": round(1000 * _iqr(first), 2),
                      "iqr_last_ms": round(1000 * _iqr(last), 2),
                      "drift_ms": round(1000 * drift, 2),
                      "drift_pct": round(100 * drift / med_first, 2),
                      "beyond_noise": abs(drift) > noise},
        "ef_norm": ef_result,
        "series": {"samples": samples,
                   "step_s": [[s, round(v, 5)] for s, v in sorted(step_s.items())],
                   "ef_norm": [[s, v] for s, v in ef]},
    }


def plot(results: list[dict[str, Any]], path: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for r in results:
        samples = [s for s in r["series"]["samples"] if s["step"] < steps - 2]
        base = [m.get("baseline_mib") for m in r["memory"]]
        if samples and base[0]:
            axes[0].plot([s["step"] for s in samples],
                         [100 * (s["rss_kib"][0] / 1024 - base[0]) / base[0] for s in samples],
                         label=r["compressor"], lw=1)
        st = r["series"]["step_s"]
        window = 25
        xs = [s for s, _ in st][window:]
        ys = [1000 * statistics.median(v for _, v in st[i - window:i]) for i in range(window, len(st))]
        axes[1].plot(xs, ys, lw=1, label=r["compressor"])
        ef = [(s, v) for s, v in r["series"]["ef_norm"] if v is not None]
        if ef:
            axes[2].plot([s for s, _ in ef], [v for _, v in ef], lw=1, label=r["compressor"])
    axes[0].axhline(2.0, color="k", ls="--", lw=0.8)
    axes[0].set_ylabel("rank 0 RSS vs steps 200-400 (%)")
    axes[1].set_ylabel("step time, running median of 25 (ms)")
    axes[2].set_ylabel("error-feedback norm")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.axvspan(1, 200, color="0.9")
        ax.axvspan(steps - 200, steps, color="0.9")
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=4, fontsize=8)
    fig.suptitle(f"Soak: 2 gloo ranks x {steps} steps, CPU (shaded: the compared windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rejudge(args) -> int:
    """Judge again the runs of an earlier invocation (its report in --out, its runs and
    samples in WORK), keeping what was measured then: wall time, load averages."""
    from repro import launch, runs

    path = os.path.join(args.out, f"{args.report}.json")
    with open(path) as f:
        report = json.load(f)
    results = []
    for old in report["results"]:
        name = old["compressor"]
        with open(os.path.join(args.rejudge, f"{name}.series.json")) as f:
            series = json.load(f)
        run_dir = old.get("run_dir") or launch.plan(old["overrides"], multirun=False,
                                                    on_change="restart")[0].run_dir
        args.steps = int(next(o for o in old["overrides"] if o.startswith("steps="))[6:])
        r = judge(name, runs.load_run(run_dir), series["samples"], old["wall_s"],
                  old["load_average_before"], old["load_average_after"], old["overrides"], args)
        r["run_dir"] = run_dir
        results.append(r)
    report["rejudged"] = "python benchmarks/reliability/soak.py " + " ".join(sys.argv[1:])
    report["results"] = [{k: v for k, v in x.items() if k != "series"} for x in results]
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    plot(results, os.path.join(args.out, f"{args.report}.png"), args.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", default=",".join(FAMILIES),
                   help=f"from {', '.join(FAMILIES)} (default: all)")
    p.add_argument("--task", default="cifar10_resnet20")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=1.0, help="seconds between RSS samples")
    p.add_argument("--out", default=None, help="folder for the report")
    p.add_argument("--report", default="soak", help="report files: REPORT.json, REPORT.png")
    p.add_argument("--work", default=None, help="runs folder (default: a temp folder)")
    p.add_argument("--rejudge", default=None, metavar="WORK",
                   help="recompute the report in --out from the runs and samples an earlier "
                        "invocation left in WORK (no training)")
    args = p.parse_args(argv)
    if args.rejudge:
        return rejudge(args)
    if args.steps < 800:
        p.error("--steps must be at least 800 (the windows are steps 1-200, 200-400 and the last 200)")
    names = [c for c in args.compressors.split(",") if c]
    for c in names:
        if c.split("+")[0] not in FAMILIES:
            p.error(f"--compressors: {c!r} is not one of {', '.join(FAMILIES)}")
    work = args.work or tempfile.mkdtemp(prefix="soak-")
    results = []
    for name in names:
        r = soak_one(name, args, work)
        results.append(r)
        with open(os.path.join(work, f"{name}.series.json"), "w") as f:
            json.dump(r["series"], f)
        m, t, e = r["memory"], r["step_time"], r["ef_norm"]
        print(f"{name:9s} rss growth {[x.get('growth_pct') for x in m]} % | step "
              f"{t['median_first_ms']} -> {t['median_last_ms']} ms (IQR {t['iqr_first_ms']}/"
              f"{t['iqr_last_ms']}) beyond noise: {t['beyond_noise']} | ef "
              f"{e.get('median_by_quarter')} rise {e.get('rise')} vs noise {e.get('noise_iqr')} "
              f"bounded: {e.get('bounded')} | {r['wall_s']} s, load "
              f"{r['load_average_before'][0]}->{r['load_average_after'][0]}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            report = {"command": "python benchmarks/reliability/soak.py " + " ".join(sys.argv[1:]),
                      "cpus": os.cpu_count(), "work": work,
                      "results": [{k: v for k, v in x.items() if k != "series"} for x in results]}
            with open(os.path.join(args.out, f"{args.report}.json"), "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
            plot(results, os.path.join(args.out, f"{args.report}.png"), args.steps)
    ok = all(r["memory_ok"] and not r["step_time"]["beyond_noise"]
             and r["ef_norm"].get("bounded", True) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
