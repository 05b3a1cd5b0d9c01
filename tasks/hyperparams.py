"""Task hyper-parameters: where they are written, which keys a task accepts, and the range
each value must lie in.

Every task's values live in conf/task/<name>.yaml, the same file Hydra composes for
`repro train task=<name>`, so a run and `tasks.build_task` read one copy:

    name: cifar10_resnet18
    hparams:
      paper: {optimizer: sgd, lr: 0.05, ...}   # the paper's setting, cited line by line
      smoke: {optimizer: sgd, lr: 0.02, ...}   # a small CI run, same optimiser

A key beside the two blocks applies to the run's size and wins over the block
(`task.hparams.momentum=0` on the command line); `task.hparams.paper.KEY=...` changes one
size only. `for_size` flattens that mapping for one size.

The folder is found as `repro train` finds its Hydra tree: $GRADCOMP_CONF, else conf/
beside the packages (the supported install is `pip install -e .` from a clone).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES = ("smoke", "paper")


class HParamError(ValueError):
    """A hyper-parameter refused: `key` (dotted below `hparams`, e.g. "momentum" or
    "paper.momentum") and what is wrong with it. str() reads "hparams.<key>...";
    `message(prefix)` puts another prefix before it (the config path: "task.hparams.")."""

    def __init__(self, key: str, detail: str):
        self.key, self.detail = key, detail
        super().__init__(self.message("hparams."))

    def message(self, prefix: str) -> str:
        where = f"{prefix}{self.key}" if self.key else prefix.rstrip(".")
        return where + self.detail


@dataclass(frozen=True)
class HParam:
    """One key a task accepts: the test its value must pass and the allowed values in
    words. required: every size block of the task's file must set it (the code reads it
    unconditionally)."""

    check: Callable[[Any], bool]
    allowed: str
    required: bool = False


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(required: bool = False) -> HParam:
    return HParam(lambda v: _number(v) and v > 0, "a number > 0", required)


def non_negative(required: bool = False) -> HParam:
    return HParam(lambda v: _number(v) and v >= 0, "a number >= 0", required)


def fraction(required: bool = False) -> HParam:
    """[0, 1): momentum, Adam's betas, dropout."""
    return HParam(lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)", required)


def count(low: int = 1, required: bool = False) -> HParam:
    return HParam(lambda v: _integer(v) and v >= low, f"an integer >= {low}", required)


def flag(required: bool = False) -> HParam:
    return HParam(lambda v: isinstance(v, bool), "true or false", required)


def choice(*options: str, required: bool = False) -> HParam:
    return HParam(lambda v: v in options, "one of: " + ", ".join(options), required)


def sequence_of(item: HParam, length: int | None = None, required: bool = False) -> HParam:
    size = f"{length} " if length else ""
    return HParam(
        lambda v: (
            isinstance(v, (list, tuple))
            and (length is None or len(v) == length)
            and all(item.check(x) for x in v)
        ),
        f"a list of {size}values, each {item.allowed}",
        required,
    )


# The keys every task accepts: what Task.make_optimizer, Task.make_scheduler, the trainer
# (clipping, per-worker batches) and every task's evaluation read. momentum and nesterov
# are SGD's, betas and eps Adam's and AdamW's; the other optimiser ignores them.
COMMON: dict[str, HParam] = {
    "optimizer": choice("sgd", "adam", "adamw", required=True),
    "lr": positive(required=True),
    "momentum": fraction(),
    "nesterov": flag(),
    "betas": sequence_of(fraction(), length=2),
    "eps": positive(),
    "weight_decay": non_negative(required=True),
    # false: weight decay on biases and norm weights too (true: as the authors' code does)
    "no_decay_1d": flag(),
    "batch_size": count(required=True),  # per worker
    "eval_batch_size": count(required=True),
    "clip": HParam(
        lambda v: v is None or (_number(v) and v > 0), "null or a number > 0", required=True
    ),  # gradient-norm clipping
    "epochs": positive(required=True),
    "warmup_epochs": non_negative(),
    "warmup_steps": count(low=0),  # wins over warmup_epochs when > 0
    "lr_schedule": choice("constant", "step", "linear"),
    "lr_milestones": sequence_of(non_negative()),  # epochs, for lr_schedule=step
    "lr_gamma": positive(),  # the factor at each milestone
}


def conf_dir() -> str:
    """The Hydra config tree that `repro train` composes and the task files live in:
    $GRADCOMP_CONF, else conf/ beside the packages (a clone)."""
    env = os.environ.get("GRADCOMP_CONF")
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "conf"
    if not (path / "config.yaml").exists():
        raise FileNotFoundError(
            f"no Hydra config tree at {path} (config.yaml missing); run from a clone of "
            "gradcomp-repro (pip install -e .) or set GRADCOMP_CONF to its conf/ folder"
        )
    return str(path)


def task_file(name: str, conf: str | Path | None = None) -> Path:
    """conf/task/<name>.yaml in `conf` (default: the Hydra tree, conf_dir())."""
    return Path(conf if conf is not None else conf_dir()) / "task" / f"{name}.yaml"


# Parsed task files by path, with the text they were parsed from: a run validates, builds
# and logs its task several times, and a sweep plans many runs; reading the few hundred
# bytes again is cheap, parsing them is not.
_PARSED: dict[Path, tuple[str, dict[str, Any]]] = {}


