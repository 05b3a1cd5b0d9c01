"""Run a function on n local gloo ranks (spawned processes) and collect the results.

Used by the 2-process tests and by anyone checking a compressor over real ranks without
torchrun. Rendezvous goes through a file, so no port is needed. Also `with_threads`: a
call with torch's intra-op thread count set for it (the native kernels split their work
by that count).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from repro.checkpoints import save


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple,
           network: dict | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_method = f"file://{init_file}"
    if network is not None:
        # An emulated network (repro.netem): this rank in its own namespace; the
        # rendezvous and every collective go over its shaped link.
        from repro import netem

        netem.enter(network["namespaces"][rank])
        os.environ["GLOO_SOCKET_IFNAME"] = netem.IFACE
        init_method = f"tcp://{network['master']}:{network['port']}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        result: Any = fn(rank, world_size, *args)
        save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 300,
              network: Any = None) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; the return values by rank.
    fn must be importable (module level) and return torch.save-able values. With
    `network` (a repro.netem.EmulatedNetwork of world_size ranks, built), each rank runs
    in its own namespace and talks over the emulated links only."""
    spec = None
    if network is not None:
        if len(network.namespaces) < world_size:
            raise ValueError(f"the emulated network links {network.workers} ranks, not {world_size}")
        spec = {"namespaces": [network.namespace(r) for r in range(world_size)],
                "master": network.address(0), "port": 29500}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _entry, args=(world_size, init_file, tmp, fn, args, spec), nprocs=world_size,
            join=False, start_method="spawn",
        )
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} gloo ranks did not finish within {timeout} s")
        results = []
        for r in range(world_size):
            # weights_only=False: the file is the result this call's own child wrote into
            # the private temporary folder it created above (mode 0700, removed on exit),
            # and fn may return any picklable value, which weights_only=True refuses.
            blob = torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False)
            if not blob["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{blob['error']}")
            results.append(blob["result"])
        return results


def with_threads(n: int, fn: Callable[[], Any]) -> Any:
    """fn() with torch.set_num_threads(n), the previous count restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)
