"""Structured configs: a misspelled key fails when the config is composed, before launch.

The Hydra tree in conf/ mirrors these dataclasses (groups compressor/, task/, cluster/,
logger/, experiment/). `validate` checks what a schema cannot: that the compressor and
task exist, that compressor parameters are ones it accepts, ratios in range, THC's
integer width, data paths present — all before any worker starts.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class CompressorConfig:
    name: str = "none"
    # δ = k/d for compressors that take a ratio; ignored (must stay null) for others.
    ratio: Optional[float] = None
    # "default" (the compressor's own), "none", "residual" or "momentum".
    feedback: str = "default"
    # feedback=momentum (DGC's momentum correction, which replaces SGD's momentum): its
    # momentum; null = the task's SGD momentum (0.9 for an Adam task, DGC's value).
    momentum: Optional[float] = None
    # What one exchange covers: "default" (the compressor's paper's setting: "model" for
    # DEFT and CLT-k, "layer" otherwise), "layer" (per parameter tensor), "bucket" (per
    # DDP bucket, real ranks only) or "model" (the worker's whole gradient).
    granularity: str = "default"
    # DGC's local gradient clipping (each worker clips its gradient to the task's clip
    # norm × N^-1/2 before accumulating it, instead of clipping the aggregate): "auto" (on
    # with momentum correction where the task clips), "on" or "off".
    local_clip: str = "auto"
    # Any other constructor parameter of the compressor, checked against the registry.
    params: dict[str, Any] = field(default_factory=dict)
    # Dense steps before compression starts (DRAGONN compress-iter, PowerSGD start iter).
    start_step: int = 0
    # DGC warm-up: ratio decays exponentially from warmup_ratio to ratio over these steps.
    warmup_steps: int = 0
    warmup_ratio: float = 0.25
    # Tensors below this size are allreduced densely (static cut-off).
    min_numel: int = 0
    # DRAGONN Eq. 1 efficiency-aware selection with the cluster's network parameters.
    efficiency_aware: bool = False
    # At "layer" granularity, a sparsifier's per-tensor exchanges of a bucket (or of the
    # simulated worker's step) run as one: each tensor selected alone, the same results
    # bit for bit, one payload and one decode; false: one exchange per tensor.
    batch: bool = True


def _open_mapping() -> DictConfig:
    """An empty mapping that stays open to new keys when Hydra closes the config (struct
    mode): task.hparams.KEY=VALUE adds a key beside the size blocks without a `+`, and a
    misspelled key reaches `validate`, which names the task's own keys (a schema cannot:
    they differ from task to task)."""
    node = OmegaConf.create({})
    OmegaConf.set_struct(node, False)
    return node


@dataclass
class HFSourceConfig:
    """task.data=hf: datasets.load_dataset(name, config, revision=revision), from the hf:
    block of conf/task/<name>.yaml for the tasks whose papers' data sets are on the Hub."""

    name: Optional[str] = None
    config: Optional[str] = None
    revision: Optional[str] = None  # a Hub branch, tag or commit (null: main)


@dataclass
class TaskConfig:
    name: str = "cifar10_resnet20"
    size: str = "smoke"  # smoke | paper
    data: str = "standin"  # standin | canonical | hf
    data_root: Optional[str] = None
    hf: HFSourceConfig = field(default_factory=HFSourceConfig)
    # The task's hyper-parameters, from conf/task/<name>.yaml: a `paper:` and a `smoke:`
    # block. A key beside them overrides the run's size (task.hparams.momentum=0),
    # task.hparams.paper.KEY=VALUE one size. Keys and ranges: tasks.hyperparams and the
    # task class. Empty (a config written without it): the task file's values.
    hparams: Any = field(default_factory=_open_mapping)
    # Short forms of task.hparams.batch_size / lr / clip (null: not set).
    batch_size: Optional[int] = None  # per worker
    lr: Optional[float] = None
    clip: Optional[float] = None  # gradient-norm clipping


TASK_SHORT_FORMS = ("batch_size", "lr", "clip")


