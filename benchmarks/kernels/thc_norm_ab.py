"""THC's encode on a GPU with its max-norm round on the fused read pass (ops.l2_norm)
against torch's float64 vector_norm, alternated in one process; medians and spread.

    python benchmarks/kernels/thc_norm_ab.py [--size 128M] [--rounds 12]
"""

from __future__ import annotations

import argparse

import torch

import compressors
from compressors.kernels import ops
from compressors.session import Session
from repro.bench import exchange_once, parse_size, timed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="128M")
    p.add_argument("--rounds", type=int, default=12)
    a = p.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(parse_size(a.size), device=dev,
                    generator=torch.Generator(device=dev).manual_seed(0))
    fused = ops.l2_norm

    def torch_norm(t: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(t, dtype=torch.float64).reshape(1)

    dest = torch.empty_like(x)
    session = Session(compressors.build("thc"), rank=0, world_size=1, feedback="none", seed=0,
                      check_finite=False, measure=False)
    magnitudes = x.abs()
    res: dict[str, list[float]] = {"old": [], "new": [], "floor": []}
    step = 0
    try:
        for r in range(a.rounds):
            for name, fn in (("old", torch_norm), ("new", fused)):
                ops.l2_norm = fn
                _, enc, _ = exchange_once(session, x, step, out=dest)
                step += 1
                if r >= 2:  # the first two rounds warm up
                    res[name].append(enc * 1e3)
            res["floor"].append(timed(lambda: magnitudes.sum(), dev) * 1e3)
    finally:
        ops.l2_norm = fused

    def q(v: list[float], p: float) -> float:
        return sorted(v)[int(p * (len(v) - 1))]

    for k, v in res.items():
        print(f"thc encode {k}: median {q(v, .5):.3f} ms (p10 {q(v, .1):.3f}, "
              f"p90 {q(v, .9):.3f}) over {len(v)} rounds")
    print(f"ratio new/old per round: {[round(n / o, 3) for n, o in zip(res['new'], res['old'])]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
