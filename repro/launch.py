"""One Hydra process composes configs, writes them into fixed run directories, and
launches the workers (repro.runner: spawned processes, torchrun, or the simulated
trainer), which read that file. No @hydra.main anywhere near the workers (lightning-hydra-template #393,
hydra #2070: ranks racing on output folders and re-running sweeps).

Sweeps: `repro train -m compressor=topk,dgc compressor.ratio=0.01,0.001` expands every
comma list (Hydra's own override grammar, `glob()` over a config group's options
included) into the cartesian product. A run is keyed on its whole resolved config: its
folder is a readable name (compressor, ratio, workers, mode, task, size, seed) and a short
hash of every other setting that differs from the defaults (`settings_key`), so distinct
configs never share a folder. A run whose directory holds the same config.yaml is skipped
when DONE and resumed from its last checkpoint otherwise (re-running a sweep finishes only
what is missing); one whose config differs only by more `steps` is extended from its last
checkpoint; one whose directory holds another config (a fixed name= or run_dir=, fewer
steps) is refused before anything starts, naming every differing key, unless the caller
asked to restart it. A run that fails is recorded as failed or diverged (repro.failures)
and, with keep_going, the rest of the sweep runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from repro import config as config_mod
from repro import runner
from repro.config import conf_dir


def hydra_config(overrides: list[str]) -> DictConfig:
    """Hydra's own config for these overrides (`repro train --cfg hydra`, `--info`)."""
    from repro import cluster

    run, launcher = cluster.split_overrides(prepare_overrides(list(overrides)))
    if launcher:
        cluster.launcher_config(launcher)  # registers the submitit configs, checks them
    conf_dir()  # a missing tree is named as such, not as a bad config
    try:
        return config_mod.hydra_compose([*run, *launcher], hydra=True)
    except Exception as exc:  # noqa: BLE001 - compose() names the problem
        compose(run)
        raise ValueError(f"bad config: {_first_line(exc)}") from None


def compose(overrides: list[str]) -> DictConfig:
    """The resolved config for one run (struct mode: an unknown key is an error). Errors
    are ValueErrors that name the key and the allowed keys or options."""
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = config_mod.hydra_compose(overrides)
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
    unknown = unknown_keys(cfg)
    if unknown:
        raise ValueError(_unknown_key(unknown[0], overrides))
    return cfg


# Mappings whose keys the schema leaves open: validate checks them against the compressor's
# parameters and the task's hyper-parameters, naming the allowed ones.
OPEN_MAPPINGS = ("compressor.params", "task.hparams")


