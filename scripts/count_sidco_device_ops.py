"""What one step of SIDCo's CUDA device path asks of the host: Triton launches per kernel,
`torch.empty` / `zeros` / `full` / `cumsum` calls and tensor copies (`clone`), counted
under Triton's CPU interpreter on CPU tensors (the same Python path as on a GPU, no
timing). Steps of a gradient that grows 2% a step, so the speculative first read is taken
from the third step on. SIDCo-P's plain first read (`_native.stats`) takes the C++ path on
CPU tensors, so its launches there (two on CUDA) are not counted. From the repository
root:

    TRITON_INTERPRET=1 python scripts/count_sidco_device_ops.py --compressor sidco_e,sidco_gp,sidco_p
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, ".")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="sidco_e,sidco_gp,sidco_p")
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--numel", type=int, default=123_457)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1 (the counts come from Triton's interpreter)")

    import triton.runtime.interpreter as interp

    import compressors
    from compressors import sidco
    from compressors.base import Context

    counts: collections.Counter = collections.Counter()
    run = interp.InterpretedFunction.run

    def counted_run(self, *a, **k):
        counts["triton " + self.fn.__name__] += 1
        return run(self, *a, **k)

    interp.InterpretedFunction.run = counted_run
    for name in ("empty", "zeros", "full", "cumsum"):
        def wrap(*a, _real=getattr(torch, name), _name=name, **k):
            counts["torch." + _name] += 1
            return _real(*a, **k)
        setattr(torch, name, wrap)
    clone = torch.Tensor.clone

    def counted_clone(self, *a, **k):
        counts["clone"] += 1
        return clone(self, *a, **k)

    torch.Tensor.clone = counted_clone

    g = torch.Generator().manual_seed(0)
    u = torch.rand(args.numel, generator=g, dtype=torch.float64) - 0.5
    base = (-u.sign() * torch.log1p(-2 * u.abs()) * 1e-3).to(torch.float32)
    noise = [torch.randn(args.numel, generator=g) * 1e-5 for _ in range(args.steps)]
    k = max(1, int(args.numel * args.ratio))
    for name in args.compressor.split(","):
        s = compressors.build(name, ratio=args.ratio)
        ratios = s.initial_stages  # the stage count the device path takes
        ctx = Context(rank=0, world_size=1, step=0, name="g", state={},
                      generator=torch.Generator(), shared_seed=0, check_finite=False)
        for step in range(args.steps):
            acc = base * (1.02 ** step) + noise[step]
            counts.clear()
            found = s._select_device(acc, ratios, ctx, k)
            launches = sum(v for key, v in counts.items() if key.startswith("triton "))
            print(f"{name} step {step} ({ratios} stages, "
                  f"{'speculative' if found[2] else 'plain'} read): {launches} Triton "
                  f"launches; " + ", ".join(f"{key} {v}" for key, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