def task_hparams(cfg: DictConfig) -> dict[str, Any]:
    """What this run sets of its task's hyper-parameters, over the task file's values:
    task.hparams for task.size (its block, the keys beside the blocks on top) and the short
    forms task.batch_size / lr / clip, which must agree with a task.hparams key beside the
    blocks where both are given."""
    from tasks.hyperparams import for_size

    node = cfg.task.get("hparams")
    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    values = for_size(node, cfg.task.size)
    for key in TASK_SHORT_FORMS:
        short = cfg.task.get(key)
        if short is None:
            continue
        beside = node.get(key) if isinstance(node, dict) else None
        if beside is not None and beside != short:
            raise ValueError(
                f"task.{key}={short} and task.hparams.{key}={beside} disagree: task.{key} is "
                f"short for task.hparams.{key}; set one of them")
        values[key] = short
    return values


def build_task(cfg: DictConfig):
    """The run's task as every worker builds it: task_hparams(cfg) over the task file's
    values, checked by the task."""
    import tasks

    hf = cfg.task.get("hf")
    hf = OmegaConf.to_container(hf, resolve=True) if OmegaConf.is_config(hf) else hf
    return tasks.build_task(cfg.task.name, size=cfg.task.size, data=cfg.task.data,
                            data_root=cfg.task.data_root, seed=cfg.seed,
                            hparams=task_hparams(cfg), hf=hf)


@dataclass
class ClusterConfig:
    name: str = "local_cpu"
    # spawn: n local processes (gloo/NCCL); torchrun: an elastic launch (restarts);
    # simulated: n gradient computations per step in one process (THC Sec. 8.3);
    # replicas: as simulated, but each worker keeps its own model replica and optimizer,
    # stepped with the aggregate that worker received (THC Sec. 8.3's packet loss).
    mode: str = "spawn"
    workers: int = 2  # ranks in all (simulated: workers)
    # Machines the ranks spread over (torchrun; SLURM jobs: one torchrun per node with
    # workers/nodes ranks each, rendezvous from SLURM's environment, repro.cluster).
    nodes: int = 1
    backend: str = "gloo"
    device: str = "cpu"
    threads_per_worker: int = 1
    max_restarts: int = 0
    # Seconds a collective may wait for the other ranks before the run stops, naming the
    # rank that stopped answering (torch.distributed's own default is 30 min for gloo).
    timeout_s: float = 300.0
    # Every N steps compare a checksum of every parameter across ranks and stop, naming
    # the first tensor that differs (0: never).
    replica_check_every: int = 0
    # cluster.mode=replicas: average the replicas' parameters and buffers every N steps
    # (THC's periodic model synchronisation; 0: never).
    sync_every: int = 0
    # The cluster the measured step is projected onto (clearly labelled "projected").
    target_workers: int = 16
    bandwidth_gbps: float = 25.0
    latency_us: float = 5.0
    # The network between the ranks. "host": this machine's own (or the cluster's, across
    # nodes). "emulated": each rank in its own network namespace on one machine, its link
    # shaped to bandwidth_gbps (tc) with latency_ms of one-way delay added (repro.netem;
    # root, iproute2, gloo on the CPU). The measured step then includes that link.
    network: str = "host"
    latency_ms: float = 0.0


@dataclass
class LoggerConfig:
    wandb: bool = True
    # W&B's project, entity, notes (null: WANDB_PROJECT, WANDB_ENTITY, WANDB_NOTES, else
    # the project "gradcomp-repro"), tags added to the run's own (and WANDB_TAGS), and its
    # group (null: the run's group=, or for a sweep without one the sweep's command).
    project: Optional[str] = None
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    notes: Optional[str] = None
    group: Optional[str] = None
    log_every: int = 1
    nmse: bool = False  # exact-average NMSE: one extra dense allreduce on log steps
    progress: bool = True
    verbose: bool = False  # W&B's own console output (banner, sparklines); silenced when false