def read_task_file(name: str, conf: str | Path | None = None) -> dict[str, Any]:
    """conf/task/<name>.yaml as plain Python (FileNotFoundError naming the path); parsed
    again whenever its text changed."""
    from omegaconf import OmegaConf

    path = task_file(name, conf)
    if not path.exists():
        raise FileNotFoundError(
            f"no {path}: task {name!r} reads its hyper-parameters from that file "
            "(name: and hparams: with a paper: and a smoke: block)"
        )
    text = path.read_text()
    seen = _PARSED.get(path)
    if seen is None or seen[0] != text:
        node = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
        if not isinstance(node, dict):  # a bad file is a ValueError, as a bad value
            raise ValueError(f"{path} holds {type(node).__name__}, not a mapping")  # noqa: TRY004
        seen = _PARSED[path] = (text, node)
    return copy.deepcopy(seen[1])


def as_tuples(value: Any) -> Any:
    """Sequences as tuples: hyper-parameters are values, not shared mutable lists."""
    if isinstance(value, (list, tuple)):
        return tuple(as_tuples(v) for v in value)
    return value


def for_size(hparams: Any, size: str) -> dict[str, Any]:
    """The flat hyper-parameters of one size: the `size` block, then every key beside the
    blocks (the run's overrides) on top. Sequences become tuples."""
    if hparams is None:
        return {}
    if not isinstance(hparams, Mapping):
        raise HParamError("", f"={hparams!r} must be a mapping (a paper: and a smoke: block)")
    block = hparams.get(size) or {}
    if not isinstance(block, Mapping):
        raise HParamError(size, f"={block!r} must be a mapping of hyper-parameters")
    flat = {str(k): as_tuples(v) for k, v in block.items()}
    flat.update({str(k): as_tuples(v) for k, v in hparams.items() if k not in SIZES})
    return flat


def unknown_key(key: str, task: str, accepted: Mapping[str, HParam]) -> HParamError:
    return HParamError(
        key,
        f" is not a hyper-parameter of task {task!r} (misspelled?); allowed: "
        + ", ".join(sorted(accepted)),
    )


def check_values(
    values: Mapping[str, Any], task: str, accepted: Mapping[str, HParam], where: str = ""
) -> None:
    """Every key accepted and every value in range; HParamError names the first bad key
    (after `where`, e.g. "paper.") and what it allows."""
    for key, value in values.items():
        spec = accepted.get(key)
        if spec is None:
            raise unknown_key(where + str(key), task, accepted)
        if not spec.check(value):
            raise HParamError(where + str(key), f"={value!r}: must be {spec.allowed}")


def check(values: Mapping[str, Any], task: str, accepted: Mapping[str, HParam]) -> dict[str, Any]:
    """The hyper-parameters one run of `task` trains with, checked: keys, ranges, and the
    required keys present. Nesterov with momentum 0 is plain SGD (Nesterov's step looks
    ahead along the momentum, and torch refuses the pair): nesterov is turned off, with a
    warning, so a momentum sweep down to 0 runs."""
    check_values(values, task, accepted)
    missing = [k for k, spec in accepted.items() if spec.required and k not in values]
    if missing:
        raise HParamError("", f" lacks {', '.join(missing)} (task {task!r} reads it)")
    out = dict(values)
    if out.get("optimizer") == "sgd" and out.get("nesterov") and not out.get("momentum"):
        warnings.warn(
            f"task {task!r}: nesterov=true with momentum=0 is plain SGD (Nesterov's step "
            "looks ahead along the momentum); training with nesterov=false",
            UserWarning,
            stacklevel=3,
        )
        out["nesterov"] = False
    return out


def check_mapping(hparams: Any, task: str, accepted: Mapping[str, HParam]) -> None:
    """A run's task.hparams: the two size blocks and the keys beside them, every key
    accepted and every value in range (both sizes: a misspelling is one whichever size
    runs)."""
    if hparams is None:
        return
    if not isinstance(hparams, Mapping):
        raise HParamError("", f"={hparams!r} must be a mapping (a paper: and a smoke: block)")
    for size in SIZES:
        block = hparams.get(size)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise HParamError(size, f"={block!r} must be a mapping of hyper-parameters")
        check_values(block, task, accepted, where=f"{size}.")
    check_values({k: v for k, v in hparams.items() if k not in SIZES}, task, accepted)


def file_problems(
    name: str, accepted: Mapping[str, HParam], conf: str | Path | None = None
) -> list[str]:
    """What is wrong with conf/task/<name>.yaml for the registered task `name`, one line
    each (empty when nothing): its name, the two blocks, every key and value in each, and
    the keys a block lacks. FileNotFoundError when there is no such file."""
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    try:
        node = read_task_file(name, conf)
    except (ValueError, YAMLError, OmegaConfBaseException) as exc:
        return [str(exc).strip().splitlines()[0]]
    problems = []
    if node.get("name") != name:
        problems.append(f"name: {node.get('name')!r} should be {name!r}")
    hparams = node.get("hparams")
    if not isinstance(hparams, Mapping):
        return problems + ["needs hparams: with a paper: and a smoke: block"]
    beside = sorted(str(k) for k in hparams if k not in SIZES)
    if beside:
        problems.append(
            f"hparams holds {', '.join(beside)} beside the blocks: a file gives each value "
            "in hparams.paper or hparams.smoke (a key beside them is a run's override)"
        )
    for size in SIZES:
        block = hparams.get(size)
        if not isinstance(block, Mapping):
            problems.append(f"hparams.{size} block missing (a mapping of hyper-parameters)")
            continue
        for key, value in block.items():  # each one, so one check lists them all
            try:
                check_values({key: value}, name, accepted, where=f"{size}.")
            except HParamError as exc:
                problems.append(exc.message("hparams."))
        missing = [k for k, spec in accepted.items() if spec.required and k not in block]
        if missing:
            problems.append(f"hparams.{size} lacks {', '.join(missing)} (the task reads them)")
    return problems
