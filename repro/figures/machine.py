"""The machine a figure runs on: what it is, how busy, and how long a figure takes on it.

`machine()` is recorded in each run's status.json; its `kind` (CPU model, core count, GPU)
keys recorded run times, from which `estimate_seconds` expects a fresh run's time on this
kind of machine. `busy_reasons` says why timings taken now would be noisier.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from repro.figures.records import read_status, run_info
from repro.figures.registry import get, outputs_dir, published_root


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where a figure ran; `kind` (CPU model, core count, GPU) keys recorded run times."""
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = _cpu_model()
    kind = f"{cpu}, {os.cpu_count()} CPUs" + (f", {cuda}" if cuda else "")
    return {"kind": kind, "cpu": cpu, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cuda": cuda}


def load_average() -> list[float] | None:
    """os.getloadavg(): the 1, 5 and 15 minute load averages (None where unsupported)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# A machine counts as busy when, before a figure starts, the 1-minute load average is at
# least BUSY_LOAD_PER_CPU per CPU, or the one-pass floor's 90th percentile is more than
# BUSY_SPREAD times its 10th.
BUSY_LOAD_PER_CPU = 0.75
BUSY_SPREAD = 1.5


def busy_reasons(load: Sequence[float] | None, calibration: Mapping[str, Any] | None,
                 cpus: int | None = None) -> list[str]:
    """Why this machine looks busy for timing (empty when it does not)."""
    cpus = cpus or os.cpu_count() or 1
    out = []
    if load and load[0] >= BUSY_LOAD_PER_CPU * cpus:
        out.append(f"load average {load[0]:.2f} on {cpus} CPUs")
    if calibration and calibration.get("spread", 1.0) > BUSY_SPREAD:
        out.append(f"the one-pass floor's 90th percentile is {calibration['spread']:.2f}× its "
                   f"10th ({calibration['floor_p10_ms']:.3f}–{calibration['floor_p90_ms']:.3f} ms)")
    return out


# -- run times recorded on this kind of machine ------------------------------------------------


def estimate_seconds(figure_id: str, size: str, out_root: Path | str | None = None,
                     results_root: Path | str | None = None,
                     kind: str | None = None) -> tuple[float, str]:
    """(seconds, where from) a fresh run of the figure is expected to take: the last
    run recorded on this kind of machine (this clone's outputs, then the published
    results), else the last published run on any machine, else the figure's built-in
    estimate. A record whose run skipped finished training runs does not count."""
    fig = get(figure_id)
    if kind is None:
        kind = _machine_kind()
    candidates = []
    mine = read_status(figure_id, folder=outputs_dir(figure_id, size, out_root))
    pub = read_status(figure_id, published_root(results_root, size))
    for where, st in (("this machine's last run", mine), ("published run", pub)):
        info = run_info(st)
        # Older records do not say whether training runs were skipped: trust them only
        # for figures that train nothing.
        fresh = info.get("runs_skipped") == 0 or ("runs_skipped" not in info
                                                   and fig.kind != "training")
        if st and st.get("size") == size and info.get("elapsed_s") is not None and fresh:
            candidates.append((where, st))
    for where, st in candidates:
        if (run_info(st).get("machine") or {}).get("kind") == kind:
            return float(run_info(st)["elapsed_s"]), f"{where}, same machine kind"
    for where, st in candidates:
        return float(run_info(st)["elapsed_s"]), f"{where}, another machine"
    return float(fig.est_seconds[size]), "built-in estimate"


_KIND: str | None = None


def _machine_kind() -> str:
    global _KIND
    if _KIND is None:
        cuda = None
        try:
            import torch

            cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        except ImportError:
            pass
        _KIND = f"{_cpu_model()}, {os.cpu_count()} CPUs" + (f", {cuda}" if cuda else "")
    return _KIND
