"""Compression quality of registered compressors on simulated workers (`repro measure`).

Several compressors run side by side on the SAME per-step gradients (one
SimulatedGroup each, with its own error feedback), so a run compares them directly,
as THC's Fig. 2b does (Top-k 10%, TernGrad and THC on identical gradients). Per
compressor it reports:

| field                        | meaning                                                       |
|------------------------------|---------------------------------------------------------------|
| k_ratio_mean / _p5 / _p95    | estimation quality k̂/k over workers and steps (SIDCo's metric);|
|                              | None when the compressor reports no target k                  |
| density_mean                 | actual density of the aggregated update, |∪ indices| / d      |
|                              | (DEFT's gradient build-up); nonzeros of the aggregate / d     |
|                              | when the protocol does not report the union                   |
| nmse_mean                    | ||aggregate − mean||² / ||mean||², mean = exact average of the |
|                              | workers' raw gradients of that step (THC's NMSE)              |
| ef_norm_rel_final / _mean    | ||residual|| / ||grad||, averaged over workers, at the last    |
|                              | step / over all steps; None without error feedback            |
| bytes_per_worker             | payload one worker contributes per step (from the requests)   |
| bytes_fraction               | the same over dense fp32 bytes (4·d)                          |
| wire_bytes_per_worker        | bytes each worker's link carries per step with ring collectives|
|                              | at this worker count (an allgather: (K−1)× the payload; an    |
|                              | allreduce: 2(K−1)/K×): what compares allgather- and allreduce-|
|                              | based compressors beyond 2 workers                            |
| encode_ms / decode_ms        | median over workers and steps of the compute before the first |
|                              | request / after the last answer                               |

Every result also names its gradients: `source`, and `zeros`, the fraction of each
synthetic gradient's coordinates that are exact zeros at fixed positions (`--zeros F`,
repro.sources.zero_positions; 0 by default): the regime of embedding and sparse-feature
gradients, where k̂/k shows whether a threshold fit leaves the zeros out.

Everything is validated before any gradient is drawn, so a typo fails in a second.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import compressors
from compressors import SimulatedGroup
from compressors.base import check_ratio
from compressors.session import validate_gradient
from repro import sources
from repro.costmodel import wire_bytes_per_worker

# The default comparison: exact Top-k, the shared-seed Random-k baseline, the sampled
# threshold of DGC, SIDCo's exponential fit and DRAGONN's hashed memory. Names that are
# not registered are left out.
DEFAULT_COMPRESSORS = ("topk", "randomk", "dgc", "sidco_e", "dragonn")
DEFAULT_RATIO = 0.01
DEFAULT_WORKERS = 4
DEFAULT_SIZE = 2**18
DEFAULT_STEPS = 10
DEFAULT_SOURCE = "laplace"
FEEDBACKS = ("default", "none", "residual", "momentum")
GRAD_NAME = "grad"


def parse_value(text: str) -> Any:
    """A --param value: bool (true/false), None (none), int, float, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_params(items: Sequence[str] | None) -> dict[str, Any]:
    """['key=value', ...] → {key: parsed value}; a missing '=' or key is an error."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--param {item!r} must look like key=value "
                             "(for example sample_ratio=0.01)")
        out[key] = parse_value(value.strip())
    return out


def split_names(items: Sequence[str] | str | None) -> list[str]:
    """Repeated and/or comma-separated names, in order, without duplicates."""
    if items is None:
        return []
    if isinstance(items, str):
        items = [items]
    names: list[str] = []
    for item in items:
        for name in item.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return names


def default_compressors() -> list[str]:
    registered = set(compressors.list_compressors())
    return [n for n in DEFAULT_COMPRESSORS if n in registered]


def accepted_params(name: str) -> tuple[set[str], bool]:
    """Constructor parameters of a registered compressor, and whether it takes **kwargs."""
    sig = inspect.signature(compressors.get_class(name).__init__)
    names = {p.name for p in sig.parameters.values()
             if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def compressor_kwargs(names: Sequence[str], ratio: float | None,
                      params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per compressor: `ratio` where it takes one, and each --param it accepts.
    A parameter no selected compressor accepts is an error (a typo must not pass)."""
    accepted = {n: accepted_params(n) for n in names}
    for key in params:
        if not any(key in acc or var_kw for acc, var_kw in accepted.values()):
            listing = "; ".join(f"{n}: {', '.join(sorted(acc)) or '(none)'}"
                                for n, (acc, _) in accepted.items())
            raise ValueError(f"--param {key}: none of the selected compressors accepts "
                             f"{key!r}; their parameters are {listing}")
    out: dict[str, dict[str, Any]] = {}
    for n, (acc, var_kw) in accepted.items():
        kw: dict[str, Any] = {}
        if ratio is not None and "ratio" in acc:
            kw["ratio"] = ratio
        kw.update({k: v for k, v in params.items() if k in acc or var_kw})
        out[n] = kw
    return out