@dataclass
class TrainConfig:
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    steps: int = 100  # optimizer steps (all workers together)
    eval_every: int = 50  # 0: evaluate only at the end
    eval_batches: Optional[int] = 20
    checkpoint_every: int = 0  # a checkpoint every N steps (0: not by step count)
    # ... and at least every N seconds of training (0: not by time). Whatever these say, a
    # run stopped by SIGTERM / SIGINT writes one at the step it stopped.
    checkpoint_every_s: float = 600.0
    keep_checkpoints: int = 2  # the newest N complete checkpoints are kept (0: all)
    # A checkpoint at the last step, from which the run given more steps goes on; the
    # figure pipeline turns it off, its finished runs are not extended.
    checkpoint_at_end: bool = True
    # false: DDP's built-in allreduce instead of our comm hook (compressor=none, real
    # ranks only): the baseline of the hook-overhead benchmark (`repro hookbench`).
    comm_hook: bool = True
    # A NaN or an Inf in any worker's gradient, decided once for all workers: "error" (every
    # rank stops with the same error, naming the step, the tensor and the rank), "skip"
    # (every rank skips the step, as torch.amp.GradScaler does) or "off" (no check).
    nonfinite: str = "error"
    group: str = "default"  # W&B group and runs/<group>/ folder (the sweep name)
    runs_root: str = "runs"
    run_dir: Optional[str] = None  # fixed by the launcher: runs/<group>/<run name>
    name: Optional[str] = None  # run name; derived from compressor/task/ratio/workers


# -- the Hydra tree and its composition ----------------------------------------------------------
def conf_dir() -> str:
    """The Hydra config tree: $GRADCOMP_CONF, else conf/ beside the packages (a clone). The
    task files live in it, so tasks.hyperparams finds it."""
    from tasks.hyperparams import conf_dir as tree

    return tree()


def register_schema() -> None:
    """The schema in Hydra's ConfigStore (a process-wide store): built once, 13 ms."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "base_config.yaml" not in store.repo:
        store.store(name="base_config", node=TrainConfig)


def hydra_compose(overrides: Sequence[str], hydra: bool = False) -> DictConfig:
    """conf/config.yaml composed by Hydra with `overrides` over the schema; hydra=True keeps
    Hydra's own node (its launcher settings). Hydra's exceptions pass through (repro.launch
    turns them into one-line errors)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(overrides),
                       return_hydra_config=hydra)


# -- what keys a run ------------------------------------------------------------------------------
# Config keys that cannot change a run's results, left out when a run's config is compared
# with the config.yaml already in its directory and from its checkpoints' config_hash:
# where the run lives (run_dir, runs_root; moving or copying a runs folder must not
# invalidate its runs), how progress is shown or mirrored (the progress bar, W&B logging
# and its project, entity, tags, notes, group) and how often checkpoints are written and
# kept (a resumed run equals an uninterrupted one), none of which touches the training
# itself or the local metrics.jsonl / summary.json.
RESULT_NEUTRAL_KEYS = ("run_dir", "runs_root", "logger.progress", "logger.wandb", "logger.project",
                       "logger.entity", "logger.tags", "logger.notes", "logger.group",
                       "checkpoint_every", "checkpoint_every_s", "keep_checkpoints",
                       "checkpoint_at_end")


def within(key: str, keys: Sequence[str]) -> bool:
    """Whether the dotted `key` is one of `keys` or lies under one ("logger.tags.0" under
    "logger.tags")."""
    return any(key == k or key.startswith(k + ".") for k in keys)


def flatten_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value; lists are leaves, an empty mapping contributes nothing."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten_config(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def without_keys(node: Any, keys: Sequence[str], prefix: str = "") -> Any:
    """A nested mapping (a config as plain containers) without the dotted `keys` and what
    lies under them."""
    if not isinstance(node, dict):
        return node
    return {k: without_keys(v, keys, f"{prefix}{k}.") for k, v in node.items()
            if not within(f"{prefix}{k}", keys)}


