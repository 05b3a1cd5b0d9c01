"""One Hydra process composes configs, writes them into fixed run directories, and
launches the workers (spawned processes, torchrun, or the simulated trainer), which
read that file. No @hydra.main anywhere near the workers (lightning-hydra-template #393,
hydra #2070: ranks racing on output folders and re-running sweeps).

Sweeps: `repro train -m compressor=topk,dgc compressor.ratio=0.01,0.001` expands every
comma list (Hydra's own override grammar) into the cartesian product. A run directory is
named after a few config values only, so a run is keyed on its whole resolved config: a
run whose directory holds the same config.yaml is skipped when DONE and resumed from its
last checkpoint otherwise (re-running a sweep finishes only what is missing); a run whose
directory holds a different config.yaml is refused before anything starts, naming every
differing key, unless the caller asked to restart it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from repro import config as config_mod


def conf_dir() -> str:
    """The Hydra config tree: $GRADCOMP_CONF, else conf/ beside the packages (a clone)."""
    env = os.environ.get("GRADCOMP_CONF")
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "conf"
    if not (path / "config.yaml").exists():
        raise FileNotFoundError(
            f"no Hydra config tree at {path} (config.yaml missing); run from a clone of "
            "gradcomp-repro (pip install -e .) or set GRADCOMP_CONF to its conf/ folder"
        )
    return str(path)


def _register_schema() -> None:
    """The schema in Hydra's ConfigStore (a process-wide store): built once, 13 ms."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "base_config.yaml" not in store.repo:
        store.store(name="base_config", node=config_mod.TrainConfig)


def _hydra_compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    _register_schema()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose(overrides: list[str]) -> DictConfig:
    """The resolved config for one run (struct mode: an unknown key is an error). Errors
    are ValueErrors that name the key and the allowed keys or options."""
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return _hydra_compose(overrides)
    except ConfigCompositionException as exc:
        if type(exc).__name__ == "MissingConfigException":
            raise ValueError(_missing_option(str(exc))) from None
        cause = exc.__cause__ or exc
        full_key = getattr(cause, "full_key", None)
        if isinstance(cause, OmegaConfBaseException) and full_key:
            raise ValueError(_key_error(full_key, cause, overrides)) from None
        hint = " (comma lists are sweeps: add -m)" if "Ambiguous value" in str(cause) else ""
        raise ValueError(f"bad config: {_first_line(cause)}{hint}") from None
    except Exception as exc:  # Hydra's override grammar and missing group options
        name = type(exc).__name__
        if name == "MissingConfigException":
            raise ValueError(_missing_option(str(exc))) from None
        if name == "OverrideParseException":
            raise ValueError(f"bad override: {_first_line(exc)}") from None
        raise


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _key_error(full_key: str, cause: BaseException, overrides: list[str]) -> str:
    """'compressor.ratoi is not a config key; allowed keys under compressor: ...'."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    parent, _, leaf = full_key.rpartition(".")
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):  # e.g. a bad type
        return f"{full_key}: {_first_line(cause)}"
    if parent == "compressor.params":
        import compressors

        # The compressor this run selected: compose again without the bad key.
        rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != full_key]
        try:
            name = str(_hydra_compose(rest).compressor.name)
        except Exception:  # noqa: BLE001 - only for the message
            name = None
        if name in compressors.list_compressors():
            allowed = sorted(k for k in compressors.default_params(name) if k != "ratio")
            return (f"{full_key} is not a parameter of compressor {name!r}; allowed: "
                    f"{', '.join(allowed) or 'none (it takes no parameters)'}")
        return f"{full_key} is not a parameter of the selected compressor"
    node = config_mod.schema()
    for part in parent.split(".") if parent else []:
        node = node[part] if part in node else None
        if node is None:
            break
    allowed = sorted(node.keys()) if node is not None else []
    where = f"under {parent}" if parent else "at the top level"
    return (f"{full_key} is not a config key (misspelled?); allowed keys {where}: "
            f"{', '.join(allowed)}")


def _missing_option(message: str) -> str:
    """Hydra's 'Could not find compressor/nosuch ... Available options' as one line."""
    import re

    wanted = re.search(r"Could not find '([^']+)'", message)
    lines = message.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Available options in")), None)
    if wanted is None or start is None:
        return f"bad config: {_first_line(Exception(message))}"
    names = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        names.append(line.strip())
    group, _, choice = wanted.group(1).rpartition("/")
    return f"{group}={choice}: no such option; choose one of: {', '.join(names)}"


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of comma-list overrides, as Hydra's basic sweeper does."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


