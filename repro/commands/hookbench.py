"""`repro hookbench`: the cost of running DDP's gradient exchange through our comm hook.

Gloo ranks train the same model several times over, in one run: a DDP model with DDP's
built-in C++ allreduce, and one identical DDP model per compressor given (by default the
`none` compressor: plain averaged allreduce through repro.hooks: per-bucket batching,
the communication thread, the Python protocol driver). Steps alternate between the
models (ABAB...) so all see the same machine load; the report is the median step time
of each and its ratio to the built-in one (for `none`, the goal is ≤ 1.05). The model is
a registered task's (--task) or a torchvision model on random images (--model).

--unbatched adds, for each sparsifier the hook batches (compressors.batched), an arm
with batch=False: one exchange per tensor, the same results bit for bit.

--counts adds, per compressor, what one step of the hook costs beyond its arithmetic,
from a few further (untimed) steps: collectives issued, host reads of tensor values
(.item(), .tolist(), bool() and the like: device-to-host round trips on a GPU), jobs
handed to the communication thread (thread hops), and per bucket the time the hook
spends outside collectives. A measurement, not a test: it prints numbers.
"""

from __future__ import annotations

UNBATCHED = "unbatched"  # the arm of a compressor run with batch=False (--unbatched)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "hookbench",
        help="step time of compressors through our DDP comm hook vs DDP's built-in allreduce",
        description="Examples: repro hookbench --task cifar10_resnet20 --steps 60; "
                    "repro hookbench --model resnet50 --compressors none,topk --ratio 0.001 "
                    "--counts",
    )
    p.add_argument("--task", default="cifar10_resnet20", help="registered task (default: %(default)s)")
    p.add_argument("--size", choices=("smoke", "paper"), default="smoke",
                   help="task size (default: %(default)s)")
    p.add_argument("--model", help="a torchvision model name (resnet50, vgg16, ...) trained on "
                   "random images instead of --task")
    p.add_argument("--batch", type=int, default=4,
                   help="images per rank and step for --model (default: %(default)s)")
    p.add_argument("--image", type=int, default=64,
                   help="image side in pixels for --model (default: %(default)s)")
    p.add_argument("--compressors", default="none",
                   help="comma-separated compressors, each run through the hook beside the "
                   "built-in allreduce (default: %(default)s)")
    p.add_argument("--ratio", type=float,
                   help="the compressors' ratio, for those that take one (else their own)")
    p.add_argument("--workers", type=int, default=2, help="gloo ranks (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per arm (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per arm (default: %(default)s)")
    p.add_argument("--granularity", choices=("default", "layer", "bucket", "model"),
                   default="default",
                   help="hook granularity, the compressor's paper's setting unless given: per "
                   "parameter (layer), per DDP bucket, or the whole gradient as one exchange")
    p.add_argument("--counts", action="store_true",
                   help="also count collectives, host reads and thread hops per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    p.add_argument("--unbatched", action="store_true",
                   help="also run each sparsifier whose per-tensor exchanges the hook batches "
                   "with batch=False (one exchange per tensor), as an arm of its own named "
                   f"<name>/{UNBATCHED}, alternated with the others")
    p.set_defaults(func=run)


class _TorchvisionTask:
    """A torchvision model on random images: what the bench needs of a task."""

    def __init__(self, name: str, batch: int, image: int):
        import torchvision

        if name not in torchvision.models.list_models(module=torchvision.models):
            raise ValueError(f"--model {name!r} is not a torchvision classification model: "
                             "see torchvision.models.list_models() (e.g. resnet50, vgg16)")
        self.name, self.batch, self.image = name, batch, image

    def build_model(self):
        import torchvision

        return torchvision.models.get_model(self.name, num_classes=1000)

    def make_optimizer(self, params):
        import torch

        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def train_batches(self, rank: int, world: int, epoch: int):
        import torch

        g = torch.Generator().manual_seed(rank)
        while True:
            yield (torch.randn(self.batch, 3, self.image, self.image, generator=g),
                   torch.randint(0, 1000, (self.batch,), generator=g))

    def loss(self, model, batch):
        import torch.nn.functional as F

        x, y = batch
        return F.cross_entropy(model(x), y)


