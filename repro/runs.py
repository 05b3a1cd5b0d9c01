"""Reading a run directory, and the statistics `repro compare` and the paper figures take
from it.

A run directory (repro/logging.py describes how the trainer writes it) holds config.yaml
(the resolved config), metrics.jsonl (one record per logged step; a torn last line, left
by a killed writer, is skipped), summary.json (written once the run finishes; absent
while it runs) and the DONE marker. `load_run` reads all of it into a `Run`; the
statistics are methods of the run, so every reader computes them the same way:

- per-step series of any logged key (`series`, `mean`, `last`), the evaluation curve and
  what follows from it (`eval_curve`, `final_eval`, `best`, `steps_to`);
- the timing of the steps after the warm-up (`WARMUP_STEPS`: the first step carries
  one-off costs, allocator and caches), reduced in the two ways the figures use:
  `projection()` averages each step's projected time (SIDCo, DRAGONN) and
  `mean_step_split()` splits the mean step (DEFT, THC).

Projection of a simulated run. The trainer logs, per step, `step_s` (the whole simulated
step: n workers' forward/backward one after the other, plus every worker's compression),
`compress_s` (worker 0's encode + decode) and `projected/step_s` = compute_s + compress_s +
projected communication. A real worker computes only its own pass, so

    compute per worker  = (step_s − n·compress_s) / n
    projected comm      = projected/step_s − compute_s − compress_s   (from the log)
    projected step      = compute per worker + compress_s + projected comm,

i.e. the communication the trainer projected from the bytes each tensor really sent on
the target cluster (cluster.target_workers, bandwidth_gbps, latency_us), with this CPU's
measured compute and compression times.

Nothing here imports torch (numpy only where percentiles or the figures' means need it),
so `repro compare` starts fast.
"""

from __future__ import annotations

import math
import numbers
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from repro.logging import CONFIG_FILE, DONE_FILE, METRICS_FILE, parse_metrics, read_summary
from repro.throughput import Throughput, throughput

WARMUP_STEPS = 1  # steps left out of timing means: one-off set-up costs land in step 0
LOWER_IS_BETTER = ("perplexity", "loss", "error", "wer", "cer", "mse", "nmse")