# Config keys that cannot change a run's results, left out when a run's config is compared
# with the config.yaml already in its directory: where the run lives (run_dir, runs_root;
# moving or copying a runs folder must not invalidate its runs), how progress is shown
# or mirrored (the progress bar, W&B logging and its project) and how often checkpoints
# are written and kept (a resumed run equals an uninterrupted one), none of which touches
# the training itself or the local metrics.jsonl / summary.json.
RESULT_NEUTRAL_KEYS = ("run_dir", "runs_root", "logger.progress", "logger.wandb", "logger.project",
                       "checkpoint_every", "checkpoint_every_s", "keep_checkpoints")

ON_CHANGE = ("refuse", "restart")

ABSENT = "(absent)"


@dataclass
class Change:
    """One config key whose value differs from the run directory's config.yaml."""

    key: str  # dotted, e.g. "compressor.params.sample_ratio"
    old: Any  # ABSENT where the saved config lacks the key
    new: Any  # ABSENT where this run's config lacks it

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


@dataclass
class Planned:
    overrides: list[str]
    cfg: DictConfig
    run_dir: str
    done: bool
    # How this run's config differs from the config.yaml already in run_dir (empty when
    # there is none, or it is the same up to RESULT_NEUTRAL_KEYS).
    changes: list[Change] = field(default_factory=list)
    # Why a run marked DONE cannot be trusted (its summary.json is missing or unreadable).
    broken: str | None = None


def _show(value: Any) -> str:
    if value is ABSENT:
        return ABSENT
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value.strip() == value and value else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _neutral(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESULT_NEUTRAL_KEYS)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value; lists are leaves, an empty mapping contributes nothing."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _as_saved(cfg: DictConfig) -> dict[str, Any]:
    """The config as config_mod.save writes it and a later plan() reads it back, so that
    an unchanged config compares equal value for value (floats, nulls, bools)."""
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(cfg, resolve=True)
    return OmegaConf.to_container(OmegaConf.create(text), resolve=True) or {}


def config_changes(cfg: DictConfig, saved_path: str) -> list[Change]:
    """Every key (dotted) whose value in `cfg` differs from the config at saved_path,
    RESULT_NEUTRAL_KEYS excepted; a key present on one side only (a config.yaml written by
    an older or newer schema) is a change, to or from ABSENT. No file: no changes."""
    from omegaconf import OmegaConf

    if not os.path.exists(saved_path):
        return []
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=True)
    except Exception as exc:  # noqa: BLE001 - a torn or hand-edited file is a change
        return [Change("config.yaml", f"unreadable ({_first_line(exc)})", "this run's config")]
    old = _flatten(saved if isinstance(saved, dict) else {})
    new = _flatten(_as_saved(cfg))
    keys = list(new) + [k for k in old if k not in new]
    return [Change(k, old.get(k, ABSENT), new.get(k, ABSENT))
            for k in keys if not _neutral(k) and old.get(k, ABSENT) != new.get(k, ABSENT)]


def _changed_message(changed: list[Planned]) -> str:
    runs = "1 run" if len(changed) == 1 else f"{len(changed)} runs"
    lines = [f"{runs} of this command: the config.yaml already in the run directory differs "
             "from the run's config, so the run is neither skipped, resumed nor overwritten "
             "(nothing was run):"]
    for p in changed:
        lines.append(f"  {p.run_dir}")
        lines += [f"    {c}" for c in p.changes]
    lines.append("Either discard the old run(s) and start afresh: `repro train --restart ...` "
                 "(launch.train(..., restart=True)); or keep both: give the new run(s) their "
                 "own directory with name=... (one run) or group=... (a sweep).")
    return "\n".join(lines)


def plan(overrides: list[str], multirun: bool, on_change: str = "refuse") -> list[Planned]:
    """Compose and validate every run of the (sweep) command before any starts, and
    compare each with the config.yaml already in its run directory. on_change="refuse"
    raises a ValueError naming every changed run, key, old and new value;
    on_change="restart" returns the changed runs as not done, with their `changes`, for
    the caller to discard (see discard) and run afresh."""
    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change={on_change!r}; choose one of: {', '.join(ON_CHANGE)}")
    combos = expand_sweep(overrides) if multirun else [list(overrides)]
    planned = []
    for combo in combos:
        cfg = compose(combo)
        config_mod.validate(cfg)
        run_dir = config_mod.resolve_run_dir(cfg)
        cfg.run_dir = run_dir
        planned.append(_refresh(Planned(combo, cfg, run_dir, False)))
    dirs = [p.run_dir for p in planned]
    if len(set(dirs)) != len(dirs):
        raise ValueError("two runs of this sweep map to the same run directory; set name= or group=")
    changed = [p for p in planned if p.changes]
    if changed and on_change == "refuse":
        raise ValueError(_changed_message(changed))
    broken = [p for p in planned if p.broken]
    if broken and on_change == "refuse":
        raise ValueError(_broken_message(broken))
    return planned


