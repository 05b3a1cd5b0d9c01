"""Kill trials: SIGKILL a short training run (or a smoke figure) at a random moment and
check that every file it leaves is absent, the previous valid version or the new one;
then run the same command again and check it completes with the metrics of an
uninterrupted run of the same seed.

    python benchmarks/reliability/kill_trials.py --json results/reliability/kill_trials.json

Each trial trains a smoke task on simulated workers with checkpoint_every=1 through
`repro.launch.train` in a child process and kills it in one of two ways:

- timed: the parent sends SIGKILL after a delay drawn uniformly from [0, 1.1 T], T the
  duration of an uninterrupted run of the same command;
- at-write: the child sends itself SIGKILL just before its k-th change to the output
  folder (a file opened for writing, a rename, a removal, a folder created), k drawn
  uniformly over the changes an uninterrupted run makes. These land exactly in the
  windows a timed kill rarely hits: a temp file written but not renamed, a checkpoint's
  files written but its MANIFEST not, summary.json written but DONE not.

A quarter of the trials kill the relaunch once more before the final run.

Two more kinds of trial go through `repro train` (repro.cli) as a user does, on runs of
--long-steps steps (30: most signals and second launches land while the run trains;
T below is such a run's duration):

- concurrent: two launches of the same run, the second started after a delay drawn
  from [0, 0.8 T]; without --wait one of them runs and the other stops naming the first
  (its pid@host) or finds the run done; with --wait (the second launch) the second waits
  and then finds it done. Checked: exactly one of them trained, the holder named is the
  other launch, the run folder ends equal to an uninterrupted run's, no rerun needed;
- signal: SIGTERM or SIGINT to the launcher process alone after a delay drawn from
  [0, 1.1 T] (simulated workers, and spawned gloo ranks that only the launcher's
  forwarding reaches). Checked: exit 128 + the signal, and a last line "interrupted at
  step N; checkpoint at step N; the same command resumes" whose checkpoint exists and is
  sealed, whose metrics hold steps 0..N-1 and no DONE (or the run had finished: exit 0,
  DONE); no rank left running; then the same command resumes from step N and ends equal
  to an uninterrupted run.

The changes
are seen through a Python audit hook (sys.addaudithook) installed in the child, which also
classifies how each final file is written: through a temp file and a rename (atomic),
appended in place, or rewritten in place (a kill mid-write leaves part of it).

Children are forked from this process (torch and the suite imported once: a trial costs
the training, not the interpreter start); `--launcher exec` starts each as a fresh
interpreter running this file in child mode instead. Only the suite's public API is used:
repro.launch (plan, train), repro.runs (load_run, parse_metrics), repro.checkpoints
(config_hash, check, find, load), and the `repro figure` command line (repro.cli).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

TASK_OVERRIDES = ["eval_every=0", "eval_batches=1", "checkpoint_every=1", "cluster=simulated",
                  "cluster.workers=2", "cluster.threads_per_worker=1", "logger=local",
                  "logger.progress=false", "task.size=smoke"]
COMPRESSOR_OVERRIDES = {
    "topk": ["compressor=topk", "compressor.ratio=0.05"],
    "dgc": ["compressor=dgc", "compressor.ratio=0.05"],
    "powersgd": ["compressor=powersgd"],
    "sidco_e": ["compressor=sidco_e", "compressor.ratio=0.05"],
    "thc": ["compressor=thc"],
}
CHECKPOINT_FILES = ["trainer.pt", "workers.pt"]  # a simulated run's checkpoint
# The signal trials' spawned ranks: 2 gloo ranks instead of 2 simulated workers.
RANKS_OVERRIDES = ["cluster=local_cpu", "cluster.workers=2", "cluster.threads_per_worker=1"]
RANKS_CHECKPOINT_FILES = ["trainer.pt", "rank0.pt", "rank1.pt"]
_INTERRUPTED = re.compile(r"^repro train: interrupted at step (\d+); checkpoint at step (\d+); "
                          r"the same command resumes$")
_INTERRUPTED_EARLY = re.compile(r"^repro train: interrupted at step (\d+); no checkpoint \(the "
                                r"same command starts the run again\)$")
TAG = "GRADCOMP_KILL_TRIAL"  # environment variable naming a trial's folder in its processes
_TEMP = re.compile(r"\.[A-Za-z0-9_]{8}\.tmp$|\.tmp(\.png)?$|\.tmp$")


# -- the child ----------------------------------------------------------------------------
def _writing(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def _install_audit(watch: str, kill_at: int | None, log: list | None) -> None:
    """Count (and log) every change under `watch`; SIGKILL this process just before the
    kill_at-th one."""
    watch = os.path.abspath(watch) + os.sep
    count = [0]

    def inside(p: Any) -> bool:
        return isinstance(p, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(p)).startswith(watch)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if not (inside(path) and _writing(mode, flags)):
                return
            append = (isinstance(mode, str) and "a" in mode) or (
                isinstance(flags, int) and bool(flags & os.O_APPEND))
            entry = ("open-append" if append else "open-write", os.fsdecode(path), None)
        elif event == "os.rename":
            if not inside(args[1]):
                return
            entry = ("rename", os.fsdecode(args[0]), os.fsdecode(args[1]))
        elif event in ("os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree"):
            if not inside(args[0]):
                return
            entry = (event, os.fsdecode(args[0]), None)
        else:
            return
        count[0] += 1
        if log is not None:
            log.append(entry)
        if kill_at is not None and count[0] == kill_at:
            if log is not None:
                log.append(("killed", entry[1], entry[0]))
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def child(spec: dict[str, Any]) -> int:
    """Run one command (a training run or a smoke figure) as a trial's child."""
    log_fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    audit: list | None = [] if spec.get("audit") else None
    os.environ[TAG] = spec["watch"]  # inherited by every process the run starts
    _install_audit(spec["watch"], spec.get("kill_at"), audit)
    code = 0
    try:
        if spec["kind"] == "train":
            from repro import launch

            launch.train(spec["overrides"])
        elif spec["kind"] == "cli-train":
            from repro import cli

            code = cli.main(["train", *spec["overrides"], *spec.get("flags", [])])
        else:
            from repro import cli

            code = cli.main(["figure", spec["figure"], "--size", "smoke", "--out", spec["out"]])
    except BaseException:  # noqa: BLE001 - reported through the exit status and the log
        traceback.print_exc()
        code = 1
    if audit is not None:
        with open(spec["audit"], "w") as f:
            json.dump(audit, f)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