def config_hash(cfg: DictConfig) -> str:
    """SHA-256 of the run's resolved config, without the keys that cannot change its
    results (RESULT_NEUTRAL_KEYS: where the run lives, how progress shows) and without
    `steps`: a run given more steps goes on from its checkpoints."""
    data = OmegaConf.to_container(cfg, resolve=True)
    text = json.dumps(without_keys(data, (*RESULT_NEUTRAL_KEYS, "steps")), sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


MAX_WORKERS = 1024  # the pre-launch probe exchanges among this many workers in ~2.5 s
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@functools.cache
def _structured() -> DictConfig:
    return OmegaConf.structured(TrainConfig)


def schema() -> DictConfig:
    """A fresh structured config of TrainConfig: a copy of one built per process (building
    it walks the dataclasses, 13 ms; the copy takes 2.5)."""
    return copy.deepcopy(_structured())


def check_path_component(key: str, value: Any) -> None:
    """A name used as one folder of a path: not empty, not "." or "..", no separator,
    no NUL; else a ValueError naming the key."""
    text = str(value)
    seps = [s for s in (os.sep, os.altsep, "/") if s]
    if text in ("", ".", "..") or any(s in text for s in seps) or "\0" in text:
        raise ValueError(f"{key}={text!r} must be one folder name (no {'/'.join(dict.fromkeys(seps))}, "
                         "not '.' or '..', not empty): it names a folder under runs_root; to put "
                         "runs elsewhere set runs_root")


COMPARE_FOLDER = "compare"  # runs/<group>/compare/: where `repro compare` writes


def check_run_names(cfg: DictConfig) -> None:
    """group and name are single folder names, and the run folder lies inside runs_root."""
    check_path_component("group", cfg.group)
    if cfg.name is not None:
        check_path_component("name", cfg.name)
        if str(cfg.name) == COMPARE_FOLDER:
            raise ValueError(f"name={COMPARE_FOLDER} is the folder `repro compare` writes into "
                             "beside a group's runs; choose another name")
    root = os.path.normpath(os.path.abspath(str(cfg.runs_root)))
    run_dir = os.path.normpath(os.path.abspath(resolve_run_dir(cfg)))
    if os.path.commonpath([root, run_dir]) != root or run_dir == root:
        raise ValueError(f"the run folder {run_dir} lies outside runs_root={cfg.runs_root}; set "
                         "runs_root (and group, name) instead of run_dir")


def check_choice(key: str, value: Any, allowed: list[str] | tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def check_at_least(key: str, value: Any, low: int) -> None:
    if value < low:
        raise ValueError(f"{key}={value} must be ≥ {low}")


def check_device(cfg: DictConfig) -> None:
    """cluster.device names a device this machine has (run where the run trains: here,
    or inside its submitted job)."""
    if cfg.cluster.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"cluster.device={cfg.cluster.device!r} but no CUDA device is present; use cluster.device=cpu")


def check_extras(cfg: DictConfig) -> None:
    """The optional packages the run's task needs are installed (transformers for the
    transformer tasks, datasets for task.data=hf): else one line naming the extra."""
    import tasks
    from tasks.base import missing_extras

    missing = missing_extras(tasks.get_task_class(cfg.task.name), cfg.task.data)
    if missing:
        module, extra, why = missing[0]
        raise ValueError(f"task={cfg.task.name}{why} needs the `{module}` package, which is not "
                         f"installed: pip install -e \".[{extra}]\" (nothing was created)")


def validate(cfg: DictConfig, device: bool = True):
    """Everything that can be checked before any worker starts; the task, as built for
    the check. Raises ValueError / FileNotFoundError naming the key and the allowed
    values. device=False leaves the device check to where the run trains (a job
    submitted from a login node)."""
    import compressors
    from compressors.base import resolve_granularity

    c = cfg.compressor
    names = compressors.list_compressors()
    check_choice("compressor.name", c.name, names)
    check_choice("compressor.feedback", c.feedback, ("default", "none", "residual", "momentum"))
    check_choice("compressor.granularity", c.granularity, ("default", "layer", "bucket", "model"))
    check_choice("compressor.local_clip", c.local_clip, ("auto", "on", "off"))
    if c.momentum is not None and not 0.0 <= c.momentum < 1.0:
        raise ValueError(f"compressor.momentum={c.momentum} must lie in [0, 1) (or null: the "
                         "task's SGD momentum)")
    if cfg.task.clip is not None and not cfg.task.clip > 0:
        raise ValueError(f"task.clip={cfg.task.clip} must be > 0 (or null: the task's own)")
    if cfg.task.lr is not None and not cfg.task.lr > 0:
        raise ValueError(f"task.lr={cfg.task.lr} must be > 0 (or null: task.hparams.lr)")
    if cfg.task.batch_size is not None and cfg.task.batch_size < 1:
        raise ValueError(f"task.batch_size={cfg.task.batch_size} must be an integer >= 1 (per "
                         "worker; or null: task.hparams.batch_size)")
    check_choice("cluster.mode", cfg.cluster.mode, ("spawn", "torchrun", "simulated", "replicas"))
    check_choice("cluster.backend", cfg.cluster.backend, ("gloo", "nccl"))
    check_choice("task.size", cfg.task.size, ("smoke", "paper"))
    from tasks.base import DATA_KINDS

    check_choice("task.data", cfg.task.data, DATA_KINDS)
    check_at_least("cluster.workers", cfg.cluster.workers, 1)
    if cfg.cluster.workers > MAX_WORKERS:
        raise ValueError(f"cluster.workers={cfg.cluster.workers} is more than this suite runs "
                         f"(at most {MAX_WORKERS} ranks or simulated workers); to project onto a "
                         "larger cluster, set cluster.target_workers")
    check_at_least("cluster.threads_per_worker", cfg.cluster.threads_per_worker, 1)
    check_at_least("cluster.max_restarts", cfg.cluster.max_restarts, 0)
    check_at_least("cluster.replica_check_every", cfg.cluster.replica_check_every, 0)
    check_at_least("cluster.nodes", cfg.cluster.nodes, 1)
    if cfg.cluster.workers % cfg.cluster.nodes:
        raise ValueError(f"cluster.workers={cfg.cluster.workers} ranks do not split evenly over "
                         f"cluster.nodes={cfg.cluster.nodes} machines: make workers a multiple "
                         "of nodes (workers counts every rank)")
    if cfg.cluster.nodes > 1 and cfg.cluster.mode != "torchrun":
        raise ValueError(f"cluster.nodes={cfg.cluster.nodes} needs cluster.mode=torchrun (one "
                         f"torchrun per machine); got cluster.mode={cfg.cluster.mode}")
    check_at_least("cluster.sync_every", cfg.cluster.sync_every, 0)
    check_network(cfg.cluster)
    if cfg.cluster.sync_every and cfg.cluster.mode != "replicas":
        raise ValueError(f"cluster.sync_every={cfg.cluster.sync_every} averages the model replicas "
                         f"of cluster.mode=replicas, but cluster.mode={cfg.cluster.mode} keeps one "
                         "model; set cluster.mode=replicas or cluster.sync_every=0")
    if not 0 < cfg.cluster.timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"cluster.timeout_s={cfg.cluster.timeout_s} must be > 0 and at most "
                         f"{MAX_TIMEOUT_S:g} (a week): seconds a collective may wait for the "
                         "other ranks")
    check_choice("nonfinite", cfg.nonfinite, ("error", "skip", "off"))
    check_at_least("steps", cfg.steps, 1)
    for key in ("eval_every", "checkpoint_every", "keep_checkpoints", "logger.log_every",
                "compressor.start_step", "compressor.warmup_steps", "compressor.min_numel"):
        check_at_least(key, OmegaConf.select(cfg, key), 0)
    if not 0 <= cfg.checkpoint_every_s < math.inf:
        raise ValueError(f"checkpoint_every_s={cfg.checkpoint_every_s} must be a number of "
                         "seconds >= 0 (0: no checkpoints by time)")
    check_run_names(cfg)
    if device:
        check_device(cfg)
    if cfg.cluster.mode in ("simulated", "replicas") and c.granularity == "bucket":
        raise ValueError("compressor.granularity=bucket needs DDP's buckets, which simulated "
                         "workers do not have; use compressor.granularity=layer or a real-rank "
                         "cluster (cluster.mode=spawn or torchrun)")
    if not cfg.comm_hook and (c.name != "none" or cfg.cluster.mode in ("simulated", "replicas")):
        raise ValueError("comm_hook=false (DDP's built-in allreduce) needs compressor=none and "
                         f"real ranks (cluster.mode=spawn or torchrun); got compressor={c.name}, "
                         f"cluster.mode={cfg.cluster.mode}")
    defaults = compressors.default_params(c.name)
    accepted = sorted(defaults)
    if c.ratio is not None and "ratio" not in defaults:
        raise ValueError(
            f"compressor.ratio is set but {c.name!r} takes no ratio; set compressor.ratio=null "
            f"(its parameters: {', '.join(accepted) or 'none'})"
        )
    for key in c.params:
        if key not in defaults or key == "ratio":
            allowed = [k for k in accepted if k != "ratio"]
            raise ValueError(
                f"compressor.params.{key} is not a parameter of {c.name!r}; "
                f"allowed: {', '.join(allowed) or 'none'}"
                + (" (set the ratio with compressor.ratio)" if key == "ratio" else "")
            )
    if c.warmup_steps and not (0 < c.warmup_ratio <= 1):
        raise ValueError(f"compressor.warmup_ratio={c.warmup_ratio} must lie in (0, 1]")
    if c.warmup_steps and c.ratio is None:
        raise ValueError(f"compressor.warmup_steps={c.warmup_steps} is DGC's ratio warm-up, but "
                         f"{c.name!r} takes no ratio; set compressor.warmup_steps=0")
    # Constructing the compressor runs its own parameter checks (ratio range, widths) ...
    try:
        compressor = build_compressor(cfg, world_size=cfg.cluster.workers)
    except (ValueError, TypeError) as exc:
        keys = "compressor.ratio / compressor.params" if c.ratio is not None else "compressor.params"
        raise ValueError(f"compressor={c.name} ({keys}): {exc}") from None
    try:  # the exchange's scope: DEFT refuses granularity=layer, with the reason
        resolve_granularity(compressor, c.granularity)
    except ValueError as exc:
        raise ValueError(f"compressor.granularity={c.granularity}: {exc}") from None
    # ... and one tiny simulated exchange with cluster.workers workers catches what depends
    # on the number of workers (THC's integer sums overflowing, too many stragglers).
    try:
        probe_world_size(compressor, cfg.cluster.workers, cfg.seed)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"compressor={c.name} with cluster.workers={cfg.cluster.workers}: {exc}") from None
    import tasks

    check_choice("task.name", cfg.task.name, tasks.list_tasks())
    check_extras(cfg)
    if cfg.task.data == "canonical" and cfg.task.data_root and not os.path.exists(cfg.task.data_root):
        raise FileNotFoundError(
            f"task.data_root={cfg.task.data_root!r} does not exist; point it at the "
            f"dataset or use task.data=standin"
        )
    # The task's constructor checks its data (canonical files present, stand-ins installed),
    # its arguments and its hyper-parameters: build it here so a bad path or value fails
    # before any worker starts. task.hparams is checked first as written, both size blocks
    # and the keys beside them, so an error names the key the user typed.
    from tasks.hyperparams import HParamError, check_mapping

    try:
        hparams = cfg.task.hparams
        hparams = OmegaConf.to_container(hparams, resolve=True) if OmegaConf.is_config(hparams) else hparams
        check_mapping(hparams, cfg.task.name, tasks.get_task_class(cfg.task.name).accepted_hparams())
        task = build_task(cfg)
    except HParamError as exc:
        raise ValueError(f"task={cfg.task.name}: {exc.message('task.hparams.')}") from None
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"task={cfg.task.name} (task.data={cfg.task.data}, "
                                f"task.data_root={cfg.task.data_root}): {exc}") from None
    except ValueError as exc:
        raise ValueError(f"task={cfg.task.name}: {exc}") from None
    training_plan(cfg, compressor, task.hparams)  # momentum and clipping agree
    return task


