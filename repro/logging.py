"""Run-directory metrics, W&B on rank 0, progress bars.

A run directory (written by the trainer, read by `repro compare` and the sweeps):

    RUN_DIR/config.yaml     the resolved config the workers read
    RUN_DIR/metrics.jsonl   one JSON object per logged step: {"step", "wall_time", ...}
    RUN_DIR/summary.json    final numbers (written atomically at the end): what the summary
                            line prints (`run_results`, the throughput) and more
    RUN_DIR/provenance.json what made each launch of the run (repro.provenance)
    RUN_DIR/checkpoints/    the trainer's checkpoints (the last step's always kept)
    RUN_DIR/DONE            marker: the run finished (sweeps skip such runs)
    RUN_DIR/FAILED          its last attempt failed or diverged (repro.failures)

Crash safety: every metrics line is flushed and fsynced, so a killed rank loses at most
the line it was writing. A relaunch from the checkpoint at step N rewrites the file
keeping only complete lines with step <= N, so the file never holds a step twice or
misses one. W&B mode comes from WANDB_MODE (default "offline": a machine without an
account or network still logs, and `wandb sync RUN_DIR/wandb/offline-run-*` uploads later).

W&B sees the same numbers under grouped names (`wandb_name`; `metric_key` maps back, and
`repro compare --metric` takes either form): the keys in WANDB_NAMES get their name from
the table, a key that already has a prefix ("eval/accuracy", "projected/step_s") keeps
it, and any other key goes under "train/". `step` is logged in every row as the x-axis.

Nothing here imports torch: `is_main` looks at torch.distributed only if torch is already
loaded (it cannot be initialised otherwise), so `repro compare` starts fast.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
DONE_FILE = "DONE"
RESERVED_KEYS = ("step", "wall_time")

# metrics.jsonl / summary.json key -> W&B name. Keys not listed: see `wandb_name`.
WANDB_NAMES: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "step_s": "train/step_s",
    "compute_s": "train/compute_s",
    "samples_per_s": "train/samples_per_s",
    "wall_time": "train/wall_time",
    "skipped": "train/skipped",
    "bytes_sent": "comm/bytes_sent",
    "wire_bytes": "comm/wire_bytes",
    "comm_s": "comm/time_s",
    "compress_s": "compress/time_s",
    "estimation_quality": "compress/khat_over_k",
    "target_ratio": "compress/target_ratio",
    "ratio": "compress/ratio",
    "density": "compress/density",
    "compressed_fraction": "compress/compressed_fraction",
    "ef_norm": "compress/ef_norm",
    "nmse": "compress/nmse",
    # summary.json: what the task's quality metric is and when it reached its target
    "metric": "eval/metric",
    "target": "eval/target",
    "higher_is_better": "eval/higher_is_better",
    "time_to_target_s": "eval/time_to_target_s",
    "steps_to_target": "eval/steps_to_target",
}
WANDB_STEP = "step"  # the x-axis of every W&B metric
DEFAULT_PROJECT = "gradcomp-repro"  # W&B project when neither logger.project nor WANDB_PROJECT
DEFAULT_PREFIX = "train/"
_JSONL_KEYS = {name: key for key, name in WANDB_NAMES.items()}


def check_reserved(metrics: Mapping[str, Any]) -> None:
    for key in RESERVED_KEYS:
        if key in metrics:
            raise ValueError(f"metric name {key!r} is reserved (the writer sets it); rename it")


def wandb_name(key: str) -> str:
    """The W&B name of a metrics.jsonl or summary.json key: the table's, else the key
    itself when it has a prefix ("eval/accuracy", "projected/step_s"), else "train/<key>"."""
    if key == WANDB_STEP:
        return key
    if key in WANDB_NAMES:
        return WANDB_NAMES[key]
    return key if "/" in key else DEFAULT_PREFIX + key


def metric_key(name: str) -> str:
    """The metrics.jsonl key of a metric given by either name: a W&B name
    ("compress/khat_over_k", "train/loss", "train/foo") maps back to its key
    ("estimation_quality", "loss", "foo"); a key maps to itself."""
    if name in _JSONL_KEYS:
        return _JSONL_KEYS[name]
    if name.startswith(DEFAULT_PREFIX):
        bare = name[len(DEFAULT_PREFIX):]
        if bare and wandb_name(bare) == name:
            return bare
    return name


def dashboard_fields(config: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """(job_type, tags) of a run's W&B run from its resolved config: the compressor's
    name, and "task:…", "size:…", "workers:…", "ratio:…", "cluster:…" for what the
    config sets."""
    def get(dotted: str) -> Any:
        node: Any = config
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or node.get(part) is None:
                return None
            node = node[part]
        return node

    tags = []
    for tag, dotted in (("task", "task.name"), ("size", "task.size"),
                        ("workers", "cluster.workers"), ("ratio", "compressor.ratio"),
                        ("cluster", "cluster.mode")):
        value = get(dotted)
        if value is not None:
            tags.append(f"{tag}:{value:g}" if isinstance(value, float) else f"{tag}:{value}")
    job_type = get("compressor.name")
    return (None if job_type is None else str(job_type)), tags


def is_main() -> bool:
    """True on rank 0, or when torch.distributed is not initialised (one process). The one
    gate for W&B, files and checkpoints."""
    torch = sys.modules.get("torch")
    if torch is None:  # torch never imported: no process group can exist
        return True
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == 0


# -- values ------------------------------------------------------------------------------
def scalar(key: str, value: Any) -> float | int | bool | str | None:
    """One metric value as JSON: tensors / numpy scalars via .item(), NaN and ±Inf as null
    (strict JSON has neither)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        numel = getattr(value, "numel", None) or getattr(value, "size", None)
        n = numel() if callable(numel) else numel
        if n is not None and n != 1:
            raise TypeError(f"metric {key!r} is a tensor/array of {n} elements; log a scalar "
                            f"(e.g. its mean or norm)")
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; log a number, a 1-element "
                    f"tensor, a string or None")