@dataclass
class Outcome:
    status: str  # "killed", "exited", "hung"
    code: int | None
    seconds: float
    moment: float | None = None  # timed kills: seconds after the start


@dataclass
class Child:
    pid: int
    proc: subprocess.Popen | None
    start: float


def start_child(spec: dict[str, Any], launcher: str) -> Child:
    start = time.perf_counter()
    if launcher == "fork":
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(spec)
            finally:
                os._exit(code)
        return Child(pid, None, start)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                             json.dumps(spec)])
    return Child(proc.pid, proc, start)


def wait_child(c: Child, kill_after: float | None, timeout: float,
               send: int = signal.SIGKILL) -> Outcome:
    """Wait for a started child, sending it `send` kill_after seconds after its start
    (None: never); SIGKILL once `timeout` has passed."""
    deadline = c.start + timeout
    sent = False
    while True:
        if c.proc is None:
            done, status = os.waitpid(c.pid, os.WNOHANG)
            code = (os.waitstatus_to_exitcode(status) if done else None)
        else:
            code = c.proc.poll()
            done = code is not None
        now = time.perf_counter()
        if done:
            elapsed = now - c.start
            if code == -signal.SIGKILL:  # by this process, or at a write by itself
                return Outcome("killed", code, elapsed, kill_after)
            return Outcome("exited", code, elapsed)
        if kill_after is not None and not sent and now - c.start >= kill_after:
            os.kill(c.pid, send)
            sent = True
        if now > deadline:
            os.kill(c.pid, signal.SIGKILL)
            (os.waitpid(c.pid, 0) if c.proc is None else c.proc.wait())
            return Outcome("hung", None, now - c.start)
        time.sleep(0.002)


def run_child(spec: dict[str, Any], launcher: str, kill_after: float | None,
              timeout: float) -> Outcome:
    """Start the child, SIGKILL it after kill_after seconds (None: never), wait."""
    return wait_child(start_child(spec, launcher), kill_after, timeout)


# -- checks -------------------------------------------------------------------------------
@dataclass
class Check:
    files: int = 0
    corrupt: list[str] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)

    def bad(self, path: str, why: str) -> None:
        self.corrupt.append(f"{path}: {why}")

    def merge(self, other: Check) -> None:
        self.files += other.files
        self.corrupt += other.corrupt
        self.temps += other.temps
        self.other += other.other


@dataclass
class Reference:
    """What an uninterrupted run of the command leaves."""

    config: dict[str, Any]
    metrics: list[tuple[int, Any]]  # (step, loss)
    summary: dict[str, Any]
    cfg_hash: str
    seconds: float
    changes: int  # changes to the output folder (audit events)
    writes: dict[str, str]  # final file (relative) -> how it is written
    events: list = field(default_factory=list)  # the changes, in order (audit log)
    needed: list[str] = field(default_factory=lambda: list(CHECKPOINT_FILES))


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if _same(a, b) else [f"{prefix[:-1]}: {a!r} vs {b!r}"]


