"""Encode and decode times of two revisions of the whole package, alternated in separate
processes.

    python benchmarks/kernels/bench_revisions_ab.py --old-rev HEAD~1 [--new-rev HEAD]
        [--compressor sidco_e,sidco_gp,sidco_p] [--numel 26M] [--steps 23] [--rounds 3]
        [--json FILE]

Each revision is checked out into a temporary git worktree, and each round runs one process
per revision (the order alternating from round to round) that builds or loads that
revision's library, compresses the same Laplace tensor with a single-worker Session per
compressor (no error feedback, no NaN/Inf check, as `repro bench` times encoders) and
reports the median encode and decode times of the steps after the first three, with the
floor (a sum of a precomputed |x|) timed between the steps. At the end, per compressor, the
new/old ratio of each median: its median over the rounds and its range."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from repro.bench import parse_size

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[4]))
import compressors
from compressors import Session
from repro import sources
from repro.bench import exchange_once
x = sources.synthetic("laplace", int(sys.argv[2]), 1, 0, 0)[0]
magnitudes, dest = x.abs(), torch.empty_like(x)
steps, out = int(sys.argv[3]), {}
for name in sys.argv[1].split(","):
    session = Session(compressors.build(name, ratio=0.001), rank=0, world_size=1,
                      feedback="none", seed=0, check_finite=False, measure=False)
    encode, decode, floor = [], [], []
    for step in range(steps):
        _, seconds, back = exchange_once(session, x, step, out=dest)
        t0 = time.perf_counter()
        torch.sum(magnitudes)
        floor.append(time.perf_counter() - t0)
        if step >= 3:
            encode.append(seconds)
            decode.append(back)
    out[name] = {"encode_ms": 1e3 * statistics.median(encode),
                 "decode_ms": 1e3 * statistics.median(decode),
                 "floor_ms": 1e3 * statistics.median(floor)}
print(json.dumps(out))
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-rev", required=True)
    parser.add_argument("--new-rev", default="HEAD")
    parser.add_argument("--compressor", default="sidco_e,sidco_gp,sidco_p")
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.steps < 4 or args.rounds < 1:
        raise SystemExit("--steps must be at least 4 (three are warm-up) and --rounds at least 1")
    revs = {"old": git("rev-parse", "--short", args.old_rev),
            "new": git("rev-parse", "--short", args.new_rev)}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for key, rev in revs.items():
            trees[key] = Path(tmp) / key
            git("worktree", "add", "--detach", str(trees[key]), rev)
        try:
            print(f"old = {revs['old']}, new = {revs['new']}; {args.threads} threads, "
                  f"{args.numel} float32 elements, medians of {args.steps - 3} steps")
            for r in range(args.rounds):
                row = {}
                for key in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    done = subprocess.run(
                        [sys.executable, "-c", CHILD, args.compressor,
                         str(parse_size(args.numel)), str(args.steps), str(args.threads)],
                        cwd=trees[key], env={**os.environ, "PYTHONPATH": str(trees[key])},
                        check=True, capture_output=True, text=True)
                    row[key] = json.loads(done.stdout.strip().splitlines()[-1])
                rounds.append(row)
                print(f"round {r + 1}: " + "; ".join(
                    f"{name} encode {row['old'][name]['encode_ms']:.2f} -> "
                    f"{row['new'][name]['encode_ms']:.2f} ms, decode "
                    f"{row['old'][name]['decode_ms']:.2f} -> {row['new'][name]['decode_ms']:.2f}"
                    f" ms (floor {row['old'][name]['floor_ms']:.2f} / "
                    f"{row['new'][name]['floor_ms']:.2f})"
                    for name in row["old"]), flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               capture_output=True, check=False)
    summary = {}
    for name in rounds[0]["old"]:
        summary[name] = {}
        for what in ("encode_ms", "decode_ms"):
            ratios = sorted(row["new"][name][what] / row["old"][name][what] for row in rounds)
            summary[name][what.replace("_ms", "_new_over_old")] = {
                "median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1]}
            print(f"{name} {what[:6]} new/old: median {ratios[len(ratios) // 2]:.3f} "
                  f"(range {ratios[0]:.3f}-{ratios[-1]:.3f} over {len(ratios)} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({**revs, "threads": args.threads,
                                               "summary": summary,
                                               "numel": parse_size(args.numel),
                                               "steps": args.steps, "rounds": rounds},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