def _refresh(p: Planned) -> Planned:
    """p's done, changes and broken from what its run directory holds now."""
    p.changes = config_changes(p.cfg, os.path.join(p.run_dir, "config.yaml"))
    p.broken = None
    p.done = os.path.exists(os.path.join(p.run_dir, "DONE")) and not p.changes
    if p.done:
        from repro.logging import read_summary

        try:
            if read_summary(p.run_dir) is None:
                p.broken = f"{os.path.join(p.run_dir, 'summary.json')} is missing"
        except ValueError as exc:
            p.broken = str(exc)
        p.done = p.broken is None
    return p


def _broken_message(broken: list[Planned]) -> str:
    lines = [("a run of this command is marked finished (DONE) but its summary cannot be "
              "read, so it is neither skipped nor resumed (nothing was run):")]
    lines += [f"  {p.broken}" for p in broken]
    lines.append("Run it again from scratch: `repro train --restart ...`; or delete its DONE "
                 "and run the same command: it finishes from its last checkpoint.")
    return "\n".join(lines)


def discard(p: Planned, out=None) -> None:
    """Delete what a planned run's directory holds (its old config, metrics, checkpoints,
    DONE), so that it runs afresh, saying what to `out`: only a folder `repro train`
    made (runfolder.not_deletable); its lock stays. p.changes is kept, to say why."""
    from repro import runfolder

    if os.path.exists(p.run_dir) and set(os.listdir(p.run_dir)) - {runfolder.LOCK}:
        if out is not None:
            out(f"  deleting {p.run_dir} ({runfolder.contents(p.run_dir)})")
        runfolder.clear(p.run_dir)
    p.done = False


def status(p: Planned, dry_run: bool = False, restart: bool = False) -> str:
    """The word printed for a planned run: '[done, skipped]', '[running]', ..."""
    if p.done:
        return "done, skipped"
    if p.changes:
        return "config changed, " + ("would restart" if dry_run else "restarting")
    if p.broken:
        return "summary unreadable, " + ("would restart" if dry_run else "restarting")
    if restart and os.path.exists(os.path.join(p.run_dir, "config.yaml")):
        return "would restart" if dry_run else "restarting"
    return "would run" if dry_run else "running"


def launch(p: Planned) -> None:
    """Run one planned run to completion (resuming from its last checkpoint, if any). A
    run directory holding a different config is refused, never overwritten."""
    prepare(p)
    run_prepared(p.run_dir, p.cfg)


def prepare(p: Planned) -> None:
    """Write the run's config.yaml into its directory (refusing a directory that holds a
    different config): what a run, started here or in a submitted job, reads."""
    from repro import runfolder

    cfg_path = os.path.join(p.run_dir, "config.yaml")
    changes = config_changes(p.cfg, cfg_path)
    if changes:
        raise ValueError(_changed_message([Planned(p.overrides, p.cfg, p.run_dir, False, changes)]))
    os.makedirs(p.run_dir, exist_ok=True)
    runfolder.mark(p.run_dir)
    config_mod.save(p.cfg, cfg_path)


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


RENDEZVOUS_PORT = 29500  # rank 0's, on an emulated network (its own namespace: no clash)