def paper_schedule_note(cfg: DictConfig, task) -> str | None:
    """For task.size=paper, a warning when `steps` ends before the paper's schedule does:
    its epochs at this run's workers and batch size, and where its warm-up ends."""
    if cfg.task.size != "paper":
        return None
    h = task.hparams
    try:
        per_epoch = task.steps_per_epoch(cfg.cluster.workers)
    except ValueError:
        return None
    total = int(float(h.get("epochs", 0) or 0) * per_epoch)
    warmup = int(h.get("warmup_steps") or round(float(h.get("warmup_epochs", 0) or 0) * per_epoch))
    if not total or cfg.steps >= total:
        return None
    where = (f"inside its {warmup}-step learning-rate warm-up" if cfg.steps < warmup
             else f"at {100 * cfg.steps / total:.1f}% of it")
    return (f"task={cfg.task.name} task.size=paper: the paper's schedule is {h.get('epochs')} "
            f"epochs = {total} steps at {cfg.cluster.workers} workers × batch "
            f"{h.get('batch_size')}; steps={cfg.steps} ends {where} (set steps={total} to "
            "train all of it)")


@dataclass(frozen=True)
class TrainingPlan:
    """How a run combines the compressor with the task's optimizer and clipping."""

    feedback: str  # none | residual | momentum (resolved from "default")
    granularity: str  # layer | bucket | model (resolved from "default")
    # Momentum correction's momentum and Nesterov form (feedback=momentum), else None.
    correction_momentum: Optional[float]
    correction_nesterov: bool
    # The optimizer: "task" (the task's own), or "momentum_corrected_sgd": SGD whose
    # momentum applies only to weight decay, the gradient's being in the feedback.
    optimizer: str
    local_clip: Optional[float]  # each worker's clip norm before N^-1/2 (DGC), or None
    global_clip: Optional[float]  # clip norm of the aggregate (the usual place), or None

    def describe(self) -> dict[str, Any]:
        return dict(self.__dict__)