def _results_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config without the keys that cannot change a run's results (where the run
    lives: the trial's folder differs from the uninterrupted run's)."""
    from repro.config import RESULT_NEUTRAL_KEYS, without_keys

    return without_keys(config, RESULT_NEUTRAL_KEYS)


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def check_run(run_dir: str, ref: Reference | None, cfg_hash: str | None, final: bool,
              needed: list[str] = CHECKPOINT_FILES) -> Check:
    """Every file of a run directory: absent, the previous valid version or the new one.
    With `ref`, contents are compared with the uninterrupted run's (config equal, metrics
    a prefix of its (step, loss), summary equal on the evaluated keys); `final`: the run
    must be complete and equal to it."""
    from repro import checkpoints, runs

    c = Check()
    if not os.path.isdir(run_dir):
        if final:
            c.bad(run_dir, "missing after the final run")
        return c
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    known = {"config.yaml", "metrics.jsonl", "summary.json", "DONE", ".gradcomp-run", ".lock"}
    for path in _files(run_dir):
        rel = os.path.relpath(path, run_dir)
        c.files += 1
        if _TEMP.search(rel):
            c.temps.append(rel)
        elif rel not in known and not rel.startswith("checkpoints" + os.sep):
            c.other.append(rel)
    # config.yaml
    cfg_path = os.path.join(run_dir, "config.yaml")
    config = None
    if os.path.exists(cfg_path):
        import yaml

        try:
            with open(cfg_path) as f:
                config = yaml.safe_load(f)
            if not isinstance(config, dict):
                raise TypeError("not a mapping")
            if ref is not None and not _same(_results_config(config), _results_config(ref.config)):
                c.bad(cfg_path, "differs from the config of the command: "
                                f"{_differences(_results_config(config), _results_config(ref.config))}")
        except Exception as exc:  # noqa: BLE001
            c.bad(cfg_path, f"unreadable ({exc})")
    elif final:
        c.bad(cfg_path, "missing after the final run")
    # metrics.jsonl, through the suite's reader
    m_path = os.path.join(run_dir, "metrics.jsonl")
    records: list[dict] = []
    if os.path.exists(m_path):
        try:
            records, torn = runs.parse_metrics(m_path)
            if torn and final:
                c.bad(m_path, "ends in a torn line after the final run")
            got = [(r["step"], r.get("loss")) for r in records]
            if ref is not None and got != ref.metrics[:len(got)]:
                c.bad(m_path, "its records are not a prefix of the uninterrupted run's "
                              "(step, loss)")
            if final and ref is not None and got != ref.metrics:
                c.bad(m_path, f"{len(got)} records, not the uninterrupted run's "
                              f"{len(ref.metrics)} (step, loss)")
        except Exception as exc:  # noqa: BLE001
            c.bad(m_path, f"unreadable ({exc})")
    elif final:
        c.bad(m_path, "missing after the final run")
    # summary.json
    s_path = os.path.join(run_dir, "summary.json")
    summary = None
    if os.path.exists(s_path):
        try:
            with open(s_path) as f:
                summary = json.load(f)
            if ref is not None:
                keys = [k for k in ref.summary if k.startswith("eval/")] + ["steps"]
                diff = [k for k in keys if summary.get(k) != ref.summary.get(k)]
                if diff:
                    c.bad(s_path, f"differs from the uninterrupted run's on {diff}")
        except Exception as exc:  # noqa: BLE001
            c.bad(s_path, f"unreadable ({exc})")
            summary = None
    elif final:
        c.bad(s_path, "missing after the final run")
    # DONE: only with a complete summary and complete metrics
    d_path = os.path.join(run_dir, "DONE")
    if os.path.exists(d_path):
        with open(d_path) as f:
            text = f.read()
        steps = (ref.summary.get("steps") if ref is not None
                 else (summary or {}).get("steps"))
        if summary is None:
            c.bad(d_path, "present without a complete summary.json")
        if text != f"{steps}\n":
            c.bad(d_path, f"holds {text!r}, not the step count")
        if ref is not None and len(records) != len(ref.metrics):
            c.bad(d_path, "present while metrics.jsonl is incomplete")
    elif final:
        c.bad(d_path, "missing after the final run")
    # checkpoints: sealed by a valid MANIFEST, or ignored by checkpoints.find
    if os.path.isdir(ckpt_dir) and cfg_hash is not None:
        sealed = []
        for name in sorted(os.listdir(ckpt_dir)):
            step_dir = os.path.join(ckpt_dir, name)
            if not (os.path.isdir(step_dir) and name.startswith("step_")):
                continue
            if os.path.exists(os.path.join(step_dir, checkpoints.MANIFEST)):
                try:
                    checkpoints.check(step_dir, cfg_hash, needed)
                    sealed.append(step_dir)
                except checkpoints.BadCheckpoint as exc:
                    c.bad(step_dir, f"sealed but invalid ({exc})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            found = checkpoints.find(ckpt_dir, cfg_hash, needed)
        newest = sealed[-1] if sealed else None
        if found != newest:
            c.bad(ckpt_dir, f"checkpoints.find chose {found}, the newest sealed one is {newest}")
        if found is not None:
            state = checkpoints.load(os.path.join(found, "trainer.pt"))
            if f"step_{state['step']:08d}" != os.path.basename(found):
                c.bad(found, f"trainer.pt holds step {state['step']}")
            if state["step"] > len(records):
                c.bad(found, f"covers step {state['step']} but metrics.jsonl holds "
                             f"{len(records)} records")
        pointer = os.path.join(ckpt_dir, checkpoints.POINTER)
        if os.path.exists(pointer):
            with open(pointer) as f:
                named = f.read().strip()
            if os.path.join(ckpt_dir, named) not in sealed:
                c.bad(pointer, f"names {named!r}, not a sealed checkpoint")
        if (final and ref is not None and newest is not None
                and os.path.basename(newest) != f"step_{ref.summary['steps']:08d}"):
            c.bad(ckpt_dir, f"the newest checkpoint is {os.path.basename(newest)}")
    return c


# -- figure outputs -----------------------------------------------------------------------
def check_figure(out: str, figure: str, ref_out: str | None, final: bool) -> Check:
    """Each CSV/PNG/MD/JSON output of a smoke figure complete or absent; its training runs
    checked as run directories against the uninterrupted figure's runs."""
    c = Check()
    fig_dir = os.path.join(out, figure)
    ref_dir = os.path.join(ref_out, figure) if ref_out else None
    if not os.path.isdir(fig_dir):
        if final:
            c.bad(fig_dir, "missing after the final run")
        return c
    outputs = [p for p in _files(fig_dir)
               if not os.path.relpath(p, fig_dir).startswith("runs" + os.sep)]
    for path in outputs:
        rel = os.path.relpath(path, fig_dir)
        c.files += 1
        if _TEMP.search(rel):
            c.temps.append(rel)
            continue
        ref_path = os.path.join(ref_dir, rel) if ref_dir else None
        why = _complete(path, ref_path)
        if why:
            c.bad(path, why)
    if final and ref_dir:
        for path in _files(ref_dir):
            rel = os.path.relpath(path, ref_dir)
            if not rel.startswith("runs" + os.sep) and not _TEMP.search(rel) and \
                    not os.path.exists(os.path.join(fig_dir, rel)):
                c.bad(os.path.join(fig_dir, rel), "missing after the final run")
    runs_root = os.path.join(fig_dir, "runs")
    for d, subdirs, names in os.walk(runs_root):
        if "config.yaml" in names or "metrics.jsonl" in names or "checkpoints" in subdirs:
            rel = os.path.relpath(d, runs_root)
            ref_run = _reference_of_run(os.path.join(ref_dir, "runs", rel)) if ref_dir else None
            c.merge(check_run(d, ref_run, ref_run.cfg_hash if ref_run else None,
                              final and ref_run is not None,
                              ref_run.needed if ref_run else CHECKPOINT_FILES))
            subdirs[:] = []
    return c


def _complete(path: str, ref_path: str | None) -> str | None:
    """Why `path` is not a complete output file (None: it is)."""
    with open(path, "rb") as f:
        data = f.read()
    ext = os.path.splitext(path)[1]
    if ext == ".png":
        if not data.startswith(b"\x89PNG\r\n\x1a\n") or not data.endswith(b"IEND\xaeB`\x82"):
            return "not a complete PNG (signature or IEND chunk missing)"
        try:
            from PIL import Image

            with Image.open(path) as im:
                im.verify()
        except ImportError:
            pass
        except Exception as exc:  # noqa: BLE001
            return f"PNG does not decode ({exc})"
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    ref_text = None
    if ref_path and os.path.exists(ref_path):
        with open(ref_path, encoding="utf-8") as f:
            ref_text = f.read()
    if ext == ".json":
        try:
            json.loads(text)
        except ValueError as exc:
            return f"not JSON ({exc})"
        return None
    if not text.endswith("\n"):
        return "does not end with a newline (cut short)"
    if ext == ".csv":
        rows = list(csv.reader(text.splitlines()))
        if not rows:
            return "empty CSV"
        if any(len(r) != len(rows[0]) for r in rows):
            return "a row has another number of fields than the header"
        if ref_text is not None:
            ref_rows = list(csv.reader(ref_text.splitlines()))
            if rows[0] != ref_rows[0] or len(rows) != len(ref_rows):
                return (f"{len(rows)} rows / header {rows[0][:3]}, the uninterrupted figure "
                        f"has {len(ref_rows)}")
        return None
    if ext == ".md" and ref_text is not None and \
            len(text.splitlines()) != len(ref_text.splitlines()):
        return (f"{len(text.splitlines())} lines, the uninterrupted figure's has "
                f"{len(ref_text.splitlines())}")
    return None


