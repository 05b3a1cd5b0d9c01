"""Device time of DRAGONN's and DGC's CUDA parts (CUDA events, medians of 30) and the wall
time of each with a synchronisation after it (what repro bench sees), with a sweep of the
fused DRAGONN kernel's shape (FUSED_BLOCK, FUSED_WARPS, FUSED_CHUNK; each variant checked
against write_slots). Needs a CUDA device and Triton; run from the repository root:

    python scripts/bench_gpu_parts.py OUT.json        (SIZES=26000000,128000000 by default)

DEV=cpu with TRITON_INTERPRET=1 (and small SIZES) is a dry run of the script on the CPU:
one call per step under Triton's interpreter, wall time only.

results/bench/tenth-session-gpu/parts-cuda-events.json is one run (H100, torch 2.11; that
run also timed a radix-select sample threshold, since reverted: see results/bench/README.md).
"""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from compressors import _native, dragonn  # noqa: E402
from compressors._native import gpu  # noqa: E402
from compressors.dgc import sample_threshold  # noqa: E402


DEV = os.environ.get("DEV", "cuda")
SIZES = [int(v) for v in os.environ.get("SIZES", "26000000,128000000").split(",")]


def laplace(n, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    u = torch.rand(n, generator=g, device=DEV, dtype=torch.float32) - 0.5
    return -u.sign() * torch.log1p(-2 * u.abs()) * 1e-3


def ev(fn, reps=30):
    """(median device ms by CUDA events, median wall ms with a synchronisation after)."""
    if DEV == "cpu":  # the dry run: one call, wall time only
        w0 = time.perf_counter()
        fn()
        return 0.0, (time.perf_counter() - w0) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts, ws = [], []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        w0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ws.append((time.perf_counter() - w0) * 1e3)
        ts.append(s.elapsed_time(e))
    return round(statistics.median(ts), 4), round(statistics.median(ws), 4)


out = {}
assert _native.supports(laplace(10))
for n in SIZES:
    x = laplace(n, seed=n % 97)
    a = x.abs()
    k = int(n * 0.001)
    m = 4 * k
    layout = dragonn.priority_layout(n)
    gen = torch.Generator(device=DEV).manual_seed(1)
    t = sample_threshold(x, 0.001, k, 0.01, 10, gen).reshape(1)
    seeds = dragonn.draw_hash_seeds(gen, DEV)
    seeds_int = tuple(seeds.tolist())
    r = {"floor": ev(lambda: torch.sum(a)),
         "sample_threshold": ev(lambda: sample_threshold(x, 0.001, k, 0.01, 10, gen))}
    tf = float(t)
    r["select_float_t"] = ev(lambda: gpu.select(x, tf))
    r["select_device_t"] = ev(lambda: gpu.select(x, t))
    r["select_values_device_t"] = ev(lambda: gpu.select(x, t, values=True))
    keys = gpu.select(x, tf)[0]
    r["candidates"] = keys.numel()
    r["two_step_slots"] = ev(lambda: gpu.dragonn_slots(gpu.select(x, tf)[0], m, *layout,
                                                       seeds_int, x))
    ref = dragonn.write_slots(keys, m, seeds, n)
    defaults = gpu.FUSED_CHUNK, gpu.FUSED_BLOCK, gpu.FUSED_WARPS
    for block in (2048, 4096, 8192):
        for warps in (4, 8):
            for chunk in (128, 256, 512, 1024):
                gpu.FUSED_CHUNK, gpu.FUSED_BLOCK, gpu.FUSED_WARPS = chunk, block, warps
                slots, vals, found = gpu.dragonn_encode(x, t, m, *layout, seeds)
                assert torch.equal(slots, ref) and int(found[0]) == keys.numel(), chunk
                r[f"fused_b{block}_w{warps}_c{chunk}"] = ev(
                    lambda: gpu.dragonn_encode(x, t, m, *layout, seeds))[0]
    gpu.FUSED_CHUNK, gpu.FUSED_BLOCK, gpu.FUSED_WARPS = defaults
    r["topk_sample"] = ev(lambda: torch.topk(a[: n // 100], n // 100 // 1000).values.min())
    out[n] = r
    print(n, json.dumps(r), flush=True)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_parts.json", "w"),
          indent=1)
