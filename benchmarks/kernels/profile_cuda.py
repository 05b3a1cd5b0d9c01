"""Where a compressor's encode spends its time on a GPU: torch.profiler over a few
single-worker exchanges (after warm-up), the kernels by device time, the host-side
synchronisations (cudaStreamSynchronize, cudaMemcpy*, cudaEventSynchronize) and the
launches per exchange, next to the exchange's wall time and the one-read floor.

    python benchmarks/kernels/profile_cuda.py --compressor sidco_e,thc --size 128M
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

import compressors
from compressors.session import Session
from repro.bench import accepts_ratio, cell_params, exchange_once, parse_size, split_list, timed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="sidco_e,thc")
    p.add_argument("--size", default="128M")
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(parse_size(a.size), device=dev, generator=gen)
    floor = min(timed(lambda: torch.sum(x.abs()), dev) for _ in range(9)) * 1e3
    out = {"floor_ms_abs_sum": floor, "compressors": {}}
    print(f"d = {x.numel():,}; |x|.sum() incl. abs {floor:.3f} ms")
    dest = torch.empty_like(x)
    for name in split_list(a.compressor):
        params = cell_params(name, a.ratio if accepts_ratio(name) else None, x, {})
        session = Session(compressors.build(name, **params), rank=0, world_size=1,
                          feedback="none", seed=0, check_finite=False, measure=False)
        for step in range(5):
            exchange_once(session, x, step, out=dest)
        walls = []
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for step in range(5, 5 + a.steps):
                _, enc, dec = exchange_once(session, x, step, out=dest)
                walls.append((enc * 1e3, dec * 1e3))
        events = prof.key_averages()
        syncs = Counter()
        launches = 0
        for e in events:
            k = e.key
            if k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") \
                    or k.startswith("cudaMemcpy"):
                syncs[k] += e.count
            if k in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
                launches += e.count
        rows = sorted((e for e in events if getattr(e, "device_time_total", 0) > 0),
                      key=lambda e: -e.device_time_total)[:a.rows]
        print(f"\n=== {name} {params}: encode/decode ms per exchange (profiled) "
              + ", ".join(f"{e:.3f}/{d:.3f}" for e, d in walls))
        print("host syncs per exchange: " + ", ".join(f"{k} {v / a.steps:.1f}" for k, v in syncs.items())
              + f"; launches per exchange {launches / a.steps:.1f}")
        table = []
        for e in rows:
            table.append({"kernel": e.key[:110], "calls": e.count / a.steps,
                          "device_ms": e.device_time_total / 1e3 / a.steps})
            print(f"  {e.device_time_total / 1e3 / a.steps:8.3f} ms  x{e.count / a.steps:5.1f}  {e.key[:110]}")
        # Unprofiled wall times for scale.
        t = []
        for step in range(10, 17):
            _, enc, dec = exchange_once(session, x, step, out=dest)
            t.append(enc * 1e3)
        t.sort()
        print(f"unprofiled encode median {t[len(t) // 2]:.3f} ms ({t[len(t) // 2] / floor:.1f}x floor)")
        out["compressors"][name] = {"params": {k: v for k, v in params.items() if isinstance(v, (int, float, str))},
                                    "encode_ms": t[len(t) // 2], "syncs": dict(syncs),
                                    "launches": launches / a.steps, "kernels": table}
        del session
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
