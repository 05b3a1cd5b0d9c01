"""Encode and decode times of two revisions of the whole package, side by side: one
long-lived process per revision, the two called in turn, step by step.

    python benchmarks/kernels/bench_revisions_ab.py --old-rev HEAD~1 [--new-rev HEAD]
        [--compressor all | sidco_e,sidco_gp,...] [--numel 26M] [--ratio 0.001]
        [--rounds 40] [--threads 2] [--bound 0.05] [--json FILE]

Each revision is checked out into a temporary git worktree and served by one process that
builds or loads that revision's library, draws the same Laplace tensor and builds one
single-worker Session per compressor (no error feedback, no NaN/Inf check, as `repro
bench` times encoders; a fixed-threshold compressor gets the λ that keeps the ratio of
this tensor). After three warm-up exchanges per compressor on each side, every round
runs one exchange per compressor on each side, old and new back to back (which goes
first alternates from round to round, the compressors' order rotates), so a slow spell
of a shared machine hits both sides of a pair alike. Both processes run with
OMP_WAIT_POLICY=PASSIVE, so the waiting one's threads do not spin on the cores the other
is using.

Per compressor and per encode / decode: the new/old ratio of each round's pair, its
median over the rounds with the 10-90% spread, and a 90% bootstrap interval of that
median (resampled rounds). The verdict: "within bound" when the interval's upper end is
at most 1 + bound, "slower" when its lower end is above 1 + bound, else "unsettled"
(more rounds or a quieter machine would decide it)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from repro.bench import parse_size, percentile, split_list

ROOT = Path(__file__).resolve().parent.parent.parent

# The server side: one line of names in, one JSON line of {name: [encode_s, decode_s]} out.
# It uses only what both revisions have: compressors.build/default_params/list_compressors,
# Session, repro.sources.synthetic and repro.bench.exchange_once.
SERVER = r"""
import json, sys
import torch
torch.set_num_threads(int(sys.argv[3]))
import compressors
from compressors import Session
from repro import sources
from repro.bench import exchange_once
numel, ratio = int(sys.argv[1]), float(sys.argv[2])
x = sources.synthetic("laplace", numel, 1, 0, 0)[0]
dest = torch.empty_like(x)
k = max(1, round(ratio * numel))
lam = float(x.abs().flatten().kthvalue(numel - k + 1).values)
sessions, steps = {}, {}
def session(name):  # built at the name's first call (a warm-up call)
    if name not in sessions:
        defaults = compressors.default_params(name)
        params = {"ratio": ratio} if "ratio" in defaults else {}
        if "lam" in defaults:
            params["lam"] = lam
        sessions[name] = Session(compressors.build(name, **params), rank=0, world_size=1,
                                 feedback="none", seed=0, check_finite=False, measure=False)
        steps[name] = 0
    return sessions[name]
def call(name):
    _, enc, dec = exchange_once(session(name), x, steps[name], out=dest)
    steps[name] += 1
    return [enc, dec]
print(json.dumps({"ready": sorted(compressors.list_compressors())}), flush=True)
for line in sys.stdin:
    print(json.dumps({name: call(name) for name in line.split()}), flush=True)
