"""The one throughput of a run: total samples over total measured step time.

A mean of per-step rates (samples/step_s averaged over steps) weights a fast step as
much as a slow one and is biased upward whenever step times vary: a run whose steps take
1 s and 3 s for 10 samples each processes 20 samples in 4 s (5 samples/s), while the mean
of its rates says 6.7. Every reader of a run (the summary line, summary.json, the W&B
summary, `repro compare`, the figures) takes its rate from here, so they agree.

Beside the rate: the median step time and its 10th–90th percentile interval, which say
how steady the steps were. The projected rate (onto the target cluster of the cost
model) is reduced the same way: projected samples over projected time.

Reads metrics.jsonl records (dicts), never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


def _finite(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def step_samples(record: Mapping[str, Any]) -> float | None:
    """Samples all workers processed in a step: its `samples` (logged since the rate is
    computed from totals), else samples_per_s × step_s of an older record."""
    if _finite(record.get("samples")):
        return float(record["samples"])
    rate, step = record.get("samples_per_s"), record.get("step_s")
    if _finite(rate) and _finite(step):
        return float(rate) * float(step)
    return None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Throughput:
    """A run's throughput over the steps it was computed from."""

    steps: int  # timed steps counted
    samples: float  # samples of those steps, all workers together
    step_s_total: float  # their measured step time, summed
    step_s_median: float | None
    step_s_p10: float | None
    step_s_p90: float | None
    projected_samples_per_s: float | None  # onto the target cluster (cost model)

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.step_s_total if self.step_s_total > 0 else None

    def summary(self) -> dict[str, Any]:
        """The fields summary.json (and with it the W&B summary) holds."""
        return {
            "samples_per_s": self.samples_per_s,
            "timed_steps": self.steps,
            "step_s_median": self.step_s_median,
            "step_s_p10": self.step_s_p10,
            "step_s_p90": self.step_s_p90,
            "projected/samples_per_s": self.projected_samples_per_s,
        }


def throughput(records: Iterable[Mapping[str, Any]], skip_steps: int = 0) -> Throughput:
    """Throughput of the records (metrics.jsonl) from step `skip_steps` on that carry a
    step time and a sample count."""
    samples = seconds = 0.0
    times: list[float] = []
    proj_samples = proj_seconds = 0.0
    for r in records:
        if r.get("step", 0) < skip_steps:
            continue
        n, step_s = step_samples(r), r.get("step_s")
        if n is None or not _finite(step_s):
            continue
        samples += n
        seconds += float(step_s)
        times.append(float(step_s))
        p_rate, p_step = r.get("projected/samples_per_s"), r.get("projected/step_s")
        if _finite(p_rate) and _finite(p_step):
            proj_samples += float(p_rate) * float(p_step)
            proj_seconds += float(p_step)
    if not times:
        return Throughput(0, 0.0, 0.0, None, None, None, None)
    return Throughput(
        steps=len(times), samples=samples, step_s_total=seconds,
        step_s_median=percentile(times, 50), step_s_p10=percentile(times, 10),
        step_s_p90=percentile(times, 90),
        projected_samples_per_s=proj_samples / proj_seconds if proj_seconds > 0 else None)
