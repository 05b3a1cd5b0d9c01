"""SIDCo's CUDA paths side by side: the stages driven from the host (a copy to the host
after every stage: sidco._select_host), the stages with their thresholds kept on the
device (one copy at the end: sidco._select_device, compressors/_native/gpu_sidco.py)
without the speculative first read ("plain") and with it ("device": one read of acc once
the previous steps' thresholds are known; the same gradient every call, so the guess
holds). Rounds in one process on the same gradient, the paths' order rotated; per round
the median wall time of `--steps` calls of each (each call ends with the copy to the
host that every path makes, so the time is the device's and the host's together), and
the one-read floor (a sum of a precomputed |x|, synchronised). From the repository root,
on a machine with a GPU:

    python scripts/bench_gpu_sidco_stages.py --sizes 26M,128M --rounds 5 --steps 30 \\
        --json results/bench/OUT.json

`--device cpu` with TRITON_INTERPRET=1 runs the same code under Triton's interpreter (a
check that the script works, not a timing)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import compressors  # noqa: E402
from compressors import sidco  # noqa: E402
from compressors.base import Context  # noqa: E402
from repro import sources  # noqa: E402
from repro.bench import parse_size  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, steps: int, device: str) -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


PATHS = ("host", "plain", "device")


def _call(s, path: str, acc: torch.Tensor, ratios: int, ctx: Context, k: int):
    if path == "host":
        return s._select_host(acc, ratios, ctx, k)
    return s._select_device(acc, ratios, ctx, k, speculate=path == "device")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="26M,128M")
    ap.add_argument("--ratio", type=float, default=0.001)
    ap.add_argument("--compressor", default="sidco_e,sidco_gp,sidco_p")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = args.device
    rows = []
    for text in args.sizes.split(","):
        n = parse_size(text)
        acc = sources.synthetic("laplace", n, 1, 0, 0)[0].to(device)  # repro bench's default
        magnitudes = acc.abs()
        k = max(1, int(args.ratio * n))
        for name in args.compressor.split(","):
            s = compressors.build(name, ratio=args.ratio)
            ratios = s.initial_stages  # the stage count the paths take
            contexts = {path: Context(rank=0, world_size=1, step=0, name="g", state={},
                                      generator=torch.Generator(), shared_seed=0)
                        for path in PATHS}
            got = {path: _call(s, path, acc, ratios, contexts[path], k) for path in PATHS}
            for _ in range(2):  # the third call's first read is speculative (two steps known)
                got["device"] = _call(s, "device", acc, ratios, contexts["device"], k)
            same = all(sidco._same_selection(got["host"][0], got[p][0]) for p in PATHS)
            for r in range(args.rounds):
                floor = _median_ms(magnitudes.sum, args.steps, device)
                times = {}
                for path in PATHS[r % 3:] + PATHS[:r % 3]:
                    call = (lambda path=path, ctx=contexts[path]:
                            _call(s, path, acc, ratios, ctx, k))
                    times[path] = _median_ms(call, args.steps, device)
                last = _call(s, "device", acc, ratios, contexts["device"], k)
                row = {"numel": n, "compressor": name, "stages": len(ratios), "round": r,
                       "floor_ms": round(floor, 4),
                       **{f"{p}_ms": round(times[p], 4) for p in PATHS},
                       "host_over_device": round(times["host"] / times["device"], 3),
                       "plain_over_device": round(times["plain"] / times["device"], 3),
                       "plain_over_floor": round(times["plain"] / floor, 2),
                       "device_over_floor": round(times["device"] / floor, 2),
                       "speculated": last[2], "same_selection": same,
                       "selected": int(got["device"][0].indices.numel())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        machine = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
        with open(args.json, "w") as f:
            json.dump({"device": machine, "torch": torch.__version__, "ratio": args.ratio,
                       "rows": rows}, f, indent=1)
    return 0 if all(r["same_selection"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