def _spawn_entry(rank: int, run_dir: str, world: int, init_file: str,
                 namespaces: list[str] | None = None, master: str | None = None) -> None:
    from repro.train import run_rank

    init_method = f"file://{init_file}"
    if namespaces is not None:
        from repro import netem

        netem.enter(namespaces[rank])  # before anything opens a socket
        os.environ["GLOO_SOCKET_IFNAME"] = netem.IFACE
        init_method = f"tcp://{master}:{RENDEZVOUS_PORT}"
    run_rank(run_dir, rank, world, init_method)


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
        result = subprocess.run(cmd, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"torchrun exited with {result.returncode} for {run_dir}")
        return
    from repro import netem

    env["GLOO_SOCKET_IFNAME"] = netem.IFACE
    workers = cfg.cluster.workers
    agents = [subprocess.Popen(
        [*network.exec_prefix(r), sys.executable, "-m", "torch.distributed.run",
         "--nnodes", str(workers), "--node-rank", str(r), "--nproc-per-node", "1",
         "--master-addr", network.address(0), "--master-port", str(RENDEZVOUS_PORT), *tail],
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


def train(overrides: list[str], multirun: bool = False, dry_run: bool = False,
          restart: bool = False, out=print, on_change: str = "refuse",
          wait: bool = False) -> list[str]:
    """Plan, then run every run not yet done; the run directories in order.

    restart=True discards every run's directory first (`repro train --restart`; only a
    folder `repro train` made, and each one it deletes is named; a dry run lists them).
    Otherwise a run whose directory holds a different config is handled by on_change:
    "refuse" (the command line's choice) raises before anything runs; "restart" (for a
    caller that owns its runs folder, e.g. the paper figures) discards and re-runs it. A
    dry run deletes nothing.

    Each run holds its folder's lock while it runs (repro.runfolder): a run that another
    launch is running raises RunInUse naming it, or with wait=True waits for it. A
    SIGTERM / SIGINT stops the run at the end of its step, with a checkpoint there, and
    raises stopping.Interrupted whose message says where it stopped."""
    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change={on_change!r}; choose one of: {', '.join(ON_CHANGE)}")
    from repro import cluster, runfolder, stopping

    overrides, launcher = cluster.split_overrides(overrides)
    settings = cluster.launcher_config(launcher)  # a submitit launcher's, or None
    planned = plan(overrides, multirun, on_change="restart" if restart else on_change)
    # Pre-flight: a folder a restart would delete must be a run folder repro train made.
    refused = [runfolder.not_deletable(p.run_dir) for p in planned
               if restart or p.changes or p.broken]
    refused = [r for r in refused if r is not None]
    if refused:
        raise ValueError("nothing was deleted or run: " + "; ".join(refused))
    if not dry_run:
        # Pre-flight: every run that will run can write its directory (a read-only or
        # foreign runs folder fails here, naming it, before any run of a sweep starts).
        from repro.checkpoints import check_writable

        for folder in dict.fromkeys(p.run_dir for p in planned if restart or not p.done):
            check_writable(folder, "the run directory",
                           "nothing was run; set runs_root to a folder this user can write")
    submitted: list[str] = []
    with stopping.stop_on_signals(forward=stopping.RankForwarder()):
        for p in planned:
            delete = restart or bool(p.changes) or bool(p.broken)
            if restart:  # whatever the folder holds goes: its changes need no mention
                p.done, p.changes, p.broken = False, [], None
            if dry_run:
                out(f"[{status(p, dry_run, restart)}] {p.run_dir}")
                if delete and os.path.exists(p.run_dir):
                    out(f"  would delete {p.run_dir} ({runfolder.contents(p.run_dir)})")
                continue
            if stopping.requested() is not None:
                raise stopping.Interrupted(f"interrupted before {p.run_dir} started; the same "
                                           "command goes on with it", stopping.requested())
            if p.done and not restart:
                out(f"[{status(p)}] {p.run_dir}")
                continue
            with runfolder.locked(p.run_dir, wait=wait, out=out,
                                  give_up=lambda: stopping.requested() is not None):
                if not restart:  # another launch may have finished or changed it meanwhile
                    _refresh(p)
                    if p.done:
                        out(f"[{status(p)}] {p.run_dir}")
                        continue
                    delete = bool(p.changes) or bool(p.broken)
                line = f"[{status(p, restart=restart)}] {p.run_dir}"
                if delete:
                    discard(p, out)
                out(line)
                if settings is None:
                    try:
                        launch(p)
                    except Exception as exc:
                        if stopping.requested() is not None:  # e.g. a rank the signal
                            # reached before it could take it (still starting up)
                            raise _interrupted(p.run_dir, stopping.requested()) from exc
                        if getattr(exc, "run_dir", None) is None:
                            with contextlib.suppress(AttributeError):
                                exc.run_dir = p.run_dir  # the failure's log goes there
                        raise
                else:
                    prepare(p)
                    submitted.append(p.run_dir)
            if settings is None:
                if stopping.requested() is not None:
                    raise _interrupted(p.run_dir, stopping.requested())
                _print_summary(p.run_dir, out)
    if submitted:
        # One job per run; submitit's job folders beside the runs of the group.
        folder = os.path.join(os.path.dirname(submitted[0]), ".submitit", "%j")
        cluster.submit(submitted, settings, folder=folder, out=out)
        for run_dir in submitted:
            _print_summary(run_dir, out)
    return [p.run_dir for p in planned]


def _interrupted(run_dir: str, signum: int):
    """The stopping.Interrupted of a run stopped by a signal, from what its folder holds:
    the steps done (its metrics), its newest checkpoint, whether it finished."""
    from repro import checkpoints, stopping
    from repro.logging import METRICS_FILE, parse_metrics

    metrics = os.path.join(run_dir, METRICS_FILE)
    records = parse_metrics(metrics)[0] if os.path.exists(metrics) else []
    checkpoint = checkpoints.newest_step(os.path.join(run_dir, "checkpoints"))
    step = max([r["step"] + 1 for r in records] + [checkpoint or 0])
    finished = os.path.exists(os.path.join(run_dir, "DONE"))
    return stopping.Interrupted(stopping.interrupted_line(step, checkpoint, finished), signum)


def _print_summary(run_dir: str, out) -> None:
    """The run's own summary, read back from its files (any launch mode)."""
    from repro.logging import run_summary_lines

    for line in run_summary_lines(run_dir):
        out(line)
