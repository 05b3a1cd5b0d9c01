"""One DDP-hook step per compressor, its default error feedback, on one large tensor:
the compression work of a step (WorkerCompression.layerwise, the gradient passed as the
decode's destination, as the hook does), with collectives answered as one rank answers
them (as in repro bench), so that the compressor's own work and allocations are timed.

    python benchmarks/kernels/bench_hook_step.py [--numel 26M] [--threads 2] [--repeats 9]
        [--compressor none,fp16,qsgd,terngrad,signsgd,efsignsgd,thc,thc_uniform,powersgd]
        [--json FILE]

The tensor is a matrix (rows × cols, about numel elements; PowerSGD compresses it), the
gradient is refilled before each step outside the timing, and the first step warms up
(feedback buffers, scratch). Medians in ms. To compare two versions of the suite side by
side, run this file from each checkout alternately (PYTHONPATH=<checkout>); the output
names the checkout it imported."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import compressors
from compressors.simulated import drive_one
from repro import sources
from repro.bench import answer_alone, parse_size
from repro.hooks import WorkerCompression

DEFAULT = "none,fp16,qsgd,terngrad,signsgd,efsignsgd,thc,thc_uniform,powersgd"


def hook_step(name: str, x: torch.Tensor, repeats: int) -> float:
    """Median ms of one layerwise step of `name` (default feedback) on a copy of x."""
    params = {"ratio": 0.001} if "ratio" in compressors.default_params(name) else {}
    worker = WorkerCompression(compressors.build(name, **params), rank=0, world_size=1)
    grad = torch.empty_like(x)
    times = []
    for step in range(repeats + 1):
        grad.copy_(x)
        t0 = time.perf_counter()
        job, finish = worker.layerwise([("g", grad)], step)
        finish(drive_one(job, answer_alone))
        if step:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--compressor", default=DEFAULT)
    parser.add_argument("--json", default=None, help="also write the medians here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = parse_size(args.numel)
    rows = 2 ** round(math.log2(math.sqrt(n)))
    cols = max(1, n // rows)
    x = sources.synthetic("laplace", rows * cols, 1, 0, 0)[0].view(rows, cols)
    print(f"{compressors.__file__}: {rows}×{cols} float32, {args.threads} threads, "
          f"medians of {args.repeats} (ms)")
    result = {}
    for name in args.compressor.split(","):
        result[name] = hook_step(name, x, args.repeats)
        print(f"{name:>12} {result[name]:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": rows * cols, "threads": args.threads,
                       "repeats": args.repeats, "module": compressors.__file__,
                       "median_ms": result}, f, indent=1)


if __name__ == "__main__":
    main()