_REF_RUNS: dict[str, Reference | None] = {}


def _reference_of_run(run_dir: str) -> Reference | None:
    """A finished run of the uninterrupted figure, as a Reference."""
    if run_dir in _REF_RUNS:
        return _REF_RUNS[run_dir]
    from repro import checkpoints, runs

    ref = None
    if os.path.exists(os.path.join(run_dir, "DONE")):
        run = runs.load_run(run_dir)
        cfg_hash, needed = None, list(CHECKPOINT_FILES)
        ckpt = os.path.join(run_dir, "checkpoints")
        if os.path.isdir(ckpt):
            steps = sorted(d for d in os.listdir(ckpt) if d.startswith("step_"))
            if steps:
                with open(os.path.join(ckpt, steps[-1], checkpoints.MANIFEST)) as f:
                    manifest = json.load(f)
                cfg_hash, needed = manifest["config_hash"], sorted(manifest["files"])
        ref = Reference(config=run.config, metrics=[(r["step"], r.get("loss")) for r in run.metrics],
                        summary=run.summary or {}, cfg_hash=cfg_hash, seconds=0.0, changes=0,
                        writes={}, needed=needed)
    _REF_RUNS[run_dir] = ref
    return ref


# -- how files are written --------------------------------------------------------------
def classify_writes(audit: list, root: str) -> dict[str, str]:
    """For each file the command left under root: how it was written."""
    how: dict[str, set[str]] = {}
    for kind, path, dst in audit:
        if kind == "rename":
            how.setdefault(dst, set()).add("rename")
        elif kind == "open-append":
            how.setdefault(path, set()).add("append")
        elif kind == "open-write":
            how.setdefault(path, set()).add("write")
    out = {}
    for path, ways in how.items():
        if not os.path.exists(path) or _TEMP.search(path):
            continue
        rel = os.path.relpath(path, root)
        rel = re.sub(r"step_\d{8}", "step_N", rel)
        rel = re.sub(r"(runs/[^/]+/)[^/]+/", r"\1RUN/", rel)
        if "write" in ways:
            label = "rewritten in place (a kill mid-write leaves part of it)"
        elif "append" in ways:
            label = ("replaced through a temp file + rename, then appended line by line"
                     if "rename" in ways else "appended in place")
        else:
            label = "temp file + rename (atomic)"
        out[rel] = label
    return dict(sorted(out.items()))


# -- trials -------------------------------------------------------------------------------
@dataclass
class Trial:
    index: int
    kind: str  # "train", "figure", "concurrent" or "signal"
    subject: str  # compressor or figure id
    mode: str  # "timed" / "at-write"; concurrent: "race" / "wait"; signal: "SIGTERM" / ...
    kills: list[dict[str, Any]] = field(default_factory=list)
    files_checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    temps_after_kill: int = 0
    temps_after_rerun: list[str] = field(default_factory=list)
    rerun_ok: bool = False
    metrics_equal: bool | None = None
    error: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # concurrent and signal trials


def _train_spec(root: str, overrides: list[str], log: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "train", "overrides": [*overrides, f"runs_root={root}"], "watch": root,
            "log": log, **extra}


def _figure_spec(out: str, figure: str, log: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "figure", "figure": figure, "out": out, "watch": out, "log": log, **extra}


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-1500:]
    except OSError:
        return ""


def reference_train(work: str, compressor: str, args, ranks: bool = False,
                    steps: int | None = None) -> tuple[Reference, list[str], str]:
    from repro import checkpoints, launch, runs

    steps = steps or (args.ranks_steps if ranks else args.steps)
    overrides = [f"task={args.task}", f"steps={steps}",
                 f"seed={args.seed_run}", *TASK_OVERRIDES, *COMPRESSOR_OVERRIDES[compressor],
                 *(RANKS_OVERRIDES if ranks else [])]
    name = f"ref-{compressor}-{steps}" + ("-ranks" if ranks else "")
    root = os.path.join(work, name)
    audit = os.path.join(work, f"{name}.audit.json")
    log = os.path.join(work, f"{name}.log")
    spec = _train_spec(root, overrides, log, audit=audit)
    out = run_child(spec, args.launcher, None, timeout=600)
    if out.status != "exited" or out.code != 0:
        raise RuntimeError(f"the uninterrupted {compressor} run failed ({out}):\n{_tail(log)}")
    planned = launch.plan([*overrides, f"runs_root={root}"], multirun=False)[0]
    run = runs.load_run(planned.run_dir)
    cfg_hash = checkpoints.config_hash(planned.cfg)
    with open(os.path.join(planned.run_dir, "checkpoints", f"step_{steps:08d}",
                           checkpoints.MANIFEST)) as f:
        if json.load(f)["config_hash"] != cfg_hash:
            raise RuntimeError("config_hash of the planned config differs from the trainer's")
    with open(audit) as f:
        events = json.load(f)
    ref = Reference(config=run.config, metrics=[(r["step"], r.get("loss")) for r in run.metrics],
                    summary=run.summary or {}, cfg_hash=cfg_hash, seconds=out.seconds,
                    changes=len(events), writes=classify_writes(events, planned.run_dir),
                    events=[_label(e, planned.run_dir) for e in events],
                    needed=list(RANKS_CHECKPOINT_FILES if ranks else CHECKPOINT_FILES))
    return ref, overrides, os.path.relpath(planned.run_dir, root)


def _label(event: list, root: str) -> str:
    """An audit event as "kind file" with temp names and step numbers generalised."""
    kind, path, dst = event
    target = dst if kind == "rename" else path
    rel = os.path.relpath(target, root)
    rel = re.sub(r"step_\d{8}", "step_N", rel)
    rel = re.sub(r"\.[A-Za-z0-9_]{8}\.tmp$", ".XXXXXXXX.tmp", rel)
    rel = re.sub(r"(runs/[^/]+/)[^/]+/", r"\1RUN/", rel)
    return f"{kind} {rel}"