def fmt(value: Any, spec: str = ".4g", missing: str = "—") -> str:
    """A value as tables and sentences print it: a real number with `spec` (non-finite
    ones as inf/nan), an integer or a bool as itself, None as `missing`, anything else
    through str()."""
    if value is None:
        return missing
    if isinstance(value, (bool, numbers.Integral)):
        return str(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return format(value, spec) if math.isfinite(value) else str(value)
    return str(value)


def _number(value: Any) -> bool:
    """A finite int or float that is not a bool: what a series keeps."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class Projection:
    """A simulated run's steps projected onto one real worker of the target cluster:
    the means over the timed steps after the warm-up of each step's projection."""

    step_s: float | None  # projected step of one worker (compute + compression + comm)
    measured_step_s: float | None  # wall time of a simulated step, all workers in turn
    compress_s: float | None  # worker 0's encode + decode per step
    per_worker_samples: float | None  # samples one worker processes per step
    samples_per_s: float | None  # projected throughput of the whole target cluster

    def time_at(self, steps_done: int) -> float | None:
        """Projected wall time after `steps_done` steps."""
        return None if self.step_s is None else steps_done * self.step_s


@dataclass(frozen=True)
class StepSplit:
    """The mean timed step of a simulated run, split into ONE worker's parts (seconds)."""

    compute_s: float  # one worker's forward/backward (measured)
    compress_s: float  # worker 0's encode + decode (measured)
    comm_s: float  # communication projected onto the target cluster

    @property
    def total_s(self) -> float:
        return self.compute_s + self.compress_s + self.comm_s


@dataclass
class Run:
    """One run directory as read by `load_run`."""

    path: str
    name: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]  # metrics.jsonl records in file order
    summary: dict[str, Any] | None  # None while the run has not finished
    done: bool  # the DONE marker is present
    torn: bool = False  # metrics.jsonl ended in an incomplete line, which was skipped
    failure: dict[str, Any] | None = None  # RUN_DIR/FAILED (repro.failures), if the run failed

    @property
    def status(self) -> str:
        """"done", "failed" / "diverged" (its last attempt), or "running/incomplete"."""
        if self.done:
            return "done"
        if self.failure is not None:
            return str(self.failure.get("status", "failed"))
        return "running/incomplete"

    # -- the config and the summary ----------------------------------------------------
    def cfg(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key ("cluster.workers"), or `default`."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def _int_cfg(self, dotted: str) -> int | None:
        value = self.cfg(dotted)
        return None if value is None else int(value)

    @property
    def compressor(self) -> str:
        return str(self.cfg("compressor.name", "?"))

    @property
    def task(self) -> str:
        return str(self.cfg("task.name", "?"))

    @property
    def ratio(self) -> float | None:
        value = self.cfg("compressor.ratio")
        return None if value is None else float(value)

    @property
    def workers(self) -> int | None:
        return self._int_cfg("cluster.workers")

    @property
    def target_workers(self) -> int | None:
        return self._int_cfg("cluster.target_workers")

    @property
    def steps(self) -> int | None:
        return self._int_cfg("steps")

    @property
    def data_source(self) -> str | None:
        """What the task trained on: the stand-in's description where the run says."""
        src = self.cfg("task.data_source")
        if src is None and self.summary:
            src = self.summary.get("data_source")
        if src is None:
            src = self.cfg("task.data")
        return None if src is None else str(src)

    @property
    def metric(self) -> str | None:
        """The task's quality metric: from the config, the summary, or else the one
        evaluated key that is not the loss (None when that is ambiguous)."""
        m = self.cfg("task.metric")
        if m is None and self.summary:
            m = self.summary.get("metric")
        if m is None:
            evaluated = {k[5:] for r in self.metrics for k in r if k.startswith("eval/")}
            keys = sorted(evaluated - {"loss"})
            m = keys[0] if len(keys) == 1 else None
        return None if m is None else str(m)

    @property
    def eval_key(self) -> str:
        """The metrics key of the quality metric ("eval/accuracy" when none is known)."""
        return f"eval/{self.metric or 'accuracy'}"

    @property
    def higher_is_better(self) -> bool:
        if self.summary and isinstance(self.summary.get("higher_is_better"), bool):
            return self.summary["higher_is_better"]
        hib = self.cfg("task.higher_is_better")
        if isinstance(hib, bool):
            return hib
        name = (self.metric or "").lower()
        return not any(word in name for word in LOWER_IS_BETTER)

    @property
    def target(self) -> float | None:
        """The task's target value of the quality metric, if it has one."""
        t = self.summary.get("target") if self.summary else None
        if t is None:
            t = self.cfg("task.target")
        return t if _number(t) else None

    def reaches(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    # -- per-step series -----------------------------------------------------------------
    def series(self, key: str, x: str = "step", skip_steps: int = 0
               ) -> tuple[list[Any], list[float]]:
        """(x, y) of the records that carry a finite number under `key`, from step
        `skip_steps` on; x is the step (int) for x="step", the wall time for x="time"."""
        if x not in ("step", "time"):
            raise ValueError(f"x={x!r} is not allowed; choose step or time")
        xs: list[Any] = []
        ys: list[float] = []
        for r in self.metrics:
            v = r.get(key)
            if r["step"] < skip_steps or not _number(v):
                continue
            xs.append(r["step"] if x == "step" else float(r.get("wall_time", math.nan)))
            ys.append(float(v))
        return xs, ys

    def mean(self, key: str) -> float | None:
        """Mean of `key` over the records that carry it."""
        _, ys = self.series(key)
        return statistics.fmean(ys) if ys else None

    def throughput(self, skip_steps: int = 0) -> Throughput:
        """The run's rate, total samples / total step time (repro.throughput), over its
        logged steps from `skip_steps` on; never a mean of per-step rates."""
        return throughput(self.metrics, skip_steps)

    def last(self, key: str) -> float | None:
        _, ys = self.series(key)
        return ys[-1] if ys else None

    # -- the quality metric ----------------------------------------------------------------
    @property
    def eval_curve(self) -> list[tuple[int, float]]:
        """(steps done, value) of each evaluation of the quality metric; a step logged
        twice counts once, with its later value."""
        curve: list[tuple[int, float]] = []
        for step, value in zip(*self.series(self.eval_key)):
            if curve and curve[-1][0] == step + 1:
                curve[-1] = (step + 1, value)
            else:
                curve.append((step + 1, value))
        return curve

    @property
    def final_eval(self) -> float | None:
        """The final evaluation: the summary's, else the last one logged."""
        v = self.summary.get(self.eval_key) if self.summary else None
        if _number(v):
            return float(v)
        return self.last(self.eval_key)

    def best(self) -> float | None:
        """Best value of the quality metric over the logged evaluations and the final one."""
        _, values = self.series(self.eval_key)
        final = self.summary.get(self.eval_key) if self.summary else None
        if _number(final):
            values.append(float(final))
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)

    def steps_to(self, target: float) -> int | None:
        """Steps done at the first evaluation reaching `target` (None: never)."""
        for steps_done, value in self.eval_curve:
            if self.reaches(value, target):
                return steps_done
        return None

    def k_ratio_stats(self) -> tuple[float | None, float | None, float | None]:
        """Mean, 5th and 95th percentile of the estimation quality k̂/k over the steps."""
        import numpy as np

        k = np.asarray(self.series("estimation_quality")[1], dtype=np.float64)
        if not k.size:
            return None, None, None
        return float(k.mean()), float(np.percentile(k, 5)), float(np.percentile(k, 95))

    # -- timing ----------------------------------------------------------------------------
    def timed_steps(self, skip_steps: int = WARMUP_STEPS) -> list[dict[str, Any]]:
        """The records that carry a step time, from step `skip_steps` on (all of them
        when the run has no step after its warm-up)."""
        timed = [r for r in self.metrics if r.get("step_s") is not None]
        return [r for r in timed if r["step"] >= skip_steps] or timed

    def _workers(self) -> int:
        if self.workers is None:
            raise ValueError(f"{self.path}: config.yaml has no cluster.workers")
        return self.workers

    def projection(self, skip_steps: int = WARMUP_STEPS) -> Projection:
        """Each timed step projected onto one worker of the target cluster (module
        docstring), then averaged; a step's compute and communication are clamped at 0."""
        import numpy as np

        workers = self._workers()
        proj, step_s, comp, samples = [], [], [], []
        for r in self.timed_steps(skip_steps):
            compress = float(r.get("compress_s") or 0.0)
            comm = float(r["projected/step_s"]) - float(r["compute_s"]) - compress
            compute_per_worker = max(0.0, (float(r["step_s"]) - workers * compress) / workers)
            proj.append(compute_per_worker + compress + max(0.0, comm))
            step_s.append(float(r["step_s"]))
            comp.append(compress)
            if r.get("samples_per_s") is not None:
                samples.append(float(r["samples_per_s"]) * float(r["step_s"]) / workers)
        step = float(np.mean(proj)) if proj else None
        per_worker = float(np.mean(samples)) if samples else None
        cluster = None
        if per_worker is not None and step and self.target_workers is not None:
            cluster = per_worker * self.target_workers / step
        return Projection(step_s=step, measured_step_s=float(np.mean(step_s)) if proj else None,
                          compress_s=float(np.mean(comp)) if proj else None,
                          per_worker_samples=per_worker, samples_per_s=cluster)

    def mean_step_split(self, skip_steps: int = WARMUP_STEPS) -> StepSplit:
        """The mean timed step split into one worker's compute, compression and projected
        communication (module docstring); compute is clamped at 0 after averaging."""
        workers = self._workers()
        timed = self.timed_steps(skip_steps)
        if not timed:
            raise ValueError(f"{self.path}: no step logged a step time")
        compress = statistics.fmean(float(r.get("compress_s") or 0.0) for r in timed)
        step = statistics.fmean(float(r["step_s"]) for r in timed)
        compute = max(0.0, (step - workers * compress) / workers)
        comm = statistics.fmean(float(r["projected/step_s"]) - float(r["compute_s"])
                                - float(r.get("compress_s") or 0.0) for r in timed)
        return StepSplit(compute, compress, comm)


# -- reading -----------------------------------------------------------------------------
def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def load_run(path: str) -> Run:
    """A run directory, or a FileNotFoundError naming the path and the missing file (a
    ValueError when config.yaml is not a YAML mapping)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a run directory: no such directory")
    for required in (CONFIG_FILE, METRICS_FILE):
        if not os.path.isfile(os.path.join(path, required)):
            hint = ""
            if any(os.path.isfile(os.path.join(path, d, CONFIG_FILE)) for d in _listdir(path)):
                hint = f" (it holds run directories: pass them, e.g. {os.path.join(path, '*')})"
            raise FileNotFoundError(f"{path} is not a run directory: {required} is missing{hint}")
    import yaml

    config_path = os.path.join(path, CONFIG_FILE)
    with open(config_path, encoding="utf-8") as f:
        try:
            config = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{config_path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        # the file's content is wrong, not the caller's argument: a ValueError, as for bad YAML
        raise ValueError(f"{config_path} does not hold a config mapping")  # noqa: TRY004
    metrics, torn = parse_metrics(os.path.join(path, METRICS_FILE))
    name = config.get("name") or os.path.basename(os.path.normpath(path))
    from repro.failures import read_failure

    return Run(path=path, name=str(name), config=config, metrics=metrics,
               summary=read_summary(path), done=os.path.exists(os.path.join(path, DONE_FILE)),
               torn=torn, failure=read_failure(path))


COMPARE_MARKER = ".gradcomp-compare"  # in each folder `repro compare` writes


def passed_over(path: str) -> str | None:
    """Why `path`, which a glob like runs/<group>/* picks up, is no run to compare: a
    comparison's own folder (runs/<group>/compare), or a run folder that `repro train`
    made and that logged no step (it failed before its first: its FAILED says why)."""
    from repro.failures import failure_text, read_failure
    from repro.runfolder import MARKER

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        entries = _listdir(path)
        if COMPARE_MARKER in entries or any(
                os.path.isfile(os.path.join(path, e, COMPARE_MARKER)) for e in entries):
            return "comparisons written by repro compare"
    if (os.path.isfile(os.path.join(path, MARKER))
            and not os.path.isfile(os.path.join(path, METRICS_FILE))):
        failure = read_failure(path)
        why = f" ({failure_text(failure)})" if failure else ""
        return f"a run that logged no step{why}"
    return None


def load_runs(paths: Sequence[str], notes: list[str] | None = None) -> list[Run]:
    """Several run directories; two runs of the same name (one per sweep) are told apart
    by their parent folder: "sweep_a/topk-r0.01-w2-…". Folders a glob picks up that are no
    runs to compare (`passed_over`) are left out, each with a line in `notes`."""
    if not paths:
        raise ValueError("give at least one run directory, e.g. repro compare runs/default/*")
    kept = []
    for p in paths:
        why = passed_over(p)
        if why is None:
            kept.append(p)
        elif notes is not None:
            notes.append(f"left out {p}: {why}")
    if not kept:
        raise ValueError(f"none of the {len(paths)} folder(s) given is a run with logged steps "
                         f"({'; '.join(notes or [])})")
    runs = [load_run(p) for p in kept]
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            parent = os.path.basename(os.path.dirname(os.path.normpath(os.path.abspath(r.path))))
            r.name = f"{parent}/{r.name}"
    return runs