def training_plan(cfg: DictConfig, compressor, hparams: dict[str, Any]) -> TrainingPlan:
    """Resolve feedback, granularity, momentum and clipping for a run. DGC's momentum
    correction replaces the optimizer's momentum (Lin et al. 2018, Section 3.2): with
    feedback=momentum and an SGD task, the correction takes the task's momentum (unless
    compressor.momentum is set) and the optimizer keeps momentum only for weight decay,
    so momentum is never applied twice. An Adam task keeps Adam (DRAGONN's setting:
    Adam with memory momentum correction). Local clipping (compressor.local_clip) moves
    the task's clipping to each worker, before accumulation, at norm × N^-1/2."""
    from compressors.base import resolve_granularity

    c = cfg.compressor
    feedback = compressor.default_feedback if c.feedback == "default" else c.feedback
    granularity = resolve_granularity(compressor, c.granularity)
    clip = cfg.task.clip if cfg.task.clip is not None else hparams.get("clip")
    clip = float(clip) if clip else None
    momentum, nesterov, optimizer = None, False, "task"
    if feedback == "momentum":
        if hparams.get("optimizer") == "sgd":
            task_m = float(hparams.get("momentum", 0.0) or 0.0)
            momentum = task_m if c.momentum is None else float(c.momentum)
            nesterov = bool(hparams.get("nesterov", False)) and momentum > 0
            optimizer = "momentum_corrected_sgd"
        else:
            momentum = 0.9 if c.momentum is None else float(c.momentum)
    elif c.momentum is not None:
        raise ValueError(
            f"compressor.momentum={c.momentum} is the momentum of DGC's momentum correction, "
            f"but this run's feedback is {feedback!r}: set compressor.feedback=momentum, or "
            "leave compressor.momentum=null (the optimizer's momentum is the task's)")
    local = c.local_clip == "on" or (c.local_clip == "auto" and feedback == "momentum"
                                     and clip is not None)
    if local and clip is None:
        raise ValueError(
            f"compressor.local_clip=on clips each worker's gradient at the task's clip norm "
            f"× N^-1/2, but task {cfg.task.name!r} does not clip: set task.clip=NORM, or "
            "compressor.local_clip=auto/off")
    if local and granularity == "bucket":
        raise ValueError(
            "compressor.local_clip needs each worker's whole gradient before anything is "
            "compressed, but compressor.granularity=bucket compresses each bucket as it "
            "arrives: use compressor.granularity=layer or model, or compressor.local_clip=off")
    return TrainingPlan(feedback=feedback, granularity=granularity,
                        correction_momentum=momentum, correction_nesterov=nesterov,
                        optimizer=optimizer, local_clip=clip if local else None,
                        global_clip=None if local else clip)