def reference_figure(work: str, figure: str, args) -> tuple[str, float, int, dict[str, str]]:
    out_dir = os.path.join(work, "ref-figure")
    audit = os.path.join(work, "ref-figure.audit.json")
    log = os.path.join(work, "ref-figure.log")
    outcome = run_child(_figure_spec(out_dir, figure, log, audit=audit), args.launcher, None,
                        timeout=900)
    if outcome.status != "exited" or outcome.code != 0:
        raise RuntimeError(f"the uninterrupted figure {figure} failed ({outcome}):\n{_tail(log)}")
    with open(audit) as f:
        events = json.load(f)
    return (out_dir, outcome.seconds, len(events), classify_writes(events, out_dir),
            [_label(e, out_dir) for e in events])


def one_trial(trial: Trial, rng: random.Random, work: str, args, ctx: dict[str, Any]) -> None:
    tdir = os.path.join(work, f"trial-{trial.index:04d}")
    os.makedirs(tdir)
    log = os.path.join(tdir, "child.log")
    if trial.kind == "train":
        ref, overrides, rel = ctx["train"][trial.subject]
        root = os.path.join(tdir, "runs")
        run_dir = os.path.join(root, rel)
        make = lambda **kw: _train_spec(root, overrides, log, **kw)
        check = lambda final: check_run(run_dir, ref, ref.cfg_hash, final)
        seconds, changes, events = ref.seconds, ref.changes, ref.events
    else:
        ref_out, seconds, changes, _, events = ctx["figure"]
        out = os.path.join(tdir, "out")
        make = lambda **kw: _figure_spec(out, trial.subject, log, **kw)
        check = lambda final: check_figure(out, trial.subject, ref_out, final)
    n_kills = 2 if rng.random() < 0.25 else 1
    for _ in range(n_kills):
        if trial.mode == "timed":
            delay = rng.uniform(0.0, 1.1 * seconds)
            outcome = run_child(make(), args.launcher, delay, timeout=20 * seconds + 120)
            event = None
        else:
            event = rng.randint(1, changes)
            outcome = run_child(make(kill_at=event), args.launcher, None,
                                timeout=20 * seconds + 120)
            delay = None
        after = check(final=False)
        # A first attempt makes the uninterrupted run's changes in the same order.
        target = events[event - 1] if event is not None and not trial.kills else None
        trial.kills.append({"status": outcome.status, "code": outcome.code,
                            "after_s": round(delay, 3) if delay is not None else None,
                            "at_change": event, "before": target,
                            "seconds": round(outcome.seconds, 3)})
        trial.files_checked += after.files
        trial.corrupt += [f"after kill {len(trial.kills)}: {x}" for x in after.corrupt]
        trial.temps_after_kill += len(after.temps)
        if outcome.status == "hung":
            trial.corrupt.append(f"attempt {len(trial.kills)} hung")
        elif outcome.status == "exited" and outcome.code != 0:
            trial.error = f"attempt exited with {outcome.code}: {_tail(log)}"
    final = run_child(make(), args.launcher, None, timeout=20 * seconds + 120)
    trial.rerun_ok = final.status == "exited" and final.code == 0
    if not trial.rerun_ok:
        trial.error = f"the final run ended {final.status} ({final.code}): {_tail(log)}"
    # After a failed final run only what a kill could break is checked (a failure is
    # counted as a failed rerun, its missing outputs are not counted as corrupt files).
    done = check(final=trial.rerun_ok)
    trial.files_checked += done.files
    trial.corrupt += [f"after the final run: {x}" for x in done.corrupt]
    trial.temps_after_rerun = done.temps
    if trial.kind == "train":
        trial.metrics_equal = trial.rerun_ok and not any("metrics.jsonl" in x for x in done.corrupt)
    if not args.keep:
        shutil.rmtree(tdir, ignore_errors=True)