def sanitise(obj: Any) -> Any:
    """JSON-ready copy of a summary: nested dicts/lists kept, numbers as in `scalar`. Other
    objects are passed through so json raises on them (write_summary reports it)."""
    if isinstance(obj, Mapping):
        return {str(k): sanitise(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitise(v) for v in obj]
    try:
        return scalar("summary", obj)
    except TypeError:
        return obj


# -- metrics.jsonl -----------------------------------------------------------------------
def parse_metrics(path: str) -> tuple[list[dict[str, Any]], bool]:
    """(complete records, whether a torn last line was dropped). A bad line anywhere but
    last is corruption, not a crash mid-write, and raises."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    records: list[dict[str, Any]] = []
    torn = False
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a metrics record")
        except ValueError as exc:
            if last:
                torn = True  # the line a killed writer did not finish
                break
            raise ValueError(f"{path}:{i + 1}: corrupt metrics line ({exc}); only the last line "
                             f"may be incomplete") from None
        records.append(rec)
    return records, torn


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Records of RUN_DIR/metrics.jsonl in file order (a torn last line is skipped)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} is not a run directory: {METRICS_FILE} is missing")
    records, torn = parse_metrics(path)
    if torn:
        warnings.warn(f"{path}: the last line is incomplete (the writer was stopped while "
                      "writing it) and was left out", RuntimeWarning, stacklevel=2)
    return records


def read_summary(run_dir: str) -> dict[str, Any] | None:
    """RUN_DIR/summary.json, or None while the run has not finished; a ValueError naming
    the file when it is not a JSON object (a damaged file)."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            summary = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(summary, dict):  # the file's content is wrong: a ValueError, as for bad JSON
        raise ValueError(f"{path} does not hold a JSON object")  # noqa: TRY004
    return summary


class MetricsWriter:
    """Appends one JSON line per logged step to RUN_DIR/metrics.jsonl (rank 0 only).

    resume_step=None starts a fresh file (a relaunch without a checkpoint restarts from
    step 0, so old lines would repeat). resume_step=N (relaunch after the checkpoint
    taken once step N was logged) keeps the complete lines with step <= N and drops the
    rest, and wall_time continues from the last kept line (or from `wall_offset`, e.g. the
    checkpoint's own clock, if given), so time keeps increasing across relaunches.

    A write that fails (disk full) raises repro.durable.OutputError naming the file;
    the part of the line that reached the file is cut off again, so the file still ends
    with the last complete line.
    """

    def __init__(self, run_dir: str, resume_step: int | None = None, *,
                 wall_offset: float | None = None):
        from repro.durable import remove_stale_temps, write_error, write_file

        bad_type = isinstance(resume_step, bool) or not isinstance(resume_step, int)
        if resume_step is not None and (bad_type or resume_step < -1):
            raise ValueError(f"resume_step={resume_step!r} must be a step number >= -1 (the last "
                             f"step the checkpoint covers) or None for a fresh run")
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.file = None
        kept: list[dict[str, Any]] = []
        # The last step the file held before this writer cut it back (None: none).
        self.previous_last_step: int | None = None
        if resume_step is not None and os.path.exists(self.path):
            records, _ = parse_metrics(self.path)
            kept = [r for r in records if r["step"] <= resume_step]
            self.previous_last_step = max((r["step"] for r in records), default=None)
        remove_stale_temps(self.path)  # left by a writer killed while rewriting the file
        # Rewritten even when nothing changes: also truncates a fresh run's stale file.
        try:
            write_file(self.path, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept))
        except OSError as exc:
            raised = write_error(self.path, exc, "the file was left as it was")
            if raised is None:
                raise
            raise raised from exc
        if wall_offset is None:
            times = [r["wall_time"] for r in kept if isinstance(r.get("wall_time"), (int, float))]
            wall_offset = max(times, default=0.0)
        self.wall_offset = float(wall_offset)
        self.last_step = max((r["step"] for r in kept), default=None)
        self.t0 = time.perf_counter()
        # Unbuffered: each line goes to the file in the call that logs it, and a failed
        # write leaves nothing in a buffer for close() to try again.
        self.file = open(self.path, "ab", buffering=0)

    def wall_time(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def log(self, step: int, **metrics: Any) -> None:
        if self.file is None:
            raise ValueError(f"MetricsWriter for {self.run_dir} is closed")
        if isinstance(step, bool) or not isinstance(step, int):
            if hasattr(step, "item"):
                step = int(step.item())
            else:
                raise TypeError(f"step={step!r} must be an int")
        check_reserved(metrics)
        record: dict[str, Any] = {"step": step, "wall_time": self.wall_time()}
        record.update({k: scalar(k, v) for k, v in metrics.items()})
        line = memoryview((json.dumps(record, allow_nan=False) + "\n").encode("utf-8"))
        fd = self.file.fileno()
        end = os.fstat(fd).st_size
        # The whole line, then fsync: a kill loses at most this line (a torn last line,
        # which readers drop).
        try:
            while line:
                line = line[self.file.write(line):]
            os.fsync(fd)
        except OSError as exc:
            from repro.durable import write_error

            try:
                os.ftruncate(fd, end)  # cut the part that reached the file
            except OSError:
                pass
            raised = write_error(self.path, exc, f"the line of step {step} was not written "
                                 f"(the file ends with step {self.last_step})")
            if raised is None:
                raise
            raise raised from exc
        self.last_step = step

    def throughput(self):
        """repro.throughput.Throughput of every step logged in this run's metrics.jsonl."""
        from repro.throughput import throughput

        return throughput(parse_metrics(self.path)[0])

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """RUN_DIR/summary.json, atomically; a failure of the file system raises
        repro.durable.OutputError naming the file."""
        from repro.durable import remove_stale_temps, write_error

        path = os.path.join(self.run_dir, SUMMARY_FILE)
        remove_stale_temps(path)
        try:
            write_summary(self.run_dir, summary)
        except OSError as exc:
            raised = write_error(path, exc)
            if raised is None:
                raise
            raise raised from exc

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_summary(run_dir: str, summary: Mapping[str, Any]) -> None:
    """RUN_DIR/summary.json, atomically: a failure leaves the previous summary intact."""
    from repro.durable import write_file

    clean = sanitise(summary)

    def dump(f) -> None:
        try:
            json.dump(clean, f, indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"summary for {run_dir} is not JSON-serialisable ({exc}); use "
                            f"numbers, strings, None, lists and dicts") from exc
        f.write("\n")

    write_file(os.path.join(run_dir, SUMMARY_FILE), dump)


# -- W&B ---------------------------------------------------------------------------------
def notice(msg: str) -> None:
    print(f"repro: {msg}", file=sys.stderr, flush=True)


class WandbLogger:
    """W&B run on rank 0; a no-op elsewhere, when disabled, when WANDB_MODE=disabled, or
    when wandb cannot be imported or started (one message says which and why).

    The mode is WANDB_MODE's (set to "offline" here when unset; never passed as mode=, so
    the environment always wins). W&B's files go under WANDB_DIR, else RUN_DIR (its
    wandb/ folder). The project, entity and notes are the arguments' (logger.project,
    logger.entity, logger.notes), else WANDB_PROJECT, WANDB_ENTITY, WANDB_NOTES (the
    project: else "gradcomp-repro"); the tags are the run's own, then `tags`
    (logger.tags), then WANDB_TAGS (comma-separated). The W&B run id is kept in
    RUN_DIR/wandb/run_id so a relaunch after a crash resumes the same W&B run; W&B's steps
    only go up, so the steps an earlier attempt logged (`logged_through` and before) are
    not logged again.

    For dashboards the run carries the project, the group (the figure or sweep: the
    runs/<group>/ folder), the name, the whole resolved config, job_type = the
    compressor and the tags of `dashboard_fields`. Metrics go under their `wandb_name`
    with `step` as their x-axis; `finish` puts the run's summary (given, or else the
    summary.json written since this logger started) into the W&B run summary under the
    same names.

    W&B's own console output (its banner, sync hints, the run summary and sparklines at
    the end) is silenced, and one line of ours says where the W&B run went, unless
    `verbose` is set, or the config holds logger.verbose = true (`repro train
    logger.verbose=true`).
    """

    def __init__(self, config: Mapping[str, Any], project: str | None, group: str | None,
                 name: str, run_dir: str, enabled: bool = True, verbose: bool | None = None,
                 entity: str | None = None, tags: Iterable[str] = (), notes: str | None = None,
                 logged_through: int | None = None):
        self.run = None
        self.run_dir = run_dir
        self.started = time.time()
        self.logged_through = logged_through
        if verbose is None:
            logger_cfg = config.get("logger") if isinstance(config, Mapping) else None
            verbose = bool(logger_cfg.get("verbose", False)) if isinstance(logger_cfg, Mapping) \
                else False
        self.verbose = verbose
        if not enabled or not is_main():
            return
        os.environ.setdefault("WANDB_MODE", "offline")
        mode = os.environ["WANDB_MODE"]
        if mode == "disabled":
            notice("W&B logging is off (WANDB_MODE=disabled); metrics still go to "
                   f"{os.path.join(run_dir, METRICS_FILE)}")
            return
        try:
            import wandb
        except ImportError as exc:
            notice(f"W&B logging is off: wandb cannot be imported ({exc}); `pip install wandb` "
                   f"to enable it. Metrics still go to {os.path.join(run_dir, METRICS_FILE)}")
            return
        ids_dir = os.path.join(run_dir, "wandb")
        os.makedirs(ids_dir, exist_ok=True)
        if not os.path.exists(os.path.join(ids_dir, "run_id")):
            self.logged_through = None  # no earlier attempt logged to W&B
        run_id = self.run_id(ids_dir)
        files_dir = os.environ.get("WANDB_DIR") or run_dir
        os.makedirs(files_dir, exist_ok=True)
        wandb_dir = os.path.join(files_dir, "wandb")
        extra: dict[str, Any] = {}
        settings = getattr(wandb, "Settings", None)
        if not verbose and settings is not None:
            extra["settings"] = settings(silent=True)
        job_type, all_tags = dashboard_fields(config)
        env_tags = [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",")]
        all_tags = list(dict.fromkeys([*all_tags, *map(str, tags), *filter(None, env_tags)]))
        project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        entity = entity or os.environ.get("WANDB_ENTITY") or None
        notes = notes or os.environ.get("WANDB_NOTES") or None
        try:
            self.run = wandb.init(
                project=project, entity=entity, group=group, name=name, job_type=job_type,
                tags=all_tags, notes=notes, dir=files_dir, id=run_id, resume="allow",
                config=dict(config), **extra,
            )
        except Exception as exc:  # noqa: BLE001 -- logging must not kill a training run
            notice(f"W&B logging is off: wandb.init failed in WANDB_MODE={mode} ({exc}); run "
                   f"`wandb login` or set WANDB_MODE=offline. Metrics still go to "
                   f"{os.path.join(run_dir, METRICS_FILE)}")
            self.run = None
            return
        define = getattr(self.run, "define_metric", None)
        if define is not None:
            define(WANDB_STEP)
            define("*", step_metric=WANDB_STEP)
        if not verbose:
            upload = (f"; `wandb sync {os.path.join(wandb_dir, 'offline-run-*')}` uploads it"
                      if mode == "offline" else "")
            notice(f"W&B run {run_id} ({mode}) in {wandb_dir}{upload}")

    @staticmethod
    def run_id(wandb_dir: str) -> str:
        path = os.path.join(wandb_dir, "run_id")
        if os.path.exists(path):
            with open(path) as f:
                existing = f.read().strip()
            if existing:
                return existing
        from repro.durable import write_text

        new = secrets.token_hex(4)
        write_text(path, new + "\n")
        return new

    @property
    def active(self) -> bool:
        return self.run is not None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        if self.logged_through is not None and step <= self.logged_through:
            return  # an earlier attempt of this run logged it
        check_reserved(metrics)
        row: dict[str, Any] = {WANDB_STEP: int(step)}
        for key, value in metrics.items():
            value = scalar(key, value)
            if value is not None:
                row[wandb_name(key)] = value
        self.run.log(row, step=int(step))

    def finish(self, summary: Mapping[str, Any] | None = None) -> None:
        if self.run is None:
            return
        if summary is None:
            summary = self.fresh_summary()
        target = getattr(self.run, "summary", None)
        if summary and target is not None:
            for key, value in sanitise(summary).items():
                if value is not None:
                    target[wandb_name(key)] = value
        self.run.finish()
        self.run = None

    def fresh_summary(self) -> dict[str, Any] | None:
        """RUN_DIR/summary.json if it was written since this logger started (an older
        one belongs to an earlier attempt), else None."""
        path = os.path.join(self.run_dir, SUMMARY_FILE)
        try:
            if os.path.getmtime(path) < self.started - 1.0:
                return None
            return read_summary(self.run_dir)
        except (OSError, ValueError):
            return None


