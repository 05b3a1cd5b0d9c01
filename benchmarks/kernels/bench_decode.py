"""Side by side in one process: where the aggregate is decoded.

    python benchmarks/kernels/bench_decode.py [--numel 26M] [--threads 2] [--repeats 9]
                                   [--compressor topk,dgc,dragonn,sidco_e]

1. One DDP-hook step of a compressor on one tensor (WorkerCompression.layerwise, world
   size 1, residual error feedback, δ = 0.001 where it takes a ratio, the gradient
   refilled before each step, outside the timing): the aggregate decoded into the
   gradient itself (Session.exchange's `out`, what the hook does) against a new
   dense tensor per step copied into the gradient afterwards. Timed
   alternately; medians in ms.
2. Batched sparse decoding of K ranks' k pairs (δ = 0.001) into a preallocated tensor:
   the native one-sweep kernel (ops.scatter_mean) against torch's zero_, index_add_
   and div_ (the same bits). Medians in ms; their ratio and each path's K = 8 / K = 2."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import compressors
from compressors import drive
from compressors.kernels import ops
from compressors.base import index_dtype, sparse_mean, target_k
from repro import bench, sources
from repro.hooks import WorkerCompression


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def hook_step(name: str, x: torch.Tensor, grad: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(into the gradient, new tensor + copy) medians of one layerwise step, in ms."""
    workers = {}
    for mode in ("into", "copy"):
        params = {"ratio": 0.001} if "ratio" in compressors.default_params(name) else {}
        worker = WorkerCompression(compressors.build(name, **params), rank=0,
                                   world_size=1, feedback="residual")
        if mode == "copy":  # the previous hook: no destination given, copy in _finish
            sess = worker.session_for("g")
            real = sess.exchange
            sess.exchange = lambda *a, _real=real, **k: _real(*a, **{**k, "out": None})
        workers[mode] = worker
    times = {"into": [], "copy": []}
    for rep in range(repeats + 1):
        for mode, worker in workers.items():
            grad.copy_(x)
            t0 = time.perf_counter()
            job, finish = worker.layerwise([("g", grad)], rep)
            finish(drive([job])[0])
            if rep:  # the first call warms up (feedback buffers, scratch)
                times[mode].append(time.perf_counter() - t0)
    return _median_ms(times["into"]), _median_ms(times["copy"])


def decode_paths(n: int, workers: int, repeats: int, out: torch.Tensor) -> tuple[float, float]:
    """(native, torch) medians of one batched decode of `workers` ranks' payloads, in ms."""
    k = target_k(n, 0.001)
    idx, val = bench.sparse_payloads(n, k, workers, seed=workers)
    assert idx[0].dtype == index_dtype(n)
    cat_idx, cat_val = torch.cat(idx), torch.cat(val)
    times = {"native": [], "torch": []}
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        sparse_mean(idx, val, n, workers, torch.float32, out=out)
        t1 = time.perf_counter()
        out.zero_().index_add_(0, torch.cat(idx), torch.cat(val))
        if workers > 1:
            out.div_(workers)
        t2 = time.perf_counter()
        if rep:
            times["native"].append(t1 - t0)
            times["torch"].append(t2 - t1)
    check = torch.zeros(n).index_add_(0, cat_idx, cat_val)
    if workers > 1:
        check.div_(workers)
    if not torch.equal(sparse_mean(idx, val, n, workers, torch.float32, out=out), check):
        raise SystemExit("the native decode differs from torch's: report this")
    return _median_ms(times["native"]), _median_ms(times["torch"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--compressor", default="topk,dgc,dragonn,sidco_e")
    args = parser.parse_args()
    if not ops.available():
        raise SystemExit(f"the native kernels are not available: {ops.error()}")
    n = bench.parse_size(args.numel)
    torch.set_num_threads(args.threads)
    x = sources.synthetic("laplace", n, 1, 0, 0)[0]  # repro bench's default source
    grad = torch.empty_like(x)
    print(f"{n} float32 elements, {args.threads} threads, medians of {args.repeats} (ms)")
    print("1. one hook step (layerwise, residual feedback, δ = 0.001 where it applies)")
    print(f"{'compressor':>12} {'into grad':>10} {'new+copy':>9} {'ratio':>6}")
    for name in args.compressor.split(","):
        into, copy = hook_step(name, x, grad, args.repeats)
        print(f"{name:>12} {into:10.2f} {copy:9.2f} {copy / into:6.2f}")
    print("2. batched sparse decoding into a preallocated tensor (δ = 0.001)")
    print(f"{'K':>3} {'native':>8} {'torch':>8} {'ratio':>6}")
    rows = {}
    for workers in (2, 8):
        rows[workers] = decode_paths(n, workers, args.repeats, grad)
        native, plain = rows[workers]
        print(f"{workers:>3} {native:8.2f} {plain:8.2f} {plain / native:6.2f}")
    print(f"K = 8 / K = 2: native {rows[8][0] / rows[2][0]:.2f}, torch {rows[8][1] / rows[2][1]:.2f}")


if __name__ == "__main__":
    main()
