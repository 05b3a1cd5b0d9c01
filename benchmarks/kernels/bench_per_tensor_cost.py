"""The fixed cost of a layer-wise exchange per parameter tensor: one step of
WorkerCompression.layerwise on a torchvision model's parameter shapes, every tensor
shrunk by --shrink (so the arithmetic is small beside the per-tensor work: Python,
dispatch, the bookkeeping of an exchange), its gradients views of one flat buffer as a
DDP bucket hands them, on --workers simulated workers answered in memory. Each
compressor runs batched (CompressionOptions.batch, the default) and one exchange per
tensor (batch=False), alternated in every round; the report is the median µs per tensor
and worker of each, and the ratio batched / per tensor: its median and range over the
rounds.

    python benchmarks/kernels/bench_per_tensor_cost.py [--model resnet50] [--shrink 1000]
        [--compressor topk,dgc,sidco_e,gaussianksgd] [--ratio 0.01] [--rounds 7]
        [--steps 5] [--json FILE]

This is the cost a GPU pays on its host for every tensor of every step (there, the
arithmetic is on the device); on the CPU it adds to the arithmetic."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torchvision

import compressors
from compressors.simulated import drive
from repro.compression import WorkerCompression


def _shapes(model: str, shrink: int) -> list[int]:
    params = torchvision.models.get_model(model).parameters()
    return [max(1, p.numel() // shrink) for p in params]


def _step(workers, sizes, step: int, bucket: list[torch.Tensor]) -> float:
    for r, flat in enumerate(bucket):  # fresh gradients, outside the timing
        flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(step + r)))
    named = [[(f"p{i}", t) for i, t in enumerate(flat.split(sizes))] for flat in bucket]
    t0 = time.perf_counter()
    jobs = [w.layerwise(n, step, buffer=flat) for w, n, flat in zip(workers, named, bucket)]
    for (_, finish), result in zip(jobs, drive([job for job, _ in jobs])):
        finish(result)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--shrink", type=int, default=1000)
    ap.add_argument("--compressor", default="topk,dgc,sidco_e,gaussianksgd")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = _shapes(args.model, args.shrink)
    report = {"model": args.model, "tensors": len(sizes), "shrink": args.shrink,
              "elements": sum(sizes), "workers": args.workers, "compressors": {}}
    print(f"{args.model}: {len(sizes)} tensors shrunk {args.shrink}× ({sum(sizes)} elements), "
          f"{args.workers} simulated workers, {args.rounds} rounds × {args.steps} steps")
    for name in args.compressor.split(","):
        params = {"ratio": args.ratio} if "ratio" in compressors.default_params(name) else {}
        arms = {}
        for batch in (True, False):
            comp = compressors.build(name, **params)
            workers = [WorkerCompression(comp, r, args.workers, granularity="layer", batch=batch)
                       for r in range(args.workers)]
            bucket = [torch.empty(sum(sizes)) for _ in range(args.workers)]
            _step(workers, sizes, 0, bucket)  # warm-up: states, workspaces
            arms[batch] = (workers, bucket)
        per_round = {True: [], False: []}
        step = 1
        for _ in range(args.rounds):
            for batch, (workers, bucket) in arms.items():
                times = [_step(workers, sizes, step + i, bucket) for i in range(args.steps)]
                per_round[batch].append(statistics.median(times))
            step += args.steps
        us = {b: 1e6 * statistics.median(t) / len(sizes) / args.workers
              for b, t in per_round.items()}
        ratios = sorted(a / b for a, b in zip(per_round[True], per_round[False]))
        report["compressors"][name] = {
            "batched_us_per_tensor": us[True], "per_tensor_us_per_tensor": us[False],
            "ratio_median": statistics.median(ratios), "ratio_min": ratios[0],
            "ratio_max": ratios[-1]}
        print(f"{name:14s} batched {us[True]:6.0f} µs/tensor, one exchange per tensor "
              f"{us[False]:6.0f} µs/tensor: × {statistics.median(ratios):.2f} "
              f"(rounds {ratios[0]:.2f}–{ratios[-1]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