def check_source(source: str) -> None:
    if source.startswith("file:"):
        path = source[5:]
        if not path:
            raise ValueError("source 'file:' needs a path, for example file:grads.pt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"gradient file {path!r} does not exist (source {source!r})")
        return
    if source not in sources.SYNTHETIC:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(sources.SYNTHETIC)} "
                         "or file:PATH (a saved tensor or list of per-worker tensors)")


def check_positive(**values: int) -> None:
    for what, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what} must be an integer ≥ 1, got {v!r}")
        if v < 1:
            raise ValueError(f"{what}={v} must be ≥ 1")


def check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device; "
                         "use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use cpu or cuda[:N]")
    return dev


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return repr(v)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _Tally:
    """Per-compressor accumulators over steps."""

    def __init__(self) -> None:
        self.k_ratio: list[float] = []
        self.density: list[float] = []
        self.nmse: list[float] = []
        self.ef: list[float] = []
        self.bytes: list[int] = []
        self.wire: list[float] = []
        self.encode: list[float] = []
        self.decode: list[float] = []
        self.rounds: list[int] = []


def _sq_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2)


def _load_grads(source: str, size: int, workers: int, seed: int, step: int,
                file_grads: list[torch.Tensor] | None, zeros: float = 0.0) -> list[torch.Tensor]:
    if file_grads is not None:
        return file_grads  # SimulatedGroup never modifies its inputs
    return sources.synthetic(source, size, workers, seed, step, zeros=zeros)