def probe_world_size(compressor, workers: int, seed: int = 0) -> None:
    """One simulated exchange of a small tensor on `workers` workers (milliseconds)."""
    import torch

    import compressors

    gen = torch.Generator().manual_seed(seed)
    layout = (compressors.Segment("w", 0, 192, (12, 16)), compressors.Segment("b", 192, 64, (64,)))
    grads = [torch.randn(256, generator=gen) for _ in range(workers)]
    compressors.SimulatedGroup(compressor, workers, feedback="none", seed=seed,
                               measure=False).step(grads, name="probe", step=0, layout=layout)


def compressor_params(cfg: DictConfig) -> dict[str, Any]:
    params = dict(OmegaConf.to_container(cfg.compressor.params, resolve=True))
    if cfg.compressor.ratio is not None:
        params["ratio"] = float(cfg.compressor.ratio)
    return params


def build_compressor(cfg: DictConfig, world_size: int):
    import compressors

    c = compressors.build(cfg.compressor.name, **compressor_params(cfg))
    check = getattr(c, "check_world_size", None)
    if check is not None:  # e.g. THC: the integer sum of n workers must fit its width
        check(world_size)
    return c


def check_network(cluster) -> None:
    """cluster.network and its link settings; an emulated network must be buildable here
    (repro.netem says in one line what is missing)."""
    check_choice("cluster.network", cluster.network, ("host", "emulated"))
    if not 0 < cluster.bandwidth_gbps < math.inf:
        raise ValueError(f"cluster.bandwidth_gbps={cluster.bandwidth_gbps} must be a finite "
                         "number > 0 (Gbit/s)")
    if not 0 <= cluster.latency_ms < math.inf:
        raise ValueError(f"cluster.latency_ms={cluster.latency_ms} must be a finite number >= 0 "
                         "(milliseconds of one-way delay on an emulated link)")
    if cluster.network != "emulated":
        if cluster.latency_ms:
            raise ValueError(f"cluster.latency_ms={cluster.latency_ms} delays an emulated link; "
                             "set cluster.network=emulated, or cluster.latency_ms=0")
        return
    wrong = []
    if cluster.mode not in ("spawn", "torchrun"):
        wrong.append(f"cluster.mode={cluster.mode} (use spawn or torchrun: real ranks)")
    if cluster.backend != "gloo" or not str(cluster.device).startswith("cpu"):
        wrong.append(f"cluster.backend={cluster.backend}, cluster.device={cluster.device} "
                     "(use gloo on the cpu)")
    if cluster.nodes != 1:
        wrong.append(f"cluster.nodes={cluster.nodes} (the emulated ranks share one machine: 1)")
    if wrong:
        raise ValueError("cluster.network=emulated runs gloo ranks on this machine; "
                         + "; ".join(wrong))
    from repro import netem

    if cluster.workers > netem.MAX_WORKERS:
        raise ValueError(f"cluster.workers={cluster.workers}: an emulated network links at most "
                         f"{netem.MAX_WORKERS} ranks")
    netem.check_available(latency=cluster.latency_ms > 0)


