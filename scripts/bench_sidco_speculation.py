"""SIDCo's encode with and without the speculative first read, side by side in one
process (results/bench/README.md, "Seventh session").

    python scripts/bench_sidco_speculation.py [--numel 26M] [--threads 2] [--steps 25]
        [--compressor sidco_e,sidco_gp] [--json FILE]

Two single-worker Sessions of the same compressor (no error feedback, no NaN/Inf check,
as repro bench times encoders) compress the same Laplace tensor step after step,
alternating: one speculates from the second step on (the thresholds do not move, so the
guess holds), the other never does (its _speculation_bounds returns None). Encode times
as repro bench measures them (repro.bench.exchange_once), the first three steps left
out; the floor (a sum of a precomputed |x|) timed between them. Medians in ms."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import compressors
from compressors import Session
from repro import bench, sources


def side_by_side(name: str, x: torch.Tensor, steps: int) -> dict:
    magnitudes = x.abs()
    dest = torch.empty_like(x)
    plain = compressors.build(name, ratio=0.001)
    plain._speculation_bounds = lambda *args: None  # this instance never speculates
    sessions = {
        "speculative": Session(compressors.build(name, ratio=0.001), feedback="none",
                               check_finite=False, measure=False),
        "plain": Session(plain, feedback="none", check_finite=False, measure=False),
    }
    times: dict[str, list[float]] = {"speculative": [], "plain": [], "floor": []}
    held = 0
    for step in range(steps):
        for key, session in sessions.items():
            _, encode, _ = bench.exchange_once(session, x, step, out=dest)
            if step >= 3:
                times[key].append(encode)
        state = next(iter(sessions["speculative"].states.values()))["compressor"]
        held += step >= 3 and state.get("speculated") is True
        t0 = time.perf_counter()
        torch.sum(magnitudes)
        times["floor"].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"compressor": name, **{f"{k}_ms": v for k, v in ms.items()},
            "plain_over_speculative": ms["plain"] / ms["speculative"],
            "speculative_over_floor": ms["speculative"] / ms["floor"],
            "plain_over_floor": ms["plain"] / ms["floor"],
            "held": held, "timed_steps": steps - 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="26M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--compressor", default="sidco_e,sidco_gp")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = bench.parse_size(args.numel)
    x = sources.synthetic("laplace", n, 1, 0, 0)[0]
    print(f"{n} float32 elements, {args.threads} threads, medians of {args.steps - 3} steps")
    rows = []
    for name in args.compressor.split(","):
        r = side_by_side(name, x, args.steps)
        rows.append(r)
        print(f"{name}: speculative {r['speculative_ms']:.2f} ms ({r['speculative_over_floor']:.2f}× "
              f"the floor), plain {r['plain_ms']:.2f} ms ({r['plain_over_floor']:.2f}×), plain / "
              f"speculative {r['plain_over_speculative']:.2f}; floor {r['floor_ms']:.2f} ms; "
              f"held in {r['held']} of {r['timed_steps']} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": n, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
