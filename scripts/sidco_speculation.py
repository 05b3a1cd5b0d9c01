"""How often SIDCo's speculative first read holds in training (compressors/sidco.py:
the first read also takes what the second stage needs near the previous step's first
two thresholds, within SPECULATION_MARGIN; where the new thresholds land outside, the
second and third reads run as before, with the same selection).

    python scripts/sidco_speculation.py [--task cifar10_resnet20] [--size paper]
        [--compressor sidco_e,sidco_gp,sidco_p] [--ratio 0.001] [--workers 2] [--steps 60]
        [--min-numel 100000]

Trains the task's model on its offline data with n simulated workers: per step every
worker's gradient, each parameter compressed layer-wise with the compressor's default
error feedback (SimulatedGroup, one per parameter), the average applied by the task's
optimiser. For every parameter of at least --min-numel elements (where a read pass costs
more than the call overhead) it reports, over the steps after the first, how many
exchanges speculated (the guess is made only where the previous one would have held) and
how many of those held (a miss costs the plain reads after the speculative one), and the
step-to-step change of the first two thresholds (|Δη/η|: median and 95th percentile)."""

from __future__ import annotations

import argparse
import statistics
from itertools import pairwise

import torch

import compressors
from compressors import SimulatedGroup
from compressors.sidco import SPECULATION_MARGIN
from tasks import build_task


def run(task_name: str, size: str, name: str, ratio: float, workers: int, steps: int,
        min_numel: int, seed: int) -> dict:
    torch.manual_seed(seed)
    task = build_task(task_name, size=size, seed=seed)
    model = task.build_model()
    optimizer = task.make_optimizer(model.parameters())
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = {n: SimulatedGroup(compressors.build(name, ratio=ratio), workers, seed=seed)
              for n, p in params if p.numel() >= min_numel}
    batches = [task.train_batches(r, workers, 0) for r in range(workers)]
    held = tried = exchanges = 0
    history: dict[str, list[tuple[float, float]]] = {n: [] for n in groups}
    for step in range(steps):
        grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in params}
        for r in range(workers):
            model.zero_grad(set_to_none=True)
            task.loss(model, next(batches[r])).backward()
            for n, p in params:
                grads[n].append(p.grad.detach().clone())
        for n, p in params:
            if n in groups:
                outcome = groups[n].step(grads[n], name=n, step=step)[0]
                state = groups[n].sessions[0].states[n]["compressor"]
                if step:
                    exchanges += 1
                    tried += state.get("speculated") is not None
                    held += state.get("speculated") is True
                if "speculation" in state:
                    history[n].append(state["speculation"]["thresholds"][-1])
                p.grad = outcome.aggregate.view_as(p).clone()
            else:
                p.grad = torch.stack(grads[n]).mean(0)
        optimizer.step()

    def q(values: list[float], f: float) -> float:
        return sorted(values)[min(len(values) - 1, int(f * len(values)))] if values else 0.0

    drift1 = [abs(b[0] / a[0] - 1) for h in history.values() for a, b in pairwise(h)]
    drift2 = [abs(b[1] / a[1] - 1) for h in history.values() for a, b in pairwise(h)]
    return {"compressor": name, "tensors": len(groups), "exchanges": exchanges,
            "tried": tried, "held": held,
            "eta1_drift_median": statistics.median(drift1) if drift1 else 0.0,
            "eta1_drift_p95": q(drift1, 0.95),
            "eta2_drift_median": statistics.median(drift2) if drift2 else 0.0,
            "eta2_drift_p95": q(drift2, 0.95),
            "history": history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="cifar10_resnet20")
    parser.add_argument("--size", default="paper")
    parser.add_argument("--compressor", default="sidco_e,sidco_gp,sidco_p")
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--min-numel", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.task} ({args.size}), {args.workers} simulated workers, {args.steps} steps, "
          f"δ = {args.ratio}, margin ±{SPECULATION_MARGIN:.0%}, tensors of ≥ "
          f"{args.min_numel:,} elements")
    for name in args.compressor.split(","):
        r = run(args.task, args.size, name, args.ratio, args.workers, args.steps,
                args.min_numel, args.seed)
        print(f"{name}: {r['exchanges']} exchanges after the first step over "
              f"{r['tensors']} tensors; speculated in {r['tried']}, held in {r['held']} "
              f"(missed {r['tried'] - r['held']}); |Δη₁/η₁| median "
              f"{r['eta1_drift_median']:.3%}, p95 {r['eta1_drift_p95']:.3%}; |Δη₂/η₂| "
              f"median {r['eta2_drift_median']:.3%}, p95 {r['eta2_drift_p95']:.3%}")


if __name__ == "__main__":
    main()