class _Counts:
    """Counts what the hook does while `arm` names a compressor (see the module
    docstring): collectives by kind, host reads of tensor values, communication-thread
    jobs, hook calls (DDP buckets), and the time jobs spend outside collectives.
    Installed once per process (it wraps torch.distributed, torch.Tensor and the
    driver), its counts kept per arm."""

    READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")
    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                   "all_to_all_single", "reduce_scatter_tensor")

    def __init__(self):
        self.arm: str | None = None
        self.tally: dict[str, dict] = {}
        self._install()

    def _bump(self, key: str, amount: float = 1) -> None:
        if self.arm is not None:
            t = self.tally.setdefault(self.arm, {})
            t[key] = t.get(key, 0) + amount

    def _install(self) -> None:
        import functools
        import time

        import torch
        import torch.distributed as dist

        import repro.distributed as driver

        def counted(module, name, key):
            real = getattr(module, name)

            @functools.wraps(real)
            def wrapper(*args, **kwargs):
                self._bump(key)
                return real(*args, **kwargs)
            setattr(module, name, wrapper)

        for name in self.COLLECTIVES:
            counted(dist, name, f"collective:{name}")
        for name in self.READS:
            counted(torch.Tensor, name, "host_reads")
        real_run, real_submit = driver.run, driver.CommThread.submit

        def run(gen, group=None):
            driver.comm_clock.pop()
            t0 = time.perf_counter()
            try:
                return real_run(gen, group)
            finally:
                self._bump("job_s", time.perf_counter() - t0)
                self._bump("comm_s", driver.comm_clock.pop())

        def submit(thread, gen, group=None):
            self._bump("thread_hops")
            return real_submit(thread, gen, group)

        driver.run, driver.CommThread.submit = run, submit

    def wrap(self, hook):
        import functools

        @functools.wraps(hook)
        def counting_hook(state, bucket):
            self._bump("buckets")
            return hook(state, bucket)
        return counting_hook

    def per_step(self, arm: str, steps: int) -> dict:
        t = self.tally.get(arm, {})
        buckets = t.get("buckets", 0)
        return {"collectives": {k.removeprefix("collective:"): v / steps
                                for k, v in sorted(t.items()) if k.startswith("collective:")},
                "host_reads": t.get("host_reads", 0) / steps,
                "thread_hops": t.get("thread_hops", 0) / steps, "buckets": buckets / steps,
                "ms_outside_collectives_per_bucket":
                    1e3 * (t.get("job_s", 0) - t.get("comm_s", 0)) / max(buckets, 1),
                "ms_in_collectives_per_step": 1e3 * t.get("comm_s", 0) / steps}


def _bench_rank(rank: int, world: int, source: tuple, names: list[str], ratio: float | None,
                steps: int, warmup: int, granularity: str, threads: int,
                count_steps: int) -> dict:
    import copy
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compressors
    import repro.hooks
    import tasks

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kind, *spec = source
    task = (tasks.build_task(spec[0], size=spec[1], seed=0) if kind == "task"
            else _TorchvisionTask(*spec))
    base = task.build_model()
    counts = _Counts() if count_steps else None
    arms = {}
    for arm in ("builtin", *names):
        model = copy.deepcopy(base)  # every arm starts from the same weights
        ddp = DDP(model)
        if arm != "builtin":
            name, _, variant = arm.partition("/")
            params = {}
            if ratio is not None and "ratio" in compressors.default_params(name):
                params["ratio"] = ratio
            state, hook = repro.hooks.make(name, model=ddp, granularity=granularity,
                                           batch=variant != UNBATCHED, **params)
            ddp.register_comm_hook(state, hook if counts is None else counts.wrap(hook))
        arms[arm] = (ddp, task.make_optimizer(model.parameters()))
    batches = task.train_batches(rank, world, 0)
    times: dict[str, list[float]] = {arm: [] for arm in arms}

    def step(ddp, opt, batch) -> float:
        dist.barrier()  # all ranks start the step together
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        task.loss(ddp, batch).backward()
        opt.step()
        return time.perf_counter() - t0

    for i in range(warmup + steps):
        batch = next(batches)
        for arm, (ddp, opt) in arms.items():
            elapsed = step(ddp, opt, batch)
            if i >= warmup:
                times[arm].append(elapsed)
    per_step = {}
    for name in names if counts is not None else ():
        ddp, opt = arms[name]
        counts.arm = name
        for _ in range(count_steps):
            step(ddp, opt, next(batches))
        counts.arm = None
        per_step[name] = counts.per_step(name, count_steps)
    params = sum(p.numel() for p in base.parameters())
    return {"times": times, "params": params, "tensors": len(list(base.parameters())),
            "counts": per_step}


