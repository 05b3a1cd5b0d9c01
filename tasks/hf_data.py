"""Data sets in the Hugging Face `datasets` format (task data="hf").

A task with a Hub source names it in the `hf:` block of conf/task/<name>.yaml:

    hf:
      name: glue          # datasets.load_dataset's first argument
      config: sst2        # its configuration name (null: the data set's default)
      revision: null      # a Hub branch, tag or commit (null: the main branch)

With data_root unset the task calls `datasets.load_dataset(name, config, revision=...)`,
which reads datasets' cache (HF_DATASETS_CACHE) or downloads; with data_root set it calls
`datasets.load_from_disk(data_root)`, the offline copy that `save_to_disk` wrote. Either
way the result must hold the Hub set's splits and columns (the task class lists them in
`hf_splits` and `hf_columns`); what is missing is named with the call that fetches it.

Tokenised forms are computed with `Dataset.map(batched=True)` under a fingerprint built
from the data set's own fingerprint and everything the tokenisation depends on, so
datasets caches them next to the data (load_from_disk) or in its cache (load_dataset)
and every later process reuses them (ranks that start together before the cache file
exists each compute it once; datasets writes it atomically).

`datasets` is imported inside the functions that need it: `import tasks` stays light.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tasks import data as D
from tasks import hyperparams

FIELDS = ("name", "config", "revision")
INSTALL_HINT = "pip install 'gradcomp-repro[hf]'"


@dataclass(frozen=True)
class HFSource:
    """Where data="hf" reads a task's data set from: datasets.load_dataset's arguments."""

    name: str
    config: str | None = None
    revision: str | None = None

    def load_call(self) -> str:
        """The datasets.load_dataset(...) call, as Python source."""
        args = [repr(self.name)] + ([repr(self.config)] if self.config else [])
        if self.revision:
            args.append(f"revision={self.revision!r}")
        return f"datasets.load_dataset({', '.join(args)})"

    def label(self) -> str:
        return "/".join(p for p in (self.name, self.config) if p) + (
            f"@{self.revision}" if self.revision else ""
        )


def file_block(task: str) -> Mapping[str, Any] | None:
    """The `hf:` block of conf/task/<task>.yaml (None when the file has none)."""
    node = hyperparams.read_task_file(task).get("hf")
    if node is not None and not isinstance(node, Mapping):
        raise ValueError(
            f"{hyperparams.task_file(task)}: hf must be a mapping with {', '.join(FIELDS)}"
        )
    return node


def source_for(task: str, overrides: Mapping[str, Any] | None = None) -> HFSource:
    """The task file's `hf:` block with `overrides` (hf.KEY values; None: not given) on top."""
    block = file_block(task)
    if not block:
        raise ValueError(
            f"task {task!r} has no Hugging Face data set (no hf: block in "
            f"{hyperparams.task_file(task)})"
        )
    values = dict(block)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[str(key)] = value
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"hf.{unknown[0]} is not a key of the Hugging Face source of task {task!r}; "
            f"allowed: {', '.join(FIELDS)}"
        )
    for key in FIELDS:
        value = values.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"hf.{key}={value!r} must be a non-empty string or null")
    if not values.get("name"):
        raise ValueError(
            f"task {task!r}: hf.name is empty; set it to the data set's Hub name "
            f"(datasets.load_dataset's first argument)"
        )
    return HFSource(**{k: values.get(k) for k in FIELDS})


def datasets_module():
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data='hf' needs the `datasets` package: {INSTALL_HINT}") from None
    return datasets


def fetch_instructions(source: HFSource, data_root: str | None, hint: str = "") -> str:
    """How to get the data set onto this machine: the load_dataset call, how to save it
    with save_to_disk, and which key points the task at the copy."""
    target = data_root or "/path/to/copy"
    return (
        f"on a machine with network access run\n"
        f"    python -c \"import datasets; {source.load_call()}.save_to_disk('{target}')\"\n"
        f"and copy that folder to {target} here, then set task.data_root={target} "
        f"(tasks.build_task(..., data='hf', data_root='{target}')); or run the "
        f"load_dataset call here once with network access to fill datasets' cache "
        f"(HF_DATASETS_CACHE) and leave task.data_root unset" + (f". {hint}" if hint else "")
    )


OFFLINE_HINT = "it reads datasets' cache only, without retrying the Hub"


def hub_offline() -> bool:
    """Whether Hugging Face's offline mode is on (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1)."""
    import os

    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hub cannot be reached from here (a name that does not resolve, a refused or
    timed-out connection), or None when it answers or a proxy stands between (its own
    business). One connection attempt, at most `timeout_s`: a machine without network
    learns it in milliseconds, instead of after the Hub client's retries."""
    import os
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"
    return None


