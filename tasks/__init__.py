"""Paper workloads as tasks: model + data + metric, registered by name.

    import tasks
    tasks.list_tasks("cifar10_*")          # ['cifar10_mixer', 'cifar10_resnet18', ...]
    task = tasks.build_task("cifar10_resnet20", size="smoke", data="standin")
    model = task.build_model()
    tasks.build_task("cifar10_resnet18", size="paper", hparams={"momentum": 0.5}).hparams

Hyper-parameters come from conf/task/<name>.yaml (the file `repro train task=<name>`
composes); `hparams=` overrides some for this size, checked as on the command line.

Importing this package imports neither torchvision nor transformers: the task modules
import them inside the functions that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

from tasks.base import METRICS, Task, count_parameters, register_task

_FAMILIES = (
    "tasks.vision",
    "tasks.language",
    "tasks.recsys",
    "tasks.xml",
    "tasks.transformers_tasks",
)
_loaded = False


def _load_families() -> None:
    global _loaded
    if not _loaded:
        for module in _FAMILIES:
            importlib.import_module(module)
        _loaded = True


def list_tasks(pattern: str = "*") -> list[str]:
    """Registered task names matching a shell-style wildcard, sorted."""
    from tasks.base import registered

    _load_families()
    return registered(pattern)


def get_task_class(name: str) -> type[Task]:
    """The registered class (KeyError listing the known names for an unknown one)."""
    from tasks.base import task_class

    _load_families()
    return task_class(name)


def build_task(name: str, **kwargs: Any) -> Task:
    """Instantiate a registered task: size, data, data_root, batch_size, seed, hparams
    (overrides of the task file's values for this size) and any task-specific keyword its
    class documents."""
    return get_task_class(name)(**kwargs)


__all__ = [
    "METRICS",
    "Task",
    "build_task",
    "count_parameters",
    "get_task_class",
    "list_tasks",
    "register_task",
]