def run(args) -> int:
    import statistics

    from repro.testing import run_ranks

    if args.workers < 2:
        raise ValueError(f"--workers={args.workers}: the hook only communicates with ≥ 2 ranks")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be ≥ 1 and --warmup ≥ 0")
    if args.batch < 1 or args.image < 32:
        raise ValueError("--batch must be ≥ 1 and --image ≥ 32 (pixels)")
    names = [n.strip() for n in args.compressors.split(",") if n.strip()]
    import compressors

    registered = compressors.list_compressors()
    unknown = [n for n in names if n not in registered]
    if not names or unknown:
        raise ValueError(f"--compressors {args.compressors!r}: unknown {', '.join(unknown)}; "
                         f"registered: {', '.join(registered)}")
    if args.unbatched:
        from compressors.batched import batches

        names += [f"{n}/{UNBATCHED}" for n in names if batches(compressors.build(n))]
    if args.model:
        _TorchvisionTask(args.model, args.batch, args.image)  # a bad name fails here
        source, what = ("torchvision", args.model, args.batch, args.image), (
            f"torchvision {args.model}, batch {args.batch} of {args.image}² random images")
    else:
        source, what = ("task", args.task, args.size), f"task {args.task} ({args.size})"
    results = run_ranks(_bench_rank, args.workers, source, names, args.ratio, args.steps,
                        args.warmup, args.granularity, args.threads, 3 if args.counts else 0,
                        timeout=3600)
    # A step is as slow as its slowest rank.
    median = {}
    for arm in ("builtin", *names):
        slowest = [max(r["times"][arm][i] for r in results) for i in range(args.steps)]
        median[arm] = statistics.median(slowest)
    info = results[0]
    print(f"{what}: {info['params']} parameters in {info['tensors']} tensors, {args.workers} "
          f"gloo ranks × {args.threads} thread(s), {args.steps} timed steps per arm (ABAB), "
          f"granularity={args.granularity}" + (f", ratio={args.ratio:g}" if args.ratio else ""))
    print(f"median step, DDP built-in allreduce: {median['builtin'] * 1e3:8.2f} ms")
    for name in names:
        print(f"median step, {name:>8} through our hook: {median[name] * 1e3:8.2f} ms, "
              f"× built-in {median[name] / median['builtin']:.3f}"
              + (" (goal ≤ 1.05)" if name == "none" else ""))
    for name, c in info["counts"].items():
        kinds = ", ".join(f"{k} {v:g}" for k, v in c["collectives"].items())
        print(f"per step, {name} (rank 0): {c['buckets']:g} buckets; collectives: "
              f"{sum(c['collectives'].values()):g} ({kinds}); host reads {c['host_reads']:g}; "
              f"thread hops {c['thread_hops']:g}; outside collectives "
              f"{c['ms_outside_collectives_per_bucket']:.2f} ms per bucket; in collectives "
              f"{c['ms_in_collectives_per_step']:.1f} ms")
    return 0
