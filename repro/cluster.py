"""Sweeps on a SLURM cluster through Hydra's submitit launcher configs.

    repro train -m compressor=topk,dgc cluster=multi_node cluster.nodes=2 cluster.workers=16 \\
        hydra/launcher=submitit_slurm hydra.launcher.partition=gpu hydra.launcher.timeout_min=240

The launcher's settings are Hydra's own (hydra-submitit-launcher's SlurmQueueConf /
LocalQueueConf: partition, timeout_min, gpus_per_node, account, ...), composed by Hydra from
`hydra/launcher=...` and `hydra.launcher.*` overrides. As everywhere in this suite, Hydra
only composes: `repro train` plans every run of the sweep (validated, one run directory
each, its config.yaml written), then submits ONE job per run with submitit. A job runs one
task per node; each task starts torchrun for its node, with the rendezvous (the first
node of the allocation, SLURM's job id) taken from SLURM's environment
(`torchrun_command`). With `hydra/launcher=submitit_local` the jobs run on this machine,
each launching its run as `repro train` would.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

LAUNCHERS = ("submitit_slurm", "submitit_local")
RENDEZVOUS_PORT = 29500


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the run's overrides, the launcher's: hydra/launcher=... and hydra.launcher.*)."""
    run, launcher = [], []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        (launcher if key == "hydra/launcher" or key.startswith("hydra.launcher.") else run).append(o)
    return run, launcher


def launcher_config(overrides: Sequence[str]) -> dict[str, Any] | None:
    """The submitit launcher's settings composed by Hydra from `overrides` (None when no
    launcher is chosen), with submitit_folder placed by the caller."""
    if not overrides:
        return None
    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "hydra/launcher"]
    if not chosen:
        raise ValueError("hydra.launcher.* overrides need a launcher: add "
                         f"hydra/launcher={' or hydra/launcher='.join(LAUNCHERS)}")
    if chosen[-1] not in LAUNCHERS:
        raise ValueError(f"hydra/launcher={chosen[-1]}: choose one of {', '.join(LAUNCHERS)}")
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401 - registers the configs
    except ImportError:
        raise ValueError("hydra/launcher=submitit_* needs hydra-submitit-launcher: pip install "
                         '-e ".[slurm]"') from None
    from omegaconf import OmegaConf

    from repro import config as config_mod

    config_mod.conf_dir()  # a missing tree is named as such, not as a bad override
    try:
        cfg = config_mod.hydra_compose(overrides, hydra=True)
    except Exception as exc:  # noqa: BLE001 - Hydra's own error, one line
        raise ValueError(f"bad launcher override: {str(exc).splitlines()[0]}") from None
    node = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    # Hydra's interpolations point at its sweep dir and job name, which this launcher does
    # not use: the caller sets the folder, the job name is the run's.
    node.pop("submitit_folder", None)
    node.pop("name", None)
    node["kind"] = chosen[-1].removeprefix("submitit_")
    return node


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list ("gpu[01-03,07],cpu5") as host names, in order."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.fullmatch(r"([^\[]+)\[([^\]]*)\]", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}")
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def torchrun_command(env: Mapping[str, str], procs_per_node: int, run_dir: str,
                     port: int = RENDEZVOUS_PORT, max_restarts: int = 0) -> list[str]:
    """The torchrun command of one node's task in a SLURM job: every node's torchrun
    meets at the allocation's first host (c10d rendezvous) under the job's id."""
    missing = [k for k in ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_ID") if k not in env]
    if missing:
        raise ValueError(f"not inside a SLURM job: {', '.join(missing)} unset")
    hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
    nodes = int(env["SLURM_NNODES"])
    if nodes != len(hosts):
        raise ValueError(f"SLURM_NNODES={nodes} but SLURM_JOB_NODELIST names {len(hosts)} hosts")
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nodes}", f"--nproc-per-node={procs_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}",
            f"--rdzv-id={env['SLURM_JOB_ID']}", f"--max-restarts={max_restarts}",
            "-m", "repro.worker", run_dir]


