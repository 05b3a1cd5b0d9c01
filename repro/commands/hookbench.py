"""`repro hookbench`: the cost of running DDP's gradient exchange through our comm hook.

Two gloo ranks train the same model twice over, in one run: a DDP model whose hook runs
the `none` compressor (plain averaged allreduce through repro.hooks: per-bucket batching,
the communication thread, the Python protocol driver) and an identical DDP model with
DDP's built-in C++ allreduce. Steps alternate between the two (ABAB...) so both see the
same machine load; the report is the median step time of each and their ratio
(hook / built-in; the goal is ≤ 1.05). A measurement, not a test: it prints numbers.
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "hookbench",
        help="step time of `none` through our DDP comm hook vs DDP's built-in allreduce",
        description="Example: repro hookbench --task cifar10_resnet20 --steps 60",
    )
    p.add_argument("--task", default="cifar10_resnet20", help="registered task (default: %(default)s)")
    p.add_argument("--size", choices=("smoke", "paper"), default="smoke",
                   help="task size (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="gloo ranks (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per arm (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per arm (default: %(default)s)")
    p.add_argument("--granularity", choices=("layer", "bucket", "model"), default="layer",
                   help="hook granularity: per parameter, per DDP bucket, or the whole gradient "
                   "as one exchange (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    p.set_defaults(func=run)


def _bench_rank(rank: int, world: int, task_name: str, size: str, steps: int, warmup: int,
                granularity: str, threads: int) -> dict:
    import copy
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import repro.hooks
    import tasks

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    task = tasks.build_task(task_name, size=size, seed=0)
    base = task.build_model()
    arms = {}
    for arm in ("hook", "builtin"):
        model = copy.deepcopy(base)  # both arms start from the same weights
        ddp = DDP(model)
        if arm == "hook":
            ddp.register_comm_hook(*repro.hooks.make("none", model=ddp, granularity=granularity))
        arms[arm] = (ddp, task.make_optimizer(model.parameters()))
    batches = task.train_batches(rank, world, 0)
    times: dict[str, list[float]] = {"hook": [], "builtin": []}
    for i in range(warmup + steps):
        batch = next(batches)
        for arm, (ddp, opt) in arms.items():
            dist.barrier()  # both ranks start the step together
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            task.loss(ddp, batch).backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[arm].append(elapsed)
    params = sum(p.numel() for p in base.parameters())
    return {"times": times, "params": params, "tensors": len(list(base.parameters()))}


def run(args) -> int:
    import statistics

    from repro.testing import run_ranks

    if args.workers < 2:
        raise ValueError(f"--workers={args.workers}: the hook only communicates with ≥ 2 ranks")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be ≥ 1 and --warmup ≥ 0")
    results = run_ranks(_bench_rank, args.workers, args.task, args.size, args.steps, args.warmup,
                        args.granularity, args.threads)
    # A step is as slow as its slowest rank.
    per_arm = {}
    for arm in ("hook", "builtin"):
        slowest = [max(r["times"][arm][i] for r in results) for i in range(args.steps)]
        per_arm[arm] = statistics.median(slowest)
    ratio = per_arm["hook"] / per_arm["builtin"]
    info = results[0]
    print(f"task {args.task} ({args.size}): {info['params']} parameters in {info['tensors']} "
          f"tensors, {args.workers} gloo ranks × {args.threads} thread(s), {args.steps} timed steps "
          f"per arm (ABAB), granularity={args.granularity}")
    print(f"median step, DDP built-in allreduce: {per_arm['builtin'] * 1e3:8.2f} ms")
    print(f"median step, `none` through our hook: {per_arm['hook'] * 1e3:8.2f} ms")
    print(f"ratio hook / built-in: {ratio:.3f} (goal ≤ 1.05)")
    return 0