"""

WARMUP = 3


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


class Server:
    """One revision's process: call(names) runs one exchange of each, in that order."""

    def __init__(self, tree: Path, numel: int, ratio: float, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE",
               "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(numel), str(ratio), str(threads)], cwd=tree, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.registered = self._read()["ready"]

    def _read(self) -> dict:
        while True:  # past anything else the library prints (a native build's messages)
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a benchmark process exited (code {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def call(self, names: list[str]) -> dict[str, list[float]]:
        self.proc.stdin.write(" ".join(names) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def bootstrap_median(ratios: list[float], draws: int = 2000, seed: int = 0
                     ) -> tuple[float, float]:
    """90% interval of the median of `ratios` over resampled rounds."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(draws))
    return percentile(medians, 5), percentile(medians, 95)


def verdict(low: float, high: float, bound: float) -> str:
    if high <= 1 + bound:
        return "within bound"
    if low > 1 + bound:
        return "slower"
    return "unsettled"


def summarise(pairs: dict[str, list[dict[str, list[float]]]], bound: float) -> dict:
    out = {}
    for name, rows in pairs.items():
        out[name] = {}
        for i, what in enumerate(("encode", "decode")):
            ratios = [row["new"][i] / row["old"][i] for row in rows]
            low, high = bootstrap_median(ratios)
            out[name][what] = {
                "old_ms": 1e3 * statistics.median(row["old"][i] for row in rows),
                "new_ms": 1e3 * statistics.median(row["new"][i] for row in rows),
                "ratio_median": statistics.median(ratios),
                "ratio_p10": percentile(ratios, 10), "ratio_p90": percentile(ratios, 90),
                "median_ci90": [low, high], "verdict": verdict(low, high, bound)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-rev", required=True)
    parser.add_argument("--new-rev", default="HEAD")
    parser.add_argument("--compressor", default="all",
                        help="comma list, or 'all' (every compressor both revisions have)")
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--bound", type=float, default=0.05,
                        help="the slow-down a verdict is about (0.05: 5%%)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.rounds < 5:
        raise SystemExit("--rounds must be at least 5 (the bootstrap interval needs rounds)")
    if not 0 < args.ratio < 1:
        raise SystemExit(f"--ratio {args.ratio} must lie in (0, 1)")
    numel = parse_size(args.numel)
    revs = {"old": git("rev-parse", "--short", args.old_rev),
            "new": git("rev-parse", "--short", args.new_rev)}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {key: Path(tmp) / key for key in revs}
        for key, rev in revs.items():
            git("worktree", "add", "--detach", str(trees[key]), rev)
        servers: dict[str, Server] = {}
        try:
            wanted = [] if args.compressor == "all" else split_list(args.compressor)
            servers = {key: Server(trees[key], numel, args.ratio, args.threads)
                       for key in revs}
            both = sorted(set(servers["old"].registered) & set(servers["new"].registered))
            unknown = [n for n in wanted if n not in both]
            if unknown:
                raise SystemExit(f"not in both revisions: {', '.join(unknown)}; "
                                 f"choose from: {', '.join(both)}")
            names = [n for n in (wanted or both) if n != "none"]
            print(f"old = {revs['old']}, new = {revs['new']}; {args.threads} threads, "
                  f"{numel} float32 elements, ratio {args.ratio}, {len(names)} compressors, "
                  f"{args.rounds} rounds", flush=True)
            for _ in range(WARMUP):
                for server in servers.values():
                    server.call(names)
            pairs: dict[str, list[dict[str, list[float]]]] = {n: [] for n in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                sides = ("old", "new") if r % 2 == 0 else ("new", "old")
                for name in order:
                    got = {side: servers[side].call([name])[name] for side in sides}
                    pairs[name].append(got)
                if (r + 1) % 10 == 0:
                    print(f"{r + 1} rounds done", flush=True)
        finally:
            for server in servers.values():
                server.close()
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               capture_output=True, check=False)
    summary = summarise(pairs, args.bound)
    for name, row in summary.items():
        for what, s in row.items():
            print(f"{name:15s} {what}: {s['old_ms']:8.3f} -> {s['new_ms']:8.3f} ms, new/old "
                  f"median {s['ratio_median']:.3f} (p10-p90 {s['ratio_p10']:.3f}-"
                  f"{s['ratio_p90']:.3f}; 90% interval of the median "
                  f"{s['median_ci90'][0]:.3f}-{s['median_ci90'][1]:.3f}): {s['verdict']}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**revs, "threads": args.threads, "numel": numel, "ratio": args.ratio,
             "rounds": args.rounds, "bound": args.bound, "summary": summary,
             "pairs": pairs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