# -- the end of a run ----------------------------------------------------------------------
def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_results(records: Iterable[Mapping[str, Any]],
                ratio: float | None = None) -> dict[str, Any]:
    """What the end of a run reports from its metrics.jsonl records, as summary.json
    holds it: the final training loss, the mean k̂/k (estimation_quality), the mean
    density of the aggregate and the mean ratio the compressor targeted (target_ratio:
    with at least one element per tensor, above the configured `ratio` on small tensors),
    each None where no step logged it; and the configured ratio."""
    records = list(records)

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in records if _num(r.get(key))]

    loss = series("loss")
    return {"final_loss": loss[-1] if loss else None,
            "estimation_quality": _mean(series("estimation_quality")),
            "density": _mean(series("density")), "target_ratio": _mean(series("target_ratio")),
            "ratio": ratio}


def run_summary_lines(run_dir: str) -> list[str]:
    """What `repro train` prints when a run ends, read from its summary.json (older ones:
    the missing numbers from metrics.jsonl): steps and wall time; final loss and quality
    metric (best, time to target); throughput (measured and, where logged, projected);
    k̂/k and density beside the ratio it targeted, where the compressor has them; the run
    directory. Empty when the run has no summary.json (it did not finish)."""
    summary = read_summary(run_dir)
    if summary is None:
        return []
    path = os.path.join(run_dir, METRICS_FILE)
    records = parse_metrics(path)[0] if os.path.exists(path) else []

    def num(v: Any, spec: str = ".4g") -> str:
        return format(float(v), spec) if _num(v) else "n/a"

    results = run_results(records)
    results.update({k: summary[k] for k in results if k in summary})
    metric = summary.get("metric")
    parts = [f"{summary.get('steps', '?')} steps in {num(summary.get('wall_time_s'), '.1f')} s",
             f"loss {num(results['final_loss'])}"]
    if metric:
        final = summary.get(f"eval/{metric}")
        if not _num(final):
            evals = [float(r[f"eval/{metric}"]) for r in records if _num(r.get(f"eval/{metric}"))]
            final = evals[-1] if evals else None
        text = f"{metric} {num(final)}"
        if _num(summary.get("time_to_target_s")):
            text += f" (target {num(summary.get('target'))} reached after " \
                    f"{num(summary['time_to_target_s'], '.1f')} s)"
        parts.append(text)
    lines = ["done: " + ", ".join(parts)]
    from repro.throughput import throughput

    # Total samples / total step time (never a mean of per-step rates): summary.json's,
    # else computed from the metrics the same way.
    rate = throughput(records).summary()
    rate.update({k: summary[k] for k in rate if k in summary})
    text = f"{num(rate['samples_per_s'], '.1f')} samples/s measured"
    if _num(rate["step_s_median"]):
        text += (f" (step {num(rate['step_s_median'], '.3g')} s median, "
                 f"10-90% {num(rate['step_s_p10'], '.3g')}-{num(rate['step_s_p90'], '.3g')} s)")
    speed = [text]
    projected = rate["projected/samples_per_s"]
    if _num(projected):
        speed.append(f"{num(projected, '.1f')} projected onto the target cluster")
    if _num(results["estimation_quality"]):
        speed.append(f"k̂/k {num(results['estimation_quality'], '.3g')}")
    if _num(results["density"]):
        text = f"density {num(results['density'], '.3g')}"
        target, ratio = results["target_ratio"], results["ratio"]
        if _num(target):
            text += f" vs target {num(target, '.3g')}"
            if _num(ratio) and abs(target - ratio) > 1e-3 * ratio:
                text += f" (ratio {num(ratio, '.3g')}, at least one element per tensor)"
        speed.append(text)
    lines.append("      " + ", ".join(speed))
    lines.append(f"      run dir {run_dir}")
    return lines


