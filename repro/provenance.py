"""What made a run: RUN_DIR/provenance.json, one entry per launch of the run (a resumed or
extended run adds one), each with

    overrides   the command's overrides as given (before any sweep was expanded) and
                this run's own (the sweep's values for this run)
    command     the command line (sys.argv)
    git         the suite's commit and whether its tree had uncommitted changes
                (tracked files; None outside a git clone)
    versions    Python, torch, the suite, Hydra, OmegaConf, and the optional packages
                the run uses: wandb (logger.wandb), transformers (the transformer tasks),
                datasets (task.data=hf), submitit (a submitted sweep)
    host, time  where and when it was launched

Read with `read`; written through repro.durable (whole or not at all).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

FILE = "provenance.json"
DISTRIBUTION = "gradcomp-repro"


def version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def git_state() -> dict[str, Any] | None:
    """{"commit", "dirty"} of the clone the suite runs from (None: not a git clone, or no
    git). Dirty: a tracked file differs from the commit."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                 "--untracked-files=no"], check=True, capture_output=True,
                                text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def packages(cfg: Any = None, submitted: bool = False) -> dict[str, str | None]:
    """The versions of what a run uses (module docstring)."""
    names = ["torch", DISTRIBUTION, "hydra-core", "omegaconf"]
    if cfg is not None:
        import tasks

        if cfg.logger.wandb:
            names.append("wandb")
        names += [dist for module, dist in tasks.get_task_class(cfg.task.name).extras]
        if cfg.task.data == "hf":
            names.append("datasets")
    if submitted:
        names.append("submitit")
    found = {"python": sys.version.split()[0]}
    found.update({name: version(name) for name in dict.fromkeys(names)})
    torch = sys.modules.get("torch")
    if torch is not None:  # its own version names the build (+cu130, +cpu)
        found["torch"] = torch.__version__
    return found


def entry(given: Sequence[str], run_overrides: Sequence[str], cfg: Any = None,
          submitted: bool = False) -> dict[str, Any]:
    return {"overrides": {"command": list(given), "run": list(run_overrides)},
            "command": list(sys.argv), "git": git_state(),
            "versions": packages(cfg, submitted), "host": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def read(run_dir: str) -> list[dict[str, Any]]:
    """The launches recorded in RUN_DIR/provenance.json, oldest first ([] when none)."""
    try:
        with open(os.path.join(run_dir, FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    launches = data.get("launches") if isinstance(data, dict) else None
    return launches if isinstance(launches, list) else []


def add(run_dir: str, record: dict[str, Any]) -> None:
    """Append one launch's record to RUN_DIR/provenance.json."""
    from repro.durable import write_text

    launches = [*read(run_dir), record]
    write_text(os.path.join(run_dir, FILE), json.dumps({"launches": launches}, indent=1) + "\n")
