"""Running one prepared run directory (its config.yaml written by repro.launch) on this
machine, in its cluster.mode: the simulated or replica trainer in this process, spawned
ranks, or an elastic torchrun launch; with cluster.network=emulated, inside an emulated
network built for the run (repro.netem). `repro train` calls it for each run it launches,
a submitted job (repro.cluster) for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

from omegaconf import DictConfig

# Rank 0's port on an emulated network (each rank has its own namespace: no clash there).
EMULATED_PORT = 29500


def run_prepared(run_dir: str, cfg) -> None:
    """Run a prepared run directory in its cluster.mode, on this machine; with
    cluster.network=emulated, inside an emulated network built for the run and removed
    when it ends, fails or is interrupted (repro.netem)."""
    mode = cfg.cluster.mode
    if mode == "simulated":
        from repro.train import run_simulated

        run_simulated(run_dir)
    elif mode == "replicas":
        from repro.train import run_replicas

        run_replicas(run_dir)
    elif cfg.cluster.network == "emulated":
        from repro import netem

        with netem.emulated(cfg.cluster.workers, cfg.cluster.bandwidth_gbps,
                            cfg.cluster.latency_ms) as net:
            if mode == "spawn":
                spawn(run_dir, cfg.cluster.workers, network=net)
            else:
                torchrun(run_dir, cfg, network=net)
    elif mode == "spawn":
        spawn(run_dir, cfg.cluster.workers)
    else:
        torchrun(run_dir, cfg)


def _spawn_entry(rank: int, run_dir: str, world: int, init_file: str,
                 namespaces: list[str] | None = None, master: str | None = None) -> None:
    from repro.train import run_rank

    init_method = f"file://{init_file}"
    if namespaces is not None:
        from repro import netem

        netem.enter(namespaces[rank])  # before anything opens a socket
        os.environ["GLOO_SOCKET_IFNAME"] = netem.IFACE
        init_method = f"tcp://{master}:{EMULATED_PORT}"
    run_rank(run_dir, rank, world, init_method)
    from repro.worker import finished_rank_exit

    finished_rank_exit()


def spawn(run_dir: str, workers: int, network=None) -> None:
    """`workers` spawned ranks; on `network` (repro.netem.EmulatedNetwork), each in its
    own namespace, meeting at rank 0's address over the emulated links."""
    import torch.multiprocessing as mp

    init_file = os.path.join(os.path.abspath(run_dir), ".rendezvous")
    if os.path.exists(init_file):
        os.remove(init_file)
    extra: tuple = ()
    if network is not None:
        extra = ([network.namespace(r) for r in range(workers)], network.address(0))
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        ctx = mp.start_processes(_spawn_entry, args=(run_dir, workers, init_file, *extra),
                                 nprocs=workers, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=1):
                pass
        except BaseException:
            for p in ctx.processes:  # interrupted or failed: no rank outlives the launch
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            raise
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        if os.path.exists(init_file):
            os.remove(init_file)


def torchrun(run_dir: str, cfg: DictConfig, network=None) -> None:
    """An elastic launch: --max-restarts relaunches all ranks after a failure, and they
    resume from the last checkpoint. On `network` (repro.netem.EmulatedNetwork): one
    torchrun agent per rank, each inside its rank's namespace, meeting at rank 0's
    address over the emulated links (a static rendezvous)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cfg.cluster.threads_per_worker)))
    tail = ["--max-restarts", str(cfg.cluster.max_restarts), "-m", "repro.worker", run_dir]
    if network is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(cfg.cluster.workers), *tail]
        result = subprocess.run(cmd, env=env, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"torchrun exited with {result.returncode} for {run_dir}")
        return
    from repro import netem

    env["GLOO_SOCKET_IFNAME"] = netem.IFACE
    workers = cfg.cluster.workers
    agents = [subprocess.Popen(
        [*network.exec_prefix(r), sys.executable, "-m", "torch.distributed.run",
         "--nnodes", str(workers), "--node-rank", str(r), "--nproc-per-node", "1",
         "--master-addr", network.address(0), "--master-port", str(EMULATED_PORT), *tail],
        env=env) for r in range(workers)]
    try:
        codes = [a.wait() for a in agents]
    finally:
        for a in agents:  # interrupted: no agent outlives the network it runs in
            if a.poll() is None:
                a.terminate()
        for a in agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
    failed = [f"rank {r}: {c}" for r, c in enumerate(codes) if c != 0]
    if failed:
        raise RuntimeError(f"torchrun exited non-zero for {run_dir} ({', '.join(failed)})")