def describe_job(run_dir: str, settings: dict[str, Any]) -> list[str]:
    """What `submit` would hand the scheduler for one run, for a dry run: the job's
    #SBATCH lines as submitit writes them (slurm), or its settings (local)."""
    settings = dict(settings)
    kind = settings.pop("kind")
    settings.pop("_target_", None)
    settings.pop("max_num_timeout", None)
    folder = os.path.join(os.path.dirname(run_dir), ".submitit", "%j")
    head = f"job: runs repro.cluster.run_job({run_dir!r})"
    why = ""
    if kind == "slurm":
        try:
            from submitit.slurm import slurm

            names = slurm.SlurmExecutor._equivalence_dict()
            params = {names.get(k, k): v for k, v in settings.items()
                      if v is not None and v != {}}
            if "mem" in params:
                params["mem"] = slurm._convert_mem(params["mem"])
            text = slurm._make_sbatch_string(command="<python -m submitit.core._submit>",
                                             folder=folder, **params)
            return [head + ", submitted with:"] + [
                line for line in text.splitlines() if line.startswith("#SBATCH")]
        except Exception as exc:  # noqa: BLE001 - another submitit: the settings as given
            why = f"; submitit's sbatch text unavailable: {exc}"
    shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()) if v is not None)
    return [f"{head} ({kind}: {shown}{why})"]


def run_job(run_dir: str) -> str:
    """One submitted run (inside its job): on SLURM, this node's torchrun; elsewhere the
    run as `repro train` launches it. Returns the run directory. The job's first node
    holds the run folder's lock while it runs (repro.runfolder; a second job of the same
    run stops, naming the first)."""
    import contextlib

    from repro import runfolder

    first_node = os.environ.get("SLURM_NODEID", "0") == "0"
    with runfolder.locked(run_dir) if first_node else contextlib.nullcontext():
        return _run_job(run_dir)


def _run_job(run_dir: str) -> str:
    import subprocess

    from repro import config as config_mod
    from repro import runner

    cfg = config_mod.load(os.path.join(run_dir, "config.yaml"))
    config_mod.check_device(cfg)  # here, where the run trains (not on the login node)
    if "SLURM_JOB_ID" in os.environ and cfg.cluster.mode == "torchrun":
        per_node = cfg.cluster.workers // cfg.cluster.nodes
        cmd = torchrun_command(os.environ, per_node, run_dir,
                               max_restarts=cfg.cluster.max_restarts)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, cfg.cluster.threads_per_worker)))
        result = subprocess.run(cmd, env=env)  # an argument list: no shell
        if result.returncode != 0:
            raise RuntimeError(f"torchrun exited with {result.returncode} for {run_dir}")
        return run_dir
    runner.run_prepared(run_dir, cfg)
    return run_dir


def submit(run_dirs: Sequence[str], settings: dict[str, Any], folder: str,
           wait: bool = True, out=print) -> list[Any]:
    """One submitit job per run directory (each holding its config.yaml already), with
    the launcher's settings as hydra-submitit-launcher passes them (the common queue keys
    as they are, the rest prefixed with the executor's name); waits for the jobs when
    `wait`, re-raising a job's error."""
    import dataclasses

    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    settings = dict(settings)
    kind = settings.pop("kind")
    settings.pop("_target_", None)
    init = {}
    if kind == "slurm":
        init["max_num_timeout"] = settings.pop("max_num_timeout", 0)
    executor = submitit.AutoExecutor(cluster=kind, folder=folder, **init)
    common = {f.name for f in dataclasses.fields(BaseQueueConf)}
    executor.update_parameters(**{
        k if k in common else f"{kind}_{k}": v for k, v in settings.items()
        if v is not None and v != {}})
    jobs = []
    for run_dir in run_dirs:
        job = executor.submit(run_job, run_dir)
        out(f"[submitted] {run_dir} (job {job.job_id})")
        jobs.append(job)
    if wait:
        for job in jobs:
            job.result()
    return jobs
