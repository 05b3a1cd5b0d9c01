"""One Hydra process composes configs, writes them into fixed run directories, and
launches the workers (spawned processes, torchrun, or the simulated trainer), which
read that file. No @hydra.main anywhere near the workers (lightning-hydra-template #393,
hydra #2070: ranks racing on output folders and re-running sweeps).

Sweeps: `repro train -m compressor=topk,dgc compressor.ratio=0.01,0.001` expands every
comma list (Hydra's own override grammar) into the cartesian product; a run whose
directory holds DONE is skipped, so re-running a sweep finishes only what is missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=config_mod.TrainConfig)


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


@dataclass
class Planned:
    overrides: list[str]
    cfg: DictConfig
    run_dir: str
    done: bool


def plan(overrides: list[str], multirun: bool) -> list[Planned]:
    """Compose and validate every run of the (sweep) command before any starts."""
    combos = expand_sweep(overrides) if multirun else [list(overrides)]
    planned = []
    for combo in combos:
        cfg = compose(combo)
        config_mod.validate(cfg)
        run_dir = config_mod.resolve_run_dir(cfg)
        cfg.run_dir = run_dir
        planned.append(Planned(combo, cfg, run_dir, os.path.exists(os.path.join(run_dir, "DONE"))))
    dirs = [p.run_dir for p in planned]
    if len(set(dirs)) != len(dirs):
        raise ValueError("two runs of this sweep map to the same run directory; set name= or group=")
    return planned


def launch(p: Planned) -> None:
    """Run one planned run to completion (resuming from its last checkpoint, if any)."""
    os.makedirs(p.run_dir, exist_ok=True)
    cfg_path = os.path.join(p.run_dir, "config.yaml")
    if os.path.exists(cfg_path) and not os.path.exists(os.path.join(p.run_dir, "checkpoints", "LATEST")):
        pass  # a fresh (or never-checkpointed) run: overwrite the config
    config_mod.save(p.cfg, cfg_path)
    mode = p.cfg.cluster.mode
    if mode == "simulated":
        from repro.train import run_simulated

        run_simulated(p.run_dir)
    elif mode == "spawn":
        spawn(p.run_dir, p.cfg.cluster.workers)
    else:
        torchrun(p.run_dir, p.cfg)


def _spawn_entry(rank: int, run_dir: str, world: int, init_file: str) -> None:
    from repro.train import run_rank

    run_rank(run_dir, rank, world, f"file://{init_file}")


def spawn(run_dir: str, workers: int) -> None:
    import torch.multiprocessing as mp

    init_file = os.path.join(os.path.abspath(run_dir), ".rendezvous")
    if os.path.exists(init_file):
        os.remove(init_file)
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(_spawn_entry, args=(run_dir, workers, init_file), nprocs=workers,
                           join=True, start_method="spawn")
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        if os.path.exists(init_file):
            os.remove(init_file)


def torchrun(run_dir: str, cfg: DictConfig) -> None:
    """An elastic launch: --max-restarts relaunches all ranks after a failure, and they
    resume from the last checkpoint."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(cfg.cluster.workers),
        "--max-restarts", str(cfg.cluster.max_restarts),
        "-m", "repro.worker", run_dir,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cfg.cluster.threads_per_worker)))
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun exited with {result.returncode} for {run_dir}")


def train(overrides: list[str], multirun: bool = False, dry_run: bool = False,
          restart: bool = False, out=print) -> list[str]:
    """Plan, then run every run not yet done; the run directories in order."""
    planned = plan(overrides, multirun)
    for p in planned:
        if restart and os.path.exists(p.run_dir):
            shutil.rmtree(p.run_dir)
            p.done = False
        status = "done, skipped" if p.done else ("would run" if dry_run else "running")
        out(f"[{status}] {p.run_dir}")
        if not p.done and not dry_run:
            launch(p)
    return [p.run_dir for p in planned]