def measure(
    compressor_names: Sequence[str] | str | None = None,
    ratio: float | None = DEFAULT_RATIO,
    workers: int = DEFAULT_WORKERS,
    size: int = DEFAULT_SIZE,
    steps: int = DEFAULT_STEPS,
    source: str = DEFAULT_SOURCE,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
    feedback: str = "default",
    device: str = "cpu",
    zeros: float = 0.0,
) -> list[dict[str, Any]]:
    """Run each compressor for `steps` steps on `workers` simulated workers fed the same
    gradients; one result dict per compressor (fields: module docstring).

    ratio=None keeps each compressor's own default ratio; `params` go to every selected
    compressor that accepts them (at least one must). With a file:PATH source, `size`
    is the file's tensor size. `zeros` (0 ≤ F < 1, synthetic sources only): the fraction
    of every gradient's coordinates that are exact zeros, at positions fixed by `seed`.
    """
    names = split_names(compressor_names) or default_compressors()
    registered = compressors.list_compressors()
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise ValueError(f"unknown compressor {', '.join(map(repr, unknown))}; "
                         f"registered: {', '.join(registered)}")
    if ratio is not None:
        check_ratio(ratio, "--ratio")
    check_positive(workers=workers, size=size, steps=steps)
    check_source(source)
    zeros = sources.check_zeros(zeros, "--zeros")
    if zeros and source.startswith("file:"):
        raise ValueError(f"--zeros={zeros} applies to synthetic sources only; a file: source "
                         "is exchanged as saved")
    if feedback not in FEEDBACKS:
        raise ValueError(f"unknown feedback {feedback!r}; choose one of {', '.join(FEEDBACKS)}")
    dev = check_device(device)
    kwargs = compressor_kwargs(names, ratio, dict(params or {}))
    groups = {}
    for n in names:
        try:
            comp = compressors.build(n, **kwargs[n])
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"compressor {n!r}: {exc}") from None
        try:
            # Gradients are checked for NaN/Inf once below (file) or finite by
            # construction (synthetic): no per-step, per-worker scan needed.
            groups[n] = SimulatedGroup(comp, workers, feedback=feedback, seed=seed,
                                       check_finite=False)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"compressor {n!r} with feedback {feedback!r}: {exc}") from None
    file_grads = None
    if source.startswith("file:"):
        file_grads = [g.to(dev) for g in sources.load_file(source[5:], workers)]
        size = file_grads[0].numel()
        for r, g in enumerate(file_grads):
            validate_gradient(f"{source} (worker {r})", g)

    tallies = {n: _Tally() for n in names}
    for step in range(steps):
        grads = [g.to(dev)
                 for g in _load_grads(source, size, workers, seed, step, file_grads, zeros)]
        # The exact mean, summed in rank order as the simulated allreduce does, so a
        # lossless compressor scores exactly 0.
        mean = grads[0].clone()
        for g in grads[1:]:
            mean.add_(g)
        mean.div_(workers)
        mean_sq = _sq_norm(mean)
        grad_norms = [math.sqrt(_sq_norm(g)) for g in grads]
        for n in names:
            group, tally = groups[n], tallies[n]
            outs = group.step(grads, name=GRAD_NAME, step=step)
            agg = outs[0].aggregate
            for o in outs:
                if o.selected is not None and o.target:
                    tally.k_ratio.append(int(o.selected) / int(o.target))
                tally.bytes.append(o.bytes_sent)
                tally.wire.append(wire_bytes_per_worker(o.collectives, workers))
                tally.encode.append(o.encode_s)
                tally.decode.append(o.decode_s)
                tally.rounds.append(o.rounds)
            union = outs[0].union
            touched = int(union) if union is not None else int(torch.count_nonzero(agg))
            tally.density.append(touched / size)
            err = _sq_norm(agg.to(mean.dtype) - mean)
            tally.nmse.append(err / mean_sq if mean_sq > 0 else (0.0 if err == 0 else math.inf))
            rel = []
            for sess, gn in zip(group.sessions, grad_norms):
                res = sess.residual(GRAD_NAME)
                if res is not None and gn > 0:
                    rel.append(math.sqrt(_sq_norm(res)) / gn)
            if rel:
                tally.ef.append(float(np.mean(rel)))

    results = []
    for n in names:
        t, group = tallies[n], groups[n]
        kq = np.asarray(t.k_ratio, dtype=np.float64)
        mean_bytes = float(np.mean(t.bytes))
        results.append({
            "compressor": n,
            "params": {k: _jsonable(v) for k, v in group.compressor.params().items()},
            "feedback": group.sessions[0].feedback.name,
            "ratio": _jsonable(group.compressor.params().get("ratio")),
            "numel": size,
            "workers": workers,
            "steps": steps,
            "source": source,
            "zeros": zeros,
            "k_ratio_mean": float(kq.mean()) if kq.size else None,
            "k_ratio_p5": float(np.percentile(kq, 5)) if kq.size else None,
            "k_ratio_p95": float(np.percentile(kq, 95)) if kq.size else None,
            "density_mean": float(np.mean(t.density)),
            "nmse_mean": _finite_or_none(float(np.mean(t.nmse))),
            "ef_norm_rel_final": t.ef[-1] if len(t.ef) == steps else None,
            "ef_norm_rel_mean": float(np.mean(t.ef)) if len(t.ef) == steps else None,
            "bytes_per_worker": mean_bytes,
            "bytes_fraction": mean_bytes / (4.0 * size),
            "wire_bytes_per_worker": float(np.mean(t.wire)),
            "rounds": int(np.max(t.rounds)),
            "encode_ms": 1e3 * float(np.median(t.encode)),
            "decode_ms": 1e3 * float(np.median(t.decode)),
        })
    return results


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The results as an aligned text table, one row per compressor."""
    if not results:
        return "(no results)"
    r0 = results[0]
    header = (f"source {r0['source']}, d = {r0['numel']:,}, {r0['workers']} workers, "
              f"{r0['steps']} steps")
    if r0.get("zeros"):
        header += f", {r0['zeros']:g} of the coordinates exact zeros"
    cols = ["compressor", "ratio", "feedback", "k̂/k mean [p5, p95]", "density", "NMSE",
            "|e|/|g|", "bytes/worker", "of fp32", "wire/worker", "enc ms", "dec ms"]
    rows = []
    for r in results:
        if r["k_ratio_mean"] is None:
            kq = "-"
        else:
            kq = f"{r['k_ratio_mean']:.3f} [{r['k_ratio_p5']:.3f}, {r['k_ratio_p95']:.3f}]"
        rows.append([
            r["compressor"], _fmt(r["ratio"], "g"), r["feedback"], kq,
            f"{r['density_mean']:.4g}", _fmt(r["nmse_mean"], ".4g"),
            _fmt(r["ef_norm_rel_final"], ".3g"), f"{r['bytes_per_worker']:,.0f}",
            f"{r['bytes_fraction']:.4g}", f"{r['wire_bytes_per_worker']:,.0f}",
            f"{r['encode_ms']:.2f}", f"{r['decode_ms']:.2f}",
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [header, line(cols), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    out.append("k̂/k: selected/target over workers and steps; density: |union of indices|/d of "
               "the aggregate; NMSE vs the exact mean of raw gradients; |e|/|g|: error-feedback "
               "norm over gradient norm at the last step; bytes/worker: the payload a worker "
               "contributes, wire/worker: what its link carries with ring collectives at this "
               "worker count; times are medians per worker")
    return "\n".join(out)
