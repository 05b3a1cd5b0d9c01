"""The name → task class table that @register_task (tasks.base) fills, timm style: lookup,
listing by wildcard, and which tasks read a Hugging Face data set.

The task families (FAMILIES) register their classes when they are imported; the table
imports them by module name on first use, so `import tasks` stays light (no torchvision,
transformers or datasets) and this module depends on no family and not on tasks.base.
"""

from __future__ import annotations

import fnmatch
import importlib

FAMILIES = (
    "tasks.vision",
    "tasks.language",
    "tasks.recsys",
    "tasks.xml",
    "tasks.transformers_tasks",
)

_REGISTRY: dict[str, type] = {}
_loaded = False


def add(name: str, cls: type) -> None:
    """Enter `cls` under `name`; a different class under a taken name is refused (two
    workloads silently sharing a name would make results lie)."""
    old = _REGISTRY.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"task name {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
            "pick another name"
        )
    cls.name = name
    _REGISTRY[name] = cls


def _load_families() -> None:
    global _loaded
    if not _loaded:
        for module in FAMILIES:
            importlib.import_module(module)
        _loaded = True


def list_tasks(pattern: str = "*") -> list[str]:
    """Registered task names matching a shell-style wildcard, sorted."""
    _load_families()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatchcase(n, pattern))


def get_task_class(name: str) -> type:
    """The registered class (KeyError listing the known names for an unknown one)."""
    _load_families()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}") from None


def hf_tasks() -> list[str]:
    """The tasks that accept data="hf" (a Hugging Face `datasets` source), sorted."""
    return [n for n in list_tasks() if _REGISTRY[n].hf_splits]


def hf_refusal(name: str) -> str:
    """Why task `name` refuses data="hf", and what to use instead."""
    why = get_task_class(name).hf_unavailable
    return (
        f"task {name!r} has no Hugging Face data set source{f' ({why})' if why else ''}, so "
        f"data='hf' is not available for it; use data='standin' or data='canonical' (with "
        f"data_root). data='hf' works for: {', '.join(hf_tasks())}"
    )
