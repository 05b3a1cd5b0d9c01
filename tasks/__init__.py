"""Paper workloads as tasks: model + data + metric, registered by name.

    import tasks
    tasks.list_tasks("cifar10_*")          # ['cifar10_mixer', 'cifar10_resnet18', ...]
    task = tasks.build_task("cifar10_resnet20", size="smoke", data="standin")
    model = task.build_model()
    tasks.build_task("cifar10_resnet18", size="paper", hparams={"momentum": 0.5}).hparams

Hyper-parameters come from conf/task/<name>.yaml (the file `repro train task=<name>`
composes); `hparams=` overrides some for this size, checked as on the command line.

Importing this package imports neither torchvision, transformers nor datasets: the task
modules import them inside the functions that need them.
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
    class documents.

    data="hf" reads the task's Hugging Face data set (`hf_tasks()` lists the tasks that
    have one): `hf={"name": ..., "config": ..., "revision": ...}` overrides the task
    file's `hf:` block (None values keep the file's), data_root a folder written by
    `save_to_disk`. `hf` is ignored for the other data kinds, so a caller may always pass
    it; a task without a Hugging Face source refuses data="hf" naming those that have one."""
    from tasks.base import hf_refusal

    cls = get_task_class(name)
    hf = kwargs.pop("hf", None)
    if kwargs.get("data") == "hf":
        if not cls.hf_splits:
            raise ValueError(hf_refusal(name))
        kwargs["hf"] = hf
    return cls(**kwargs)


def hf_tasks() -> list[str]:
    """The tasks that accept data="hf" (a Hugging Face `datasets` source), sorted."""
    from tasks.base import hf_tasks as registered_hf_tasks

    return registered_hf_tasks()


__all__ = [
    "METRICS",
    "Task",
    "build_task",
    "count_parameters",
    "get_task_class",
    "hf_tasks",
    "list_tasks",
    "register_task",
]