def _launch_lines(log: str) -> list[str]:
    """What a `repro train` child printed (its log), line by line."""
    try:
        with open(log, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _trained(lines: list[str]) -> bool:
    return any(line.startswith(("[running]", "[restarting]")) for line in lines)


def concurrent_trial(trial: Trial, rng: random.Random, work: str, args,
                     ctx: dict[str, Any]) -> None:
    """Two launches of one run; the second after a random delay, with --wait in "wait"."""
    ref, overrides, rel = ctx["long"][trial.subject]
    tdir = os.path.join(work, f"trial-{trial.index:04d}")
    os.makedirs(tdir)
    root = os.path.join(tdir, "runs")
    run_dir = os.path.join(root, rel)
    logs = [os.path.join(tdir, "first.log"), os.path.join(tdir, "second.log")]
    specs = [{**_train_spec(root, overrides, log), "kind": "cli-train"} for log in logs]
    if trial.mode == "wait":
        specs[1]["flags"] = ["--wait"]
    delay = rng.uniform(0.0, 0.8 * ref.seconds)
    timeout = 20 * ref.seconds + 120
    first = start_child(specs[0], args.launcher)
    time.sleep(delay)
    second = start_child(specs[1], args.launcher)
    outcomes = [wait_child(first, None, timeout), wait_child(second, None, timeout)]
    lines = [_launch_lines(log) for log in logs]
    trained = [_trained(x) for x in lines]
    refused = [any(line.startswith("repro train: error:") and "is in use by process" in line
                   for line in x) for x in lines]
    waited = [any(line.startswith("waiting: ") for line in x) for x in lines]
    named = []
    for mine, other in ((lines[0], second.pid), (lines[1], first.pid)):
        holder = [line for line in mine if "in use by process" in line]
        if holder:
            named.append(f"process {other}@" in holder[0])
    trial.facts = {"delay_s": round(delay, 3), "codes": [o.code for o in outcomes],
                   "trained": trained, "refused": refused, "waited": waited,
                   "holder_named_right": all(named) if named else None}
    trial.kills.append({"status": "concurrent", "after_s": round(delay, 3)})
    if sum(trained) != 1:
        trial.corrupt.append(f"{sum(trained)} of the two launches trained the run")
    for o, was_refused, x in zip(outcomes, refused, lines):
        expected = 1 if was_refused else 0
        if o.status != "exited" or o.code != expected:
            trial.corrupt.append(f"a launch ended {o.status} ({o.code}), expected exit {expected}: "
                                 f"{x[-3:]}")
    if trial.mode == "wait" and any(refused):
        trial.corrupt.append("a launch with --wait was refused")
    if named and not all(named):
        trial.corrupt.append("a refused launch named another holder than the running launch")
    done = check_run(run_dir, ref, ref.cfg_hash, final=True)
    trial.files_checked += done.files
    trial.corrupt += [f"after both launches: {x}" for x in done.corrupt]
    trial.temps_after_rerun = done.temps
    trial.rerun_ok = not done.corrupt
    trial.metrics_equal = not any("metrics.jsonl" in x for x in done.corrupt)
    if not args.keep:
        shutil.rmtree(tdir, ignore_errors=True)


def signal_trial(trial: Trial, rng: random.Random, work: str, args, ctx: dict[str, Any]) -> None:
    """SIGTERM / SIGINT to the launcher alone at a random moment, then the same command."""
    ranks = trial.kind == "signal-ranks"
    ref, overrides, rel = ctx["ranks" if ranks else "long"][trial.subject]
    tdir = os.path.join(work, f"trial-{trial.index:04d}")
    os.makedirs(tdir)
    root = os.path.join(tdir, "runs")
    run_dir = os.path.join(root, rel)
    log = os.path.join(tdir, "child.log")
    spec = {**_train_spec(root, overrides, log), "kind": "cli-train"}
    signum = getattr(signal, trial.mode)
    delay = rng.uniform(0.0, 1.1 * ref.seconds)
    timeout = 20 * ref.seconds + 120
    launcher = start_child(spec, args.launcher)
    outcome = wait_child(launcher, delay, timeout, send=signum)
    lines = _launch_lines(log)
    last = lines[-1] if lines else ""
    match = _INTERRUPTED.match(last)
    left = _ranks_left(tdir)
    if left:  # a rank may take a moment to end after its launcher
        time.sleep(2.0)
        left = _ranks_left(tdir)
    facts: dict[str, Any] = {"after_s": round(delay, 3), "code": outcome.code, "last_line": last,
                             "ranks_left_running": left}
    trial.kills.append({"status": outcome.status, "code": outcome.code,
                        "after_s": round(delay, 3), "seconds": round(outcome.seconds, 3)})
    after = check_run(run_dir, ref, ref.cfg_hash, final=False, needed=ref.needed)
    trial.files_checked += after.files
    trial.corrupt += [f"after the signal: {x}" for x in after.corrupt]
    trial.temps_after_kill += len(after.temps)
    finished = os.path.exists(os.path.join(run_dir, "DONE"))
    checkpoint = None
    if left:
        trial.corrupt.append(f"{len(left)} rank(s) still running after the launcher ended")
    if outcome.status != "exited":
        trial.corrupt.append(f"the launcher ended {outcome.status} after the signal")
    elif last.startswith("repro train: interrupted at once") or (
            outcome.code == -signum and not lines):
        # the signal came before a run could take it (while the command was planning)
        facts["outcome"] = "stopped before the run started"
        if outcome.code not in (128 + signum, -signum):
            trial.corrupt.append(f"stopped at once but exited {outcome.code}")
        if finished:
            trial.corrupt.append("DONE after an interruption")
    elif outcome.code == 128 + signum and not _INTERRUPTED_EARLY.match(last) \
            and "after the run finished" not in last:
        facts["outcome"] = "interrupted"
        if not match:
            trial.corrupt.append(f"exit {outcome.code} but the last line is {last!r}")
        else:
            step, checkpoint = int(match.group(1)), int(match.group(2))
            facts["stopped_at"], facts["checkpoint"] = step, checkpoint
            from repro import checkpoints, runs

            ckpt = os.path.join(run_dir, "checkpoints", f"step_{checkpoint:08d}")
            try:
                checkpoints.check(ckpt, ref.cfg_hash, ref.needed)
            except checkpoints.BadCheckpoint as exc:
                trial.corrupt.append(f"the checkpoint the line names is not valid: {exc}")
            records, _ = runs.parse_metrics(os.path.join(run_dir, "metrics.jsonl"))
            if [r["step"] for r in records] != list(range(step)) or checkpoint != step:
                trial.corrupt.append(f"stopped at step {step}, checkpoint {checkpoint}, metrics "
                                     f"hold {len(records)} steps")
            if finished:
                trial.corrupt.append("DONE after an interruption")
    elif outcome.code == 128 + signum and last.startswith("repro train: interrupted after the "
                                                         "run finished"):
        facts["outcome"] = "finished as the signal came"
        if not finished:
            trial.corrupt.append(f"{last!r} but no DONE")
    elif outcome.code == 128 + signum and _INTERRUPTED_EARLY.match(last):
        # a rank the signal reached while it was starting (before it could take it)
        facts["outcome"] = "interrupted before the first checkpoint"
        if finished:
            trial.corrupt.append("DONE after an interruption")
    elif outcome.code == 0 and finished:
        facts["outcome"] = "finished before the signal"
    else:
        trial.corrupt.append(f"the launcher exited {outcome.code}; last line {last!r}")
    final = run_child(spec, args.launcher, None, timeout=timeout)
    trial.rerun_ok = final.status == "exited" and final.code == 0
    if not trial.rerun_ok:
        trial.error = f"the final run ended {final.status} ({final.code}): {_tail(log)}"
    done = check_run(run_dir, ref, ref.cfg_hash, final=trial.rerun_ok, needed=ref.needed)
    trial.files_checked += done.files
    trial.corrupt += [f"after the final run: {x}" for x in done.corrupt]
    trial.temps_after_rerun = done.temps
    trial.metrics_equal = trial.rerun_ok and not any("metrics.jsonl" in x for x in done.corrupt)
    if trial.rerun_ok and checkpoint is not None:
        from repro.logging import read_summary

        resumed = (read_summary(run_dir) or {}).get("resumed_from_step")
        facts["resumed_from_step"] = resumed
        if resumed != checkpoint:
            trial.corrupt.append(f"the same command resumed from {resumed}, not {checkpoint}")
    trial.facts = facts
    if not args.keep:
        shutil.rmtree(tdir, ignore_errors=True)


def _ranks_left(tdir: str) -> list[str]:
    """Processes of a trial under tdir still running (they carry its TAG in their
    environment: the launcher and every rank it started)."""
    tag = f"{TAG}={tdir}".encode()
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(v.startswith(tag) for v in f.read().split(b"\0")):
                    with open(f"/proc/{entry}/cmdline", "rb") as g:
                        left.append(g.read().replace(b"\0", b" ").decode(errors="replace")[:120])
        except OSError:
            continue
    return left


def preload(launcher: str) -> None:
    """Import what every child needs once, before forking (no torch work runs here)."""
    if launcher != "fork":
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
    import torch
    import torch._dynamo  # noqa: F401  (the optimisers import it on first use)

    import repro.cli
    import repro.figures
    import repro.launch
    import repro.train

    repro.cli.build_parser()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=160, help="training-run trials (default 160)")
    p.add_argument("--figure-trials", type=int, default=16, help="smoke-figure trials (default 16)")
    p.add_argument("--concurrent-trials", type=int, default=24,
                   help="two launches of one run: half without --wait, half with (default 24)")
    p.add_argument("--signal-trials", type=int, default=32,
                   help="SIGTERM / SIGINT (alternately) to the launcher of simulated workers "
                   "(default 32)")
    p.add_argument("--ranks-signal-trials", type=int, default=6,
                   help="SIGTERM / SIGINT to the launcher of 2 spawned gloo ranks (default 6)")
    p.add_argument("--ranks-steps", type=int, default=40,
                   help="steps of the spawned-ranks runs (their start-up takes seconds)")
    p.add_argument("--long-steps", type=int, default=30,
                   help="steps of the concurrent and signal trials' runs, long enough for "
                   "most signals and second launches to land while the run trains")
    p.add_argument("--figure", default="dragonn-fig7", help="figure of the figure trials")
    p.add_argument("--task", default="movielens_ncf", help="smoke task of the training trials")
    p.add_argument("--compressors", default="topk,dgc,powersgd",
                   help=f"trials rotate over these (from {', '.join(COMPRESSOR_OVERRIDES)})")
    p.add_argument("--steps", type=int, default=6, help="steps of each training run")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--seed-run", type=int, default=0, help="seed of the training runs")
    p.add_argument("--launcher", choices=("fork", "exec"), default="fork",
                   help="fork children from this process (default) or exec fresh interpreters")
    p.add_argument("--work", default=None, help="scratch folder (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep each trial's folder")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    os.environ.setdefault("WANDB_MODE", "disabled")
    compressors = [c for c in args.compressors.split(",") if c]
    for c in compressors:
        if c not in COMPRESSOR_OVERRIDES:
            p.error(f"--compressors: {c!r} is not one of {', '.join(COMPRESSOR_OVERRIDES)}")
    work = args.work or tempfile.mkdtemp(prefix="kill-trials-")
    os.makedirs(work, exist_ok=True)
    started = time.time()
    preload(args.launcher)
    rng = random.Random(args.seed)
    ctx: dict[str, Any] = {"train": {}}
    writes: dict[str, str] = {}
    ctx["long"] = {}
    for c in compressors if args.concurrent_trials or args.signal_trials else []:
        ctx["long"][c] = reference_train(work, c, args, steps=args.long_steps)
        print(f"reference {c}, {args.long_steps} steps: {ctx['long'][c][0].seconds:.1f} s",
              flush=True)
    for c in compressors if args.trials else []:
        ref, overrides, rel = reference_train(work, c, args)
        ctx["train"][c] = (ref, overrides, rel)
        writes.update({f"run: {k}": v for k, v in ref.writes.items()})
        print(f"reference {c}: {ref.seconds:.1f} s, {ref.changes} changes to the run folder, "
              f"{len(ref.metrics)} steps", flush=True)
    ctx["ranks"] = {}
    if args.ranks_signal_trials:
        c = compressors[0]
        ref, overrides, rel = reference_train(work, c, args, ranks=True)
        ctx["ranks"][c] = (ref, overrides, rel)
        print(f"reference {c} on 2 spawned ranks: {ref.seconds:.1f} s, {len(ref.metrics)} steps",
              flush=True)
    if args.figure_trials:
        ctx["figure"] = reference_figure(work, args.figure, args)
        writes.update({f"figure: {k}": v for k, v in ctx["figure"][3].items()})
        print(f"reference figure {args.figure}: {ctx['figure'][1]:.1f} s, "
              f"{ctx['figure'][2]} changes", flush=True)
    plan = [("train", compressors[i % len(compressors)], "timed" if i % 2 == 0 else "at-write")
            for i in range(args.trials)]
    plan += [("figure", args.figure, "timed" if i % 2 == 0 else "at-write")
             for i in range(args.figure_trials)]
    plan += [("concurrent", compressors[i % len(compressors)], "race" if i % 2 == 0 else "wait")
             for i in range(args.concurrent_trials)]
    plan += [("signal", compressors[i % len(compressors)], "SIGTERM" if i % 2 == 0 else "SIGINT")
             for i in range(args.signal_trials)]
    plan += [("signal-ranks", compressors[0], "SIGTERM" if i % 2 == 0 else "SIGINT")
             for i in range(args.ranks_signal_trials)]
    trials = []
    for i, (kind, subject, mode) in enumerate(plan):
        t = Trial(i, kind, subject, mode)
        try:
            if kind == "concurrent":
                concurrent_trial(t, rng, work, args, ctx)
            elif kind.startswith("signal"):
                signal_trial(t, rng, work, args, ctx)
            else:
                one_trial(t, rng, work, args, ctx)
        except Exception:  # noqa: BLE001 - a failed trial is reported, the rest go on
            t.error = traceback.format_exc()[-1500:]
        trials.append(t)
        flag = "ok" if not (t.corrupt or t.error) else "PROBLEM"
        facts = f" {t.facts}" if t.facts else ""
        print(f"trial {i:4d} {kind:6s} {subject:10s} {t.mode:8s} kills="
              f"{[k['status'] for k in t.kills]} files={t.files_checked} corrupt="
              f"{len(t.corrupt)} rerun={'ok' if t.rerun_ok else 'FAILED'} {flag}{facts}",
              flush=True)
        for x in t.corrupt[:5]:
            print(f"    {x}", flush=True)
        if t.error:
            print(f"    error: {t.error[-600:]}", flush=True)
    report = summarise(trials, args, writes, time.time() - started, ctx)
    text = json.dumps(report, indent=1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(json.dumps(report["totals"], indent=1))
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    totals = report["totals"]
    return 0 if (totals["corrupt_files"] == 0 and totals["failed_reruns"] == 0
                 and totals["problems_in_concurrent_and_signal_trials"] == 0) else 1


def summarise(trials: list[Trial], args, writes: dict[str, str], seconds: float,
              ctx: dict[str, Any]) -> dict[str, Any]:
    def block(ts: list[Trial]) -> dict[str, Any]:
        kills = [k for t in ts for k in t.kills]
        return {
            "trials": len(ts),
            "kills": len(kills),
            "killed_mid_run": sum(k["status"] == "killed" for k in kills),
            "finished_before_the_kill": sum(k["status"] == "exited" for k in kills),
            "files_checked": sum(t.files_checked for t in ts),
            "corrupt_files": sum(len(t.corrupt) for t in ts),
            "temp_files_left_by_kills": sum(t.temps_after_kill for t in ts),
            "temp_files_left_after_the_final_run": sum(len(t.temps_after_rerun) for t in ts),
            "failed_reruns": sum(not t.rerun_ok for t in ts),
            "metrics_equal_to_uninterrupted": sum(bool(t.metrics_equal) for t in ts
                                                  if t.kind == "train"),
        }

    def concurrent(ts: list[Trial]) -> dict[str, Any]:
        return {"trials": len(ts),
                "both_trained": sum(sum(t.facts.get("trained", [])) > 1 for t in ts),
                "one_trained": sum(sum(t.facts.get("trained", [])) == 1 for t in ts),
                "second_refused_naming_the_first": sum(
                    bool(t.facts.get("holder_named_right")) for t in ts),
                "second_waited": sum(any(t.facts.get("waited", [])) for t in ts),
                "corrupt_files": sum(len(t.corrupt) for t in ts),
                "files_checked": sum(t.files_checked for t in ts),
                "final_state_equal_to_uninterrupted": sum(bool(t.metrics_equal) and not t.corrupt
                                                          for t in ts)}

    def signalled(ts: list[Trial]) -> dict[str, Any]:
        outcomes = collections.Counter(t.facts.get("outcome", "unexpected") for t in ts)
        return {"trials": len(ts), "outcomes": dict(sorted(outcomes.items())),
                "interrupt_line_and_checkpoint_right": sum(
                    "checkpoint" in t.facts and not t.corrupt for t in ts),
                "resumed_from_the_named_checkpoint": sum(
                    t.facts.get("resumed_from_step") is not None
                    and t.facts.get("resumed_from_step") == t.facts.get("checkpoint") for t in ts),
                "ranks_left_running": sum(len(t.facts.get("ranks_left_running", [])) for t in ts),
                "done_without_a_finished_run": sum(any("DONE" in x for x in t.corrupt) for t in ts),
                "corrupt_files": sum(len(t.corrupt) for t in ts),
                "files_checked": sum(t.files_checked for t in ts),
                "failed_reruns": sum(not t.rerun_ok for t in ts),
                "metrics_equal_to_uninterrupted": sum(bool(t.metrics_equal) for t in ts)}

    groups: dict[str, Any] = {}
    for kind in ("train", "figure"):
        for mode in ("timed", "at-write"):
            ts = [t for t in trials if t.kind == kind and t.mode == mode]
            if ts:
                groups[f"{kind}/{mode}"] = block(ts)
    for mode in ("race", "wait"):
        ts = [t for t in trials if t.kind == "concurrent" and t.mode == mode]
        if ts:
            groups[f"concurrent/{mode}"] = concurrent(ts)
    for kind in ("signal", "signal-ranks"):
        for mode in ("SIGTERM", "SIGINT"):
            ts = [t for t in trials if t.kind == kind and t.mode == mode]
            if ts:
                groups[f"{kind}/{mode}"] = signalled(ts)
    kills = [t for t in trials if t.kind in ("train", "figure")]
    return {
        "command": "python benchmarks/reliability/kill_trials.py " + " ".join(sys.argv[1:]),
        "settings": {"task": args.task, "steps": args.steps, "long_steps": args.long_steps,
                     "ranks_steps": args.ranks_steps,
                     "compressors": args.compressors,
                     "figure": args.figure if args.figure_trials else None,
                     "launcher": args.launcher, "seed": args.seed,
                     "overrides": TASK_OVERRIDES},
        "reference_seconds": {c: round(v[0].seconds, 2) for c, v in ctx["train"].items()},
        "reference_seconds_long": {c: round(v[0].seconds, 2)
                                   for c, v in ctx.get("long", {}).items()},
        "reference_seconds_spawned_ranks": {c: round(v[0].seconds, 2)
                                            for c, v in ctx.get("ranks", {}).items()},
        "reference_changes": {c: v[0].changes for c, v in ctx["train"].items()},
        "wall_s": round(seconds, 1),
        "totals": {**block(kills),
                   "concurrent_trials": sum(t.kind == "concurrent" for t in trials),
                   "signal_trials": sum(t.kind.startswith("signal") for t in trials),
                   "problems_in_concurrent_and_signal_trials": sum(
                       bool(t.corrupt or t.error) for t in trials
                       if t.kind not in ("train", "figure"))},
        "by_kind_and_mode": groups,
        "how_files_are_written": writes,
        "at_write_kills_before": dict(sorted(collections.Counter(
            k["before"] for t in trials for k in t.kills if k.get("before")).items())),
        "problems": [{"trial": t.index, "kind": t.kind, "subject": t.subject, "mode": t.mode,
                      "corrupt": t.corrupt, "error": t.error, "facts": t.facts}
                     for t in trials if t.corrupt or t.error],
        "temp_files_after_the_final_run": sorted({x for t in trials for x in t.temps_after_rerun}),
    }


if __name__ == "__main__":
    sys.exit(main())