def unknown_keys(cfg: DictConfig) -> list[str]:
    """The keys of a composed config that the schema does not have (added with `+key=`),
    dotted; the open mappings (OPEN_MAPPINGS) are checked by repro.config.validate."""
    found: list[str] = []

    def walk(node: Any, schema_node: Any, prefix: str) -> None:
        for key in node:
            dotted = f"{prefix}{key}"
            if dotted in OPEN_MAPPINGS:
                continue
            if key not in schema_node:
                found.append(dotted)
            elif isinstance(node[key], DictConfig) and isinstance(schema_node[key], DictConfig):
                walk(node[key], schema_node[key], dotted + ".")

    walk(cfg, config_mod.schema(), "")
    return found


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _key_error(full_key: str, cause: BaseException, overrides: list[str]) -> str:
    """'compressor.ratoi is not a config key; allowed keys under compressor: ...'."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):  # e.g. a bad type
        return f"{full_key}: {_first_line(cause)}"
    return _unknown_key(full_key, overrides)


def _unknown_key(full_key: str, overrides: list[str]) -> str:
    parent, _, _leaf = full_key.rpartition(".")
    if parent == "compressor.params":
        import compressors

        # The compressor this run selected: compose again without the bad key.
        rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != full_key]
        try:
            name = str(config_mod.hydra_compose(rest).compressor.name)
        except Exception:  # noqa: BLE001 - only for the message
            name = None
        if name in compressors.list_compressors():
            allowed = sorted(k for k in compressors.default_params(name) if k != "ratio")
            return (f"{full_key} is not a parameter of compressor {name!r}; allowed: "
                    f"{', '.join(allowed) or 'none (it takes no parameters)'}")
        return f"{full_key} is not a parameter of the selected compressor"
    node = config_mod.schema()
    for part in parent.split(".") if parent else []:
        node = node.get(part, None)
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


CONFIG_GROUPS = ("compressor", "task", "cluster", "logger", "experiment")


def group_options(group: str) -> list[str]:
    """The options of a config group: conf/<group>/*.yaml, sorted."""
    folder = Path(conf_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of comma-list overrides, as Hydra's basic sweeper does;
    `glob(PATTERN)` (and glob(include, exclude=...)) on a config group takes the group's
    matching options."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's grammar error, one line
        raise ValueError(f"bad override: {_first_line(exc)}") from None
    axes = []
    for o in parsed:
        key = o.get_key_element()
        if isinstance(o.value(), Glob):
            group = key.lstrip("+~")
            if group not in CONFIG_GROUPS:
                raise ValueError(f"{o.input_line}: glob() selects the options of a config group "
                                 f"({', '.join(CONFIG_GROUPS)}); {group} is not one: give its "
                                 "values as a comma list")
            chosen = o.value().filter(group_options(group))
            if not chosen:
                raise ValueError(f"{o.input_line} matches none of the {group} options: "
                                 f"{', '.join(group_options(group))}")
            axes.append([f"{key}={v}" for v in chosen])
        elif o.is_sweep_override():
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


def _override_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def prepare_overrides(overrides: list[str]) -> list[str]:
    """The command's overrides as compose() takes them: Hydra's output folders refused
    with the reason (this suite keeps runs in runs_root/group/name), and `~key` on a
    setting of the schema (which cannot lose a key) read as that setting's default, what
    a run that lacks it gets; `~group` and `~key` inside the open mappings are Hydra's."""
    from omegaconf import OmegaConf

    out = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            if key.startswith(("hydra.run", "hydra.sweep", "hydra.job", "hydra.output")):
                raise ValueError(
                    f"{o}: Hydra's output folders are not used: each run's folder is "
                    "runs_root/group/<run name> (runs/<group>/...), written by the launcher, "
                    "never Hydra's working directory; set runs_root=DIR, group=NAME or "
                    "name=NAME instead")
            raise ValueError(f"{o}: of Hydra's own settings only hydra/launcher=... and "
                             "hydra.launcher.* (a submitit sweep) are used here")
        if o.startswith("~") and not any(key == m or key.startswith(m + ".")
                                         for m in OPEN_MAPPINGS):
            default = OmegaConf.select(config_mod.schema(), key, default="\0missing")
            if not OmegaConf.is_config(default) and default != "\0missing":
                out.append(f"{key}={_override_value(default)}")
                continue
        out.append(o)
    return out


# What the readable part of a run's folder name says (repro.config.run_name), and what
# does not key the folder at all: its own name and group, and its length in steps (a run
# given more steps is the same run, extended).
NAME_KEYS = ("compressor.name", "compressor.ratio", "comm_hook", "cluster.workers",
             "cluster.mode", "task.name", "task.size", "seed")
EMULATED_NAME_KEYS = ("cluster.network", "cluster.bandwidth_gbps", "cluster.latency_ms")
UNKEYED = ("steps", "name", "group")

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
    # there is none, or it is the same up to config.RESULT_NEUTRAL_KEYS).
    changes: list[Change] = field(default_factory=list)
    # Why a run marked DONE cannot be trusted (its summary.json is missing or unreadable).
    broken: str | None = None
    # The steps of the run in run_dir when this one only adds steps to it (it is extended
    # from its last checkpoint), else None.
    extend_from: int | None = None
    # RUN_DIR/FAILED of an earlier attempt (repro.failures), if any.
    failure: dict[str, Any] | None = None
    # What made this launch of the run (repro.provenance), written with its config.
    provenance: dict[str, Any] | None = None


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


def _as_saved(cfg: DictConfig) -> dict[str, Any]:
    """The config as config_mod.save writes it and a later plan() reads it back, so that
    an unchanged config compares equal value for value (floats, nulls, bools)."""
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(cfg, resolve=True)
    return OmegaConf.to_container(OmegaConf.create(text), resolve=True) or {}


def config_changes(cfg: DictConfig, saved_path: str | None,
                   saved: dict[str, Any] | None = None) -> list[Change]:
    """Every key (dotted) whose value in `cfg` differs from the config at saved_path (or
    `saved`), config.RESULT_NEUTRAL_KEYS excepted; a key present on one side only (a config.yaml
    written by an older or newer schema) is a change, to or from ABSENT. No file: no
    changes."""
    from omegaconf import OmegaConf

    if saved is None:
        if saved_path is None or not os.path.exists(saved_path):
            return []
        try:
            saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=True)
        except Exception as exc:  # noqa: BLE001 - a torn or hand-edited file is a change
            return [Change("config.yaml", f"unreadable ({_first_line(exc)})",
                           "this run's config")]
    old = config_mod.flatten_config(saved if isinstance(saved, dict) else {})
    new = config_mod.flatten_config(_as_saved(cfg))
    keys = list(new) + [k for k in old if k not in new]
    return [Change(k, old.get(k, ABSENT), new.get(k, ABSENT))
            for k in keys if not config_mod.within(k, config_mod.RESULT_NEUTRAL_KEYS)
            and old.get(k, ABSENT) != new.get(k, ABSENT)]


def _changed_message(changed: list[Planned]) -> str:
    runs = "1 run" if len(changed) == 1 else f"{len(changed)} runs"
    lines = [(f"{runs} of this command: the config.yaml already in the run directory differs "
             "from the run's config, so the run is neither skipped, resumed nor overwritten "
             "(nothing was run):")]
    for p in changed:
        lines.append(f"  {p.run_dir}")
        lines += [f"    {c}" for c in p.changes]
    lines.append("Either discard the old run(s) and start afresh: `repro train --restart ...` "
                 "(launch.train(..., restart=True)); or keep both: give the new run(s) their "
                 "own directory with name=... (one run) or group=... (a sweep).")
    return "\n".join(lines)


@functools.lru_cache(maxsize=64)
def _defaults_of(compressor: str, task: str) -> str:
    """The flattened config of the defaults with this compressor and task (JSON), what a
    run's settings key is measured against."""
    try:
        cfg = config_mod.hydra_compose([f"compressor={compressor}", f"task={task}"])
    except Exception:  # noqa: BLE001 - a name without its own file: the plain defaults
        cfg = config_mod.hydra_compose([])
    return json.dumps(config_mod.flatten_config(_as_saved(cfg)), default=str)


def settings_key(cfg: DictConfig) -> str | None:
    """A short hash (6 hex digits) of the run's settings that differ from the defaults of
    its compressor and task and that its readable name does not show (NAME_KEYS), or None
    when there are none; result-neutral keys, steps, name and group do not count."""
    base = json.loads(_defaults_of(str(cfg.compressor.name), str(cfg.task.name)))
    new = config_mod.flatten_config(_as_saved(cfg))
    shown = NAME_KEYS + (EMULATED_NAME_KEYS if cfg.cluster.network == "emulated" else ())
    skip = config_mod.RESULT_NEUTRAL_KEYS + shown + UNKEYED
    diff = sorted((k, new.get(k, ABSENT)) for k in set(new) | set(base)
                  if not config_mod.within(k, skip) and new.get(k, ABSENT) != base.get(k, ABSENT))
    if not diff:
        return None
    return hashlib.sha256(json.dumps(diff, default=str).encode()).hexdigest()[:6]


def _takes_ratio(name: str) -> bool:
    import compressors

    return name in compressors.list_compressors() and "ratio" in compressors.default_params(name)


def _ratio_where_it_applies(composed: list[tuple[list[str], DictConfig]],
                            notes: list[str]) -> None:
    """In a sweep over compressors that take a ratio and ones that do not, the ratio goes
    to the first only: the others' runs get none (so their names carry none), said once."""
    takes = {str(cfg.compressor.name): _takes_ratio(str(cfg.compressor.name))
             for _, cfg in composed}
    if not any(takes.values()):
        return
    dropped = sorted({str(cfg.compressor.name) for _, cfg in composed
                      if cfg.compressor.ratio is not None and takes[str(cfg.compressor.name)]
                      is False})
    if not dropped:
        return
    for _, cfg in composed:
        if takes[str(cfg.compressor.name)] is False:
            cfg.compressor.ratio = None
    with_ratio = sorted(n for n, t in takes.items() if t)
    one = len(dropped) == 1
    notes.append(f"compressor.ratio applies to {', '.join(with_ratio)}; "
                 f"{', '.join(dropped)} take{'s' if one else ''} no ratio and "
                 f"run{'s' if one else ''} without one")


def _same_dir_message(a: Planned, b: Planned) -> str:
    changes = [c for c in config_changes(a.cfg, None, saved=_as_saved(b.cfg))
               if c.key != "run_dir"]
    differ = "; ".join(str(c) for c in changes[:4]) or "nothing but result-neutral keys"
    return (f"two runs of this sweep map to the same run directory {a.run_dir}: "
            f"[{' '.join(b.overrides)}] and [{' '.join(a.overrides)}], which differ in "
            f"{differ}; a fixed name= or run_dir= gives every run of a sweep one folder: drop "
            "it (each run then gets its own), or sweep group= instead")


def plan(overrides: list[str], multirun: bool, on_change: str = "refuse",
         notes: list[str] | None = None, device: bool = True) -> list[Planned]:
    """Compose and validate every run of the (sweep) command before any starts, and
    compare each with the config.yaml already in its run directory. on_change="refuse"
    raises a ValueError naming every changed run, key, old and new value;
    on_change="restart" returns the changed runs as not done, with their `changes`, for
    the caller to discard (see discard) and run afresh. A run that only adds steps to
    the run in its directory is planned as its extension (`extend_from`). What the plan
    decided for the whole sweep (a ratio that applies to some compressors only, runs that
    come out the same, a paper-size run shorter than the paper's schedule) is appended to
    `notes`, once. device=False leaves the device check to the job (a submitted sweep)."""
    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change={on_change!r}; choose one of: {', '.join(ON_CHANGE)}")
    notes = [] if notes is None else notes
    overrides = prepare_overrides(list(overrides))
    combos = expand_sweep(overrides) if multirun else [list(overrides)]
    composed = [(combo, compose(combo)) for combo in combos]
    if multirun:
        _ratio_where_it_applies(composed, notes)
    planned: list[Planned] = []
    by_dir: dict[str, Planned] = {}
    repeated = 0
    schedule_notes: dict[str, None] = {}
    for combo, cfg in composed:
        task = config_mod.validate(cfg, device=device)
        note = config_mod.paper_schedule_note(cfg, task)
        if note is not None:
            schedule_notes[note] = None
        if not cfg.run_dir:
            cfg.run_dir = os.path.join(str(cfg.runs_root), str(cfg.group),
                                       config_mod.run_name(cfg, settings_key(cfg)))
        p = Planned(combo, cfg, str(cfg.run_dir), False)
        twin = by_dir.get(p.run_dir)
        if twin is not None:
            if not config_changes(cfg, None, saved=_as_saved(twin.cfg)):
                repeated += 1  # the same run twice (e.g. a ratio dropped): run once
                continue
            raise ValueError(_same_dir_message(p, twin))
        by_dir[p.run_dir] = p
        planned.append(_refresh(p))
    if repeated:
        notes.append(f"{repeated} run(s) of the sweep came out the same as another and run once")
    notes += list(schedule_notes)
    changed = [p for p in planned if p.changes]
    if changed and on_change == "refuse":
        raise ValueError(_changed_message(changed))
    broken = [p for p in planned if p.broken]
    if broken and on_change == "refuse":
        raise ValueError(_broken_message(broken))
    return planned


def _refresh(p: Planned) -> Planned:
    """p's done, changes, extension, failure and broken from what its run directory holds
    now."""
    from repro import failures

    p.changes = config_changes(p.cfg, os.path.join(p.run_dir, "config.yaml"))
    p.extend_from = _grown_steps(p.changes)
    if p.extend_from is not None:
        p.changes = []
    p.broken = None
    p.failure = failures.read_failure(p.run_dir)
    p.done = (os.path.exists(os.path.join(p.run_dir, "DONE")) and not p.changes
              and p.extend_from is None)
    if p.done:
        from repro.logging import read_summary

        try:
            if read_summary(p.run_dir) is None:
                p.broken = f"{os.path.join(p.run_dir, 'summary.json')} is missing"
        except ValueError as exc:
            p.broken = str(exc)
        p.done = p.broken is None
    return p


def _grown_steps(changes: list[Change]) -> int | None:
    """The saved run's steps when `steps` grew and nothing else changed, else None."""
    if len(changes) != 1 or changes[0].key != "steps":
        return None
    old, new = changes[0].old, changes[0].new
    if isinstance(old, int) and isinstance(new, int) and new > old:
        return old
    return None


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
    if p.extend_from is not None and not restart:
        from repro import checkpoints

        newest = checkpoints.newest_step(os.path.join(p.run_dir, "checkpoints"))
        where = f"from step {newest}" if newest else "from step 0: no checkpoint"
        return (f"{'would extend' if dry_run else 'extending'} {p.extend_from} -> "
                f"{p.cfg.steps} steps, {where}")
    if restart and os.path.exists(os.path.join(p.run_dir, "config.yaml")):
        return "would restart" if dry_run else "restarting"
    return "would run" if dry_run else "running"


def launch(p: Planned) -> None:
    """Run one planned run to completion (resuming from its last checkpoint, if any). A
    run directory holding a different config is refused, never overwritten."""
    prepare(p)
    runner.run_prepared(p.run_dir, p.cfg)


def _add_provenance(p: Planned) -> None:
    if p.provenance is not None:
        from repro import provenance

        provenance.add(p.run_dir, p.provenance)
        p.provenance = None


def prepare(p: Planned) -> None:
    """Write the run's config.yaml into its directory (refusing a directory that holds a
    different config): what a run, started here or in a submitted job, reads."""
    from repro import runfolder

    cfg_path = os.path.join(p.run_dir, "config.yaml")
    changes = config_changes(p.cfg, cfg_path)
    if changes and _grown_steps(changes) is None:
        raise ValueError(_changed_message([Planned(p.overrides, p.cfg, p.run_dir, False, changes)]))
    os.makedirs(p.run_dir, exist_ok=True)
    runfolder.mark(p.run_dir)
    _add_provenance(p)
    if p.cfg.logger.group is None and os.path.exists(cfg_path):
        # A sweep's run resumed or extended alone stays in the sweep's W&B group.
        from omegaconf import OmegaConf

        with contextlib.suppress(Exception):
            p.cfg.logger.group = OmegaConf.select(OmegaConf.load(cfg_path), "logger.group")
    if changes:  # only more steps: the run is no longer finished (DONE goes first)
        for name in ("DONE", "summary.json"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(p.run_dir, name))
    config_mod.save(p.cfg, cfg_path)


class RunsFailed(RuntimeError):
    """Some runs of a sweep failed (each recorded in its RUN_DIR/FAILED); the others ran."""

    def __init__(self, failed: list[tuple[str, dict[str, Any]]], total: int):
        self.failed = failed
        names = ", ".join(f"{os.path.basename(d)} ({r['status']})" for d, r in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        super().__init__(f"{len(failed)} of {total} runs failed: {names}{more} (listed above; "
                         "the same command skips them, --retry-failed runs them again)")


def _steps_left(p: Planned, restart: bool, retry_failed: bool) -> int:
    """Steps a planned run still has to train (0: it will be skipped)."""
    if p.done and not restart:
        return 0
    if p.failure is not None and not retry_failed and not restart:
        return 0
    from repro import checkpoints

    done = 0 if restart or p.changes or p.broken else (
        checkpoints.newest_step(os.path.join(p.run_dir, "checkpoints")) or 0)
    return max(1, int(p.cfg.steps) - done)


def check_submission(settings: dict[str, Any] | None, dry_run: bool) -> None:
    """A SLURM sweep needs sbatch and srun here (a login node): else one line, before any
    folder is made. A dry run submits nothing and needs neither."""
    import shutil

    if settings is None or settings.get("kind") != "slurm" or dry_run:
        return
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if missing:
        raise ValueError(f"hydra/launcher=submitit_slurm submits with sbatch and runs with srun, "
                         f"but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not on PATH here: run it on a SLURM login node (--dry-run shows each "
                         "job's sbatch settings anywhere), or use hydra/launcher=submitit_local")


def train(overrides: list[str], multirun: bool = False, dry_run: bool = False,
          restart: bool = False, out=print, on_change: str = "refuse",
          wait: bool = False, keep_going: bool = False, retry_failed: bool = True,
          progress: bool = False) -> list[str]:
    """Plan, then run every run not yet done; the run directories in order.

    restart=True discards every run's directory first (`repro train --restart`; only a
    folder `repro train` made, and each one it deletes is named; a dry run lists them).
    Otherwise a run whose directory holds a different config is handled by on_change:
    "refuse" (the command line's choice) raises before anything runs; "restart" (for a
    caller that owns its runs folder, e.g. the paper figures) discards and re-runs it. A
    dry run deletes nothing.

    A run that fails is recorded in RUN_DIR/FAILED (failed, or diverged: repro.failures).
    keep_going=True (a sweep from the command line) goes on with the next run, lists the
    failures at the end and raises RunsFailed; otherwise the failure is raised at once.
    retry_failed=False skips a run whose earlier attempt failed, saying why. progress=True
    prints "run i/N" with an estimate of the time left before each run of a sweep and a
    table of every run at its end.

    Each run holds its folder's lock while it runs (repro.runfolder): a run that another
    launch is running raises RunInUse naming it, or with wait=True waits for it. A
    SIGTERM / SIGINT stops the run at the end of its step, with a checkpoint there, and
    raises stopping.Interrupted whose message says where it stopped."""
    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change={on_change!r}; choose one of: {', '.join(ON_CHANGE)}")
    import time

    from repro import cluster, failures, provenance, runfolder, stopping, sweep

    given = list(overrides)
    overrides, launcher = cluster.split_overrides(overrides)
    settings = cluster.launcher_config(launcher)  # a submitit launcher's, or None
    # A SLURM sweep is validated here (often a login node) but trains in its jobs: the
    # device is checked there.
    on_slurm = settings is not None and settings.get("kind") == "slurm"
    check_submission(settings, dry_run)
    notes: list[str] = []
    planned = plan(overrides, multirun, on_change="restart" if restart else on_change,
                   notes=notes, device=not on_slurm)
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
    for note in notes:
        out(f"note: {note}")
    if multirun and len(planned) > 1:
        group = sweep.wandb_group(given)
        for p in planned:  # W&B groups a sweep's runs by its command unless told otherwise
            if p.cfg.logger.group is None and str(p.cfg.group) == "default":
                p.cfg.logger.group = group
    shown = progress and len(planned) > 1
    report = sweep.SweepProgress(len(planned), out)
    steps_left = [_steps_left(p, restart, retry_failed) for p in planned]
    failed: list[tuple[str, dict[str, Any]]] = []
    submitted: list[str] = []
    with stopping.stop_on_signals(forward=stopping.RankForwarder()):
        for i, p in enumerate(planned):
            if shown and not dry_run and steps_left[i]:  # a skipped run says so itself
                report.before(i + 1, steps_left[i:])
            delete = restart or bool(p.changes) or bool(p.broken)
            if restart:  # whatever the folder holds goes: its changes need no mention
                p.done, p.changes, p.broken = False, [], None
            if dry_run:
                skip = p.failure is not None and not retry_failed and not restart
                line = f"[{status(p, dry_run, restart)}] {p.run_dir}"
                if skip:
                    line = (f"[{p.failure.get('status', 'failed')} before, would skip] "
                            f"{p.run_dir}: {failures.short(p.failure.get('reason'))}")
                out(line)
                if delete and os.path.exists(p.run_dir):
                    out(f"  would delete {p.run_dir} ({runfolder.contents(p.run_dir)})")
                if settings is not None and not skip:
                    for text in cluster.describe_job(p.run_dir, settings):
                        out(f"  {text}")
                continue
            if stopping.requested() is not None:
                raise stopping.Interrupted(f"interrupted before {p.run_dir} started; the same "
                                           "command goes on with it", stopping.requested())
            if p.done and not restart:
                out(f"[{status(p)}] {p.run_dir}")
                report.outcomes.append(sweep.Outcome(p.run_dir, "skipped (done)",
                                                     _summary(p.run_dir)))
                continue
            if p.failure is not None and not retry_failed and not restart:
                out(f"[{p.failure.get('status', 'failed')} before, skipped] {p.run_dir}: "
                    f"{failures.short(p.failure.get('reason'))}")
                report.outcomes.append(sweep.Outcome(
                    p.run_dir, f"skipped ({p.failure.get('status', 'failed')})",
                    reason=p.failure.get("reason"), log=p.failure.get("log")))
                failed.append((p.run_dir, p.failure))
                continue
            started = time.monotonic()
            with runfolder.locked(p.run_dir, wait=wait, out=out,
                                  give_up=lambda: stopping.requested() is not None):
                if not restart:  # another launch may have finished or changed it meanwhile
                    _refresh(p)
                    if p.done:
                        out(f"[{status(p)}] {p.run_dir}")
                        report.outcomes.append(sweep.Outcome(p.run_dir, "skipped (done)",
                                                             _summary(p.run_dir)))
                        continue
                    delete = bool(p.changes) or bool(p.broken)
                line = f"[{status(p, restart=restart)}] {p.run_dir}"
                if delete:
                    discard(p, out)
                out(line)
                failures.clear_failure(p.run_dir)
                record = provenance.entry(given, p.overrides, p.cfg, submitted=settings is not None)
                if settings is None:
                    try:
                        p.provenance = record
                        launch(p)
                    except Exception as exc:
                        if stopping.requested() is not None:  # e.g. a rank the signal
                            # reached before it could take it (still starting up)
                            raise _interrupted(p.run_dir, stopping.requested()) from exc
                        if getattr(exc, "run_dir", None) is None:
                            with contextlib.suppress(AttributeError):
                                exc.run_dir = p.run_dir  # the failure's log goes there
                        if not keep_going:
                            with contextlib.suppress(Exception):
                                failures.record_failure(p.run_dir, exc, os.path.join(
                                    p.run_dir, failures.LOG))
                            raise
                        log = failures.record_exception(p.run_dir, "launcher", exc)
                        result = failures.record_failure(p.run_dir, exc, log)
                        out(f"  {result['status']}: {failures.short(result['reason'])} (traceback "
                            f"in {log}); going on with the sweep")
                        failed.append((p.run_dir, result))
                        report.outcomes.append(sweep.Outcome(p.run_dir, result["status"],
                                                             reason=result["reason"], log=log))
                        report.trained(time.monotonic() - started, steps_left[i])
                        continue
                else:
                    p.provenance = record
                    prepare(p)
                    submitted.append(p.run_dir)
            if settings is None:
                if stopping.requested() is not None:
                    raise _interrupted(p.run_dir, stopping.requested())
                report.trained(time.monotonic() - started, steps_left[i])
                report.outcomes.append(sweep.Outcome(p.run_dir, "done", _summary(p.run_dir)))
                _print_summary(p.run_dir, out)
    if submitted:
        # One job per run; submitit's job folders beside the runs of the group.
        folder = os.path.join(os.path.dirname(submitted[0]), ".submitit", "%j")
        cluster.submit(submitted, settings, folder=folder, out=out)
        for run_dir in submitted:
            _print_summary(run_dir, out)
    if shown:
        report.end(dry_run)
    if failed and keep_going:
        raise RunsFailed(failed, len(planned))
    return [p.run_dir for p in planned]


def _summary(run_dir: str) -> dict[str, Any] | None:
    from repro.logging import read_summary

    try:
        return read_summary(run_dir)
    except ValueError:
        return None


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
