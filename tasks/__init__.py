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

from typing import Any

from tasks.base import METRICS, Task, count_parameters, register_task
from tasks.registry import get_task_class, hf_refusal, hf_tasks, list_tasks


def build_task(name: str, **kwargs: Any) -> Task:
    """Instantiate a registered task: size, data, data_root, batch_size, seed, hparams
    (overrides of the task file's values for this size) and any task-specific keyword its
    class documents.

    data="hf" reads the task's Hugging Face data set (`hf_tasks()` lists the tasks that
    have one): `hf={"name": ..., "config": ..., "revision": ...}` overrides the task
    file's `hf:` block (None values keep the file's), data_root a folder written by
    `save_to_disk`. `hf` is ignored for the other data kinds, so a caller may always pass
    it; a task without a Hugging Face source refuses data="hf" naming those that have one."""
    cls = get_task_class(name)
    hf = kwargs.pop("hf", None)
    if kwargs.get("data") == "hf":
        if not cls.hf_splits:
            raise ValueError(hf_refusal(name))
        kwargs["hf"] = hf
    return cls(**kwargs)


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