def _load_from_hub(datasets, source: HFSource):
    """datasets.load_dataset(source); when the Hub is unreachable, from datasets' cache
    only (its offline mode, for this call): no retries against a network that is not
    there."""
    why = None if hub_offline() else hub_unreachable()
    if why is None:
        return datasets.load_dataset(source.name, source.config, revision=source.revision), None
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(source.name, source.config, revision=source.revision), why
    except Exception as exc:  # the caller names it
        exc.hub_unreachable = why
        raise
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def load(
    task: str,
    source: HFSource,
    data_root: str | None,
    splits: Iterable[str],
    columns: Iterable[str],
    hint: str = "",
):
    """The task's DatasetDict (memoised per process), checked to hold `splits`, each with
    `columns`. A data set that cannot be found is one FileNotFoundError saying what to
    download, how to save it and which key to set; a data set that lacks a split or a
    column is a ValueError naming it."""
    splits, columns = tuple(splits), tuple(columns)

    def make():
        datasets = datasets_module()
        if data_root is not None:
            try:
                dd = datasets.load_from_disk(str(data_root))
            except FileNotFoundError as exc:
                raise FileNotFoundError(
                    f"task {task!r} with data='hf': no data set saved with save_to_disk in "
                    f"task.data_root={data_root} ({_first_line(exc)}); to make it, "
                    + fetch_instructions(source, data_root, hint)
                ) from None
            where = f"task.data_root={data_root}"
        else:
            try:
                dd, _ = _load_from_hub(datasets, source)
            # Offline and not cached, a renamed set, an unknown config, a refused loading
            # script: each surfaces as a different exception class across datasets versions.
            except Exception as exc:  # noqa: BLE001
                why = getattr(exc, "hub_unreachable", None)
                if why is not None:
                    where = (f"the Hub is unreachable from here ({why}) and datasets' cache "
                             f"does not hold it; on a machine without network set "
                             f"HF_HUB_OFFLINE=1 ({OFFLINE_HINT})")
                elif hub_offline():
                    where = "HF_HUB_OFFLINE=1 is set and datasets' cache does not hold it"
                else:
                    where = "the data set is neither in datasets' cache nor reachable"
                raise FileNotFoundError(
                    f"task {task!r} with data='hf': {source.load_call()} failed "
                    f"({_first_line(exc)}); {where}. To use an offline copy, "
                    + fetch_instructions(source, None, hint)
                ) from None
            where = source.load_call()
        if not isinstance(dd, datasets.DatasetDict):  # a bad data set is a ValueError
            raise ValueError(  # noqa: TRY004
                f"task {task!r} with data='hf': {where} holds a single {type(dd).__name__}, "
                f"not the DatasetDict of splits {', '.join(splits)}; save the whole result of "
                f"{source.load_call()} (not one split) with save_to_disk"
            )
        missing = [s for s in splits if s not in dd]
        if missing:
            raise ValueError(
                f"task {task!r} with data='hf': {where} lacks split(s) {', '.join(missing)} "
                f"(it holds {', '.join(dd) or 'none'}); the task reads the splits of "
                f"{source.load_call()}: {', '.join(splits)}"
            )
        for s in splits:
            lacking = [c for c in columns if c not in dd[s].column_names]
            if lacking:
                raise ValueError(
                    f"task {task!r} with data='hf': split {s!r} of {where} lacks column(s) "
                    f"{', '.join(lacking)} (it has {', '.join(dd[s].column_names)}); the task "
                    f"reads {', '.join(columns)} as {source.load_call()} gives them"
                )
        return dd

    key = ("hf", task, source, None if data_root is None else str(data_root), splits, columns)
    return D.memo(key, make)


def task_dataset(task):
    """`load` for a Task built with data="hf": its source, data_root, splits (the values
    of its class's `hf_splits`), columns (`hf_columns`) and hint (`hf_hint`)."""
    return load(
        task.name,
        task.hf_source,
        task.data_root,
        task.hf_splits.values(),
        task.hf_columns,
        hint=task.hf_hint,
    )


def describe(task) -> str:
    """Where a data="hf" task's data comes from, for its data_source."""
    where = f" saved in {task.data_root}" if task.data_root is not None else ""
    return f"Hugging Face {task.hf_source.label()}{where}"


def mapped(dataset, fn: Callable, tag: str, **kwargs):
    """dataset.map(fn, batched=True, ...) cached under a fingerprint made of the data set's
    fingerprint and `tag` (everything fn's output depends on: tokenizer, lengths, format
    version). Where the cache file cannot be written (a read-only copy), it maps in memory."""
    fingerprint = hashlib.sha1(f"{dataset._fingerprint}|{tag}".encode()).hexdigest()[:16]
    kw = dict(batched=True, new_fingerprint=fingerprint, desc=f"tokenising ({tag})", **kwargs)
    try:
        return dataset.map(fn, **kw)
    except OSError:
        return dataset.map(fn, keep_in_memory=True, **kw)


def tensors(dataset, columns: Iterable[str]) -> dict[str, Any]:
    """{column: torch tensor} of a mapped data set (rows stacked)."""
    columns = list(columns)
    return dict(dataset.with_format("torch", columns=columns)[:])
