"""Side by side in one process: the native selection's two layouts at several kept
fractions.

    python benchmarks/kernels/bench_select_layout.py [--numel 26M] [--threads 2] [--repeats 11]

For each fraction f, |x| ≥ ln(1/f) on a Laplace(1) tensor keeps about f of it; the
skipping layout (no hint) and the branch-free one (reserve = the whole tensor) are timed
alternately, with the one-read-pass floor (torch.sum of a precomputed |x|) between them.
Medians in ms."""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from compressors.kernels import ops
from repro.bench import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    if not ops.available():
        raise SystemExit(f"the native kernels are not available: {ops.error()}")
    n = parse_size(args.numel)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    x = (-u.sign() * torch.log1p(-2 * u.abs())).float()
    ax = x.abs()
    print(f"{n} float32 elements, {args.threads} threads, medians of {args.repeats} (ms)")
    print(f"{'kept':>6} {'values':>6} {'floor':>7} {'skipping':>9} {'branch-free':>12} ratio")
    for frac in (0.1, 0.05, 0.02, 0.01, 0.005, 0.001):
        t = -math.log(frac)
        for values in (False, True):
            calls = {"floor": lambda: torch.sum(ax),
                     "skip": lambda: ops.select(x, t, values=values),
                     "dense": lambda: ops.select(x, t, values=values, reserve=n)}
            times = {name: [] for name in calls}
            for fn in calls.values():
                fn()
            for _ in range(args.repeats):
                for name, fn in calls.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(1e3 * (time.perf_counter() - start))
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"{frac:>6} {values!s:>6} {med['floor']:7.2f} {med['skip']:9.2f} "
                  f"{med['dense']:12.2f} {med['skip'] / med['dense']:.2f}")


if __name__ == "__main__":
    main()
