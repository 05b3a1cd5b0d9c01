"""A training step through the DDP hook on one GPU, as a user's script runs it: one NCCL
rank (world size 1), SGD, random data made once. Times the step (forward, backward with
the hook, optimizer step) uncompressed (DDP's own allreduce), with PyTorch's own
fp16_compress_hook and PowerSGD hook (rank 4, compressing from the third step), and with
each compressor's hook, side by side in one process, as the median over --steps steps
after --warmup, alternating the configurations round by round.

    python scripts/gpu_step.py [--model vgg16 --batch 32 | --params 16.8M]
        [--compressor topk,dgc,dragonn,thc,sidco_e,sidco_e@bucket] [--ratio 0.001]
        [--steps 8] [--rounds 3] [--json FILE]

--model trains a torchvision model on --batch random images of --image² pixels (TF32 on,
as PyTorch's defaults for convolutions); without it, an MLP of about --params parameters.
A name NAME@GRANULARITY sets the hook's granularity (layer, bucket, model); torch_fp16
and torch_powersgd are PyTorch's hooks, always measured beside the suite's.

Prints one JSON object: per configuration the median step in ms, the spread (min/max of
the round medians) and the ratio to the uncompressed step. With --json FILE, the object
is stored in FILE under the model's name, beside the other models already there (so one
file, e.g. results/bench/<gpu>-torch<version>/model-step.json, collects them). Imports
only torch, torchvision and the suite's library (no Hydra or W&B).
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

TORCH_HOOKS = ("torch_fp16", "torch_powersgd")


def _model(a, device: str):
    """(model, a batch (x, y)) for --model or the MLP, the batch made once."""
    g = torch.Generator(device=device).manual_seed(0)
    if a.model:
        import torchvision

        torch.manual_seed(0)
        model = torchvision.models.get_model(a.model, num_classes=1000)
        x = torch.randn(a.batch, 3, a.image, a.image, device=device, generator=g)
        y = torch.randint(0, 1000, (a.batch,), device=device, generator=g)
    else:
        model, width = mlp(int(parse_size(a.params)))
        x = torch.randn(a.batch, width, device=device, generator=g)
        y = torch.randint(0, 10, (a.batch,), device=device, generator=g)
    return model.to(device), (x, y)


def _build(name: str, a, device: str):
    model, batch = _model(a, device)
    ddp = DDP(model)
    if name == "torch_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name != "none":
        name, _, granularity = name.partition("@")
        state, hook = repro.hooks.make(name, model=ddp, granularity=granularity or "default",
                                       **hook_params(name, a.ratio))
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return ddp, opt, batch


def _time_steps(ddp, opt, batch, steps: int, device: str) -> list[float]:
    x, y = batch
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


def _store(path: str, key: str, out: dict) -> None:
    """out under `key` in the JSON object in `path` (other keys kept), written whole."""
    stored = {}
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
    stored[key] = out
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(stored, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="topk,dgc,dragonn,thc,sidco_e,sidco_e@bucket")
    p.add_argument("--model", help="a torchvision model (vgg16, resnet50, ...); else an MLP")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--params", default="16.8M", help="the MLP's size (without --model)")
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_step.py: no CUDA device (--device cpu times the same step on the CPU)",
              file=sys.stderr)
        return 2
    if a.warmup < 3:
        p.error("--warmup must be ≥ 3: PyTorch's PowerSGD hook compresses from the third step")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    names = ["none", *TORCH_HOOKS] + [n for n in a.compressor.split(",") if n]
    built = {n: _build(n, a, device) for n in names}
    for n in names:  # warm-up: Triton compilation, feedback buffers, PowerSGD's start
        _time_steps(*built[n], a.warmup, device)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(a.rounds):
        for n in names:
            rounds[n].append(statistics.median(_time_steps(*built[n], a.steps, device)))
    base = statistics.median(rounds["none"])
    model = built["none"][0].module
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "model": a.model or "mlp",
           "batch": a.batch, "image": a.image if a.model else None,
           "params": sum(p.numel() for p in model.parameters()),
           "tensors": sum(1 for _ in model.parameters()),
           "ratio": a.ratio, "steps": a.steps, "rounds": a.rounds, "step_ms": {}}
    for n in names:
        med = statistics.median(rounds[n])
        out["step_ms"][n] = {"median": round(med, 3), "min": round(min(rounds[n]), 3),
                             "max": round(max(rounds[n]), 3), "x_uncompressed": round(med / base, 3)}
    print(json.dumps(out, indent=1))
    if a.json:
        _store(a.json, out["model"], out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