def run_name(cfg: DictConfig, key: str | None = None) -> str:
    """The run's folder name: `name=` where given, else its compressor, ratio, workers,
    mode, link, task, size and seed, then `key` (repro.launch.settings_key: a short hash
    of every other setting that differs from the defaults), so that each distinct
    config has its own folder."""
    if cfg.name:
        return str(cfg.name)
    parts = [cfg.compressor.name]
    if cfg.compressor.ratio is not None:
        parts.append(f"r{cfg.compressor.ratio:g}")
    if not cfg.comm_hook:
        parts.append("ddp_allreduce")
    parts += [f"w{cfg.cluster.workers}", cfg.cluster.mode]
    if cfg.cluster.network == "emulated":  # the link is part of what the run measures
        link = f"emu{cfg.cluster.bandwidth_gbps:g}g"
        parts.append(link + (f"{cfg.cluster.latency_ms:g}ms" if cfg.cluster.latency_ms else ""))
    parts += [cfg.task.name, cfg.task.size, f"s{cfg.seed}"]
    if key:
        parts.append(key)
    return "-".join(str(p) for p in parts).replace("/", "_")


def resolve_run_dir(cfg: DictConfig) -> str:
    if cfg.run_dir:
        return str(cfg.run_dir)
    return os.path.join(cfg.runs_root, cfg.group, run_name(cfg))


def save(cfg: DictConfig, path: str) -> None:
    """The resolved config as YAML, whole or not at all (repro.durable)."""
    from repro.durable import write_text

    write_text(path, OmegaConf.to_yaml(cfg, resolve=True))


def load(path: str) -> DictConfig:
    """A resolved config written by the launcher, checked against the schema."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config at {path}: launch runs with `repro train`")
    return OmegaConf.merge(schema(), OmegaConf.load(path))
