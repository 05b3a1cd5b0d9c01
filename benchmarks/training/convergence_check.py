"""Train one task on n local gloo ranks (DDP with the project's comm hook) and report the
held-out metric after every epoch: a quick end-to-end check that a task really learns on
its offline stand-in data.

    python benchmarks/training/convergence_check.py --task cifar10_resnet20 --size paper --epochs 3 \
        --batch-size 128 --warmup-epochs 0.5 --milestones 2

Hyper-parameters default to the task's own (the paper's at --size paper); the flags
override the schedule so a CPU run of a few epochs still anneals. --compressor picks any
registered compressor (default "none": plain averaged allreduce through the hook).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _rank(rank: int, world: int, args: dict) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks
    import tasks

    torch.manual_seed(args["seed"])
    task = tasks.build_task(
        args["task"],
        size=args["size"],
        data=args["data"],
        data_root=args["data_root"],
        batch_size=args["batch_size"],
        seed=args["seed"],
    )
    h = task.hparams
    for key in ("lr", "epochs", "warmup_epochs"):
        if args[key] is not None:
            h[key] = args[key]
    if args["milestones"] is not None:
        h["lr_schedule"], h["lr_milestones"] = "step", tuple(args["milestones"])
    model = task.build_model()
    ddp = DDP(model)
    params = {} if args["ratio"] is None else {"ratio": args["ratio"]}
    ddp.register_comm_hook(*repro.hooks.make(args["compressor"], model=ddp, **params))
    opt = task.make_optimizer(ddp.parameters())
    steps = task.steps_per_epoch(world)
    sched = task.make_scheduler(opt, steps)
    history, t0 = [], time.perf_counter()
    for epoch in range(int(h["epochs"])):
        total, n = 0.0, 0
        for batch in task.train_batches(rank, world, epoch):
            opt.zero_grad(set_to_none=True)
            loss = task.loss(ddp, batch)
            loss.backward()
            if h.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), h["clip"])
            opt.step()
            if sched is not None:
                sched.step()
            total, n = total + float(loss.detach()), n + 1
        if rank == 0:
            ev = task.evaluate(model, max_batches=args["eval_batches"])
            row = {
                "epoch": epoch + 1,
                "steps": (epoch + 1) * steps,
                "train_loss": total / n,
                "lr": opt.param_groups[0]["lr"],
                "wall_s": round(time.perf_counter() - t0, 1),
                **ev,
            }
            print(json.dumps(row), flush=True)
            history.append(row)
    if rank == 0:
        history.append(
            {
                "data_source": task.data_source,
                "metric": task.metric,
                "target": task.target,
                "hparams": {k: (list(v) if isinstance(v, tuple) else v) for k, v in h.items()},
            }
        )
    return history


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--task", default="cifar10_resnet20")
    p.add_argument("--size", default="paper", choices=("smoke", "paper"))
    p.add_argument("--data", default="standin", choices=("standin", "canonical", "hf"))
    p.add_argument("--data-root", default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None, help="per worker (default: the task's)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--warmup-epochs", type=float, default=None)
    p.add_argument(
        "--milestones", type=float, nargs="*", default=None, help="epochs where lr ×= lr_gamma"
    )
    p.add_argument("--compressor", default="none")
    p.add_argument("--ratio", type=float, default=None)
    p.add_argument(
        "--eval-batches", type=int, default=None, help="default: the whole held-out split"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the per-epoch history as JSON here")
    args = p.parse_args()
    from repro.testing import run_ranks

    t0 = time.perf_counter()
    history = run_ranks(_rank, args.workers, vars(args), timeout=24 * 3600)[0]
    print(
        f"total wall time {time.perf_counter() - t0:.0f} s on {args.workers} gloo ranks", flush=True
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "history": history}, f, indent=1)


if __name__ == "__main__":
    main()
