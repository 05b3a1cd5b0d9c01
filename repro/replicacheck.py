"""Do the ranks of a user's DDP training hold identical models? Checked as a user would
run it: n gloo ranks (sharing one GPU, or on the CPU) train the same MLP through the
public hook, `repro.hooks.make(name, ratio=..., model=ddp)`, and after the last step
`repro.hooks.check_replicas` compares every parameter across ranks, bit for bit. One line
per compressor: "replicas identical" or the first parameter that differs.

    python -m repro.replicacheck --device cuda --workers 4 --steps 40
    repro replicas --device cpu --workers 3 --steps 10 --params 200000

Imports only torch and the suite's library (no Hydra or W&B), so it runs wherever torch
does.
"""

from __future__ import annotations

import argparse
import sys


def sparse_compressors() -> list[str]:
    """Every registered compressor that sends a subset of coordinates (Compressor.sparse):
    the ones whose ranks could part ways through a decision taken per rank."""
    import compressors

    return [n for n in compressors.list_compressors() if compressors.get_class(n).sparse]


def hook_params(name: str, ratio: float) -> dict:
    """The parameters a sparse compressor is built with here: hard_threshold's λ (its
    ratio is only the target the metrics compare with), the ratio δ of the others."""
    return {"lam": 1.0} if name == "hard_threshold" else {"ratio": ratio}


def mlp(params: int):
    """An MLP of about `params` parameters (four square layers and a head)."""
    import torch

    width = max(8, int((params / 4) ** 0.5))
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)), width


def _rank(rank: int, world: int, names: list[str], device: str, steps: int, params: int,
          ratio: float) -> dict[str, str]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks

    torch.set_num_threads(1)
    results = {}
    for name in names:
        model, width = mlp(params)
        model = model.to(device)
        ddp = DDP(model)
        state, hook = repro.hooks.make(name, model=ddp, **hook_params(name, ratio))
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(64, width, generator=g).to(device)
            y = torch.randint(0, 10, (64,), generator=g).to(device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        try:
            repro.hooks.check_replicas(model, step=steps - 1)
            results[name] = "replicas identical"
        except repro.hooks.ReplicasDiffer as exc:
            results[name] = f"REPLICAS DIFFER: {exc}"
    return results


def check(names: list[str], device: str = "cpu", workers: int = 4, steps: int = 40,
          params: int = 1_000_000, ratio: float = 0.01) -> dict[str, str]:
    """{compressor: 'replicas identical' | 'REPLICAS DIFFER: ...'} from `workers` gloo ranks."""
    from repro.testing import run_ranks

    sparse = sparse_compressors()
    unknown = sorted(set(names) - set(sparse))
    if unknown:
        raise ValueError(f"not a sparse compressor of this check: {', '.join(unknown)}; "
                         f"choose from {', '.join(sparse)}")
    if workers < 2:
        raise ValueError(f"workers={workers}: replicas need at least 2 ranks")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA device is present; use --device cpu")
    per_rank = run_ranks(_rank, workers, list(names), device, steps, params, ratio,
                         timeout=3600)
    return per_rank[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (all ranks share it)")
    p.add_argument("--workers", type=int, default=4, help="gloo ranks (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    p.add_argument("--params", type=int, default=1_000_000,
                   help="MLP parameters, about (default: %(default)s)")
    p.add_argument("--ratio", type=float, default=0.01, help="δ (default: %(default)s)")
    p.add_argument("--compressor", default=None,
                   help="comma-separated sparse compressors (default: every registered one)")


def run(args) -> int:
    names = ([n for n in args.compressor.split(",") if n] if args.compressor
             else sparse_compressors())
    results = check(names, args.device, args.workers, args.steps, args.params, args.ratio)
    for name in names:
        print(f"{name:>15}: {results[name]}", flush=True)
    return 0 if all(r == "replicas identical" for r in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m repro.replicacheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