# -- progress and names ------------------------------------------------------------------
LOG_INTERVAL_S = 30.0  # a bar written to a log (not a terminal): one line this often at most


class LogLines:
    """A bar's stream for a log file (SLURM's .err, a pipe): each refresh becomes one whole
    line, instead of carriage returns piling up on a single line."""

    def __init__(self, stream):
        self.stream = stream
        self.last = None

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        if text and text != self.last:  # closing the bar repeats its last state
            self.stream.write(text + "\n")
            self.last = text

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable_or_total: Iterable[Any] | int, desc: str | None = None, enabled: bool = True,
             stream=None):
    """A tqdm bar on rank 0 (iterate it, or call .update(n) when given a total); on other
    ranks or with enabled=False the same object with the bar switched off. On a stream
    that is not a terminal (stderr by default) the bar writes a plain line at most every
    LOG_INTERVAL_S seconds, and at the end."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if isinstance(iterable_or_total, int):
            return NullBar()
        return iterable_or_total
    disable = not (enabled and is_main())
    stream = sys.stderr if stream is None else stream
    kwargs: dict[str, Any] = {"desc": desc, "disable": disable, "dynamic_ncols": True,
                              "file": stream}
    isatty = getattr(stream, "isatty", None)
    bar = tqdm
    if not (callable(isatty) and isatty()):
        kwargs.update(file=LogLines(stream), mininterval=LOG_INTERVAL_S, ascii=True,
                      dynamic_ncols=False, ncols=100)
        # No monitor thread: its forced refreshes would write lines of their own between
        # the bar's, twice for one state.
        bar = type("LogBar", (tqdm,), {"monitor_interval": 0})
    if isinstance(iterable_or_total, int):
        return bar(total=iterable_or_total, **kwargs)
    return bar(iterable_or_total, **kwargs)


class NullBar:
    """Stand-in for a manual tqdm bar when tqdm is missing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass
