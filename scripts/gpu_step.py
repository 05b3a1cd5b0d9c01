"""A training step through the DDP hook on one GPU, as a user's script runs it: one NCCL
rank (world size 1), an MLP of about --params parameters, SGD, batch --batch. Times the
step (forward, backward with the hook, optimizer step) uncompressed (DDP's own allreduce)
and with each compressor's hook, side by side in one process, as the median over
--steps steps after --warmup, alternating the configurations round by round.

    python scripts/gpu_step.py [--compressor sidco_e,dragonn,thc,sidco_e@model] [--params 16.8M]
        [--ratio 0.001] [--steps 30] [--rounds 3] [--json FILE]

A name NAME@GRANULARITY sets the hook's granularity (layer, bucket, model).

Prints one JSON object: per configuration the median step in ms, the spread (min/max of
the round medians) and the ratio to the uncompressed step. Imports only torch and the
suite's library (no Hydra or W&B).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import repro.hooks
from repro.bench import parse_size
from repro.replicacheck import hook_params, mlp


def _build(name: str, params: int, ratio: float, device: str):
    model, width = mlp(params)
    model = model.to(device)
    ddp = DDP(model)
    if name != "none":
        name, _, granularity = name.partition("@")
        state, hook = repro.hooks.make(name, model=ddp, granularity=granularity or "default",
                                       **hook_params(name, ratio))
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return ddp, opt, width


def _time_steps(ddp, opt, width: int, steps: int, device: str) -> list[float]:
    g = torch.Generator(device=device).manual_seed(0)  # inputs made once, outside the timing
    x = torch.randn(64, width, device=device, generator=g)
    y = torch.randint(0, 10, (64,), device=device, generator=g)
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="sidco_e,dragonn,thc,sidco_e@model,dragonn@model")
    p.add_argument("--params", default="16.8M")
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_step.py: no CUDA device (--device cpu times the same step on the CPU)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    names = ["none"] + [n for n in a.compressor.split(",") if n]
    built = {n: _build(n, int(parse_size(a.params)), a.ratio, device) for n in names}
    for n in names:  # warm-up: Triton compilation, feedback buffers
        _time_steps(*built[n], a.warmup, device)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(a.rounds):
        for n in names:
            rounds[n].append(statistics.median(_time_steps(*built[n], a.steps, device)))
    base = statistics.median(rounds["none"])
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__,
           "params": sum(p.numel() for p in built["none"][0].parameters()),
           "ratio": a.ratio, "steps": a.steps, "rounds": a.rounds, "step_ms": {}}
    for n in names:
        med = statistics.median(rounds[n])
        out["step_ms"][n] = {"median": round(med, 3), "min": round(min(rounds[n]), 3),
                             "max": round(max(rounds[n]), 3), "x_uncompressed": round(med / base, 3)}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
