"""The figures registered, and where their runs and published results go.

A figure is a function `produce(ctx) -> list[Row]` registered with `@figure(...)` under
a unique id, with its paper, kind, the paper's hardware and claim, and its run time per
size ("smoke", "full" and, for the extended set, "long"). `get` and `registered` look
figures up; `outputs_dir` and `published_root` say where a run writes and where its
published reference lives.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from repro.figures.verdicts import Row

SIZES = ("smoke", "full", "long")
REQUIRED_SIZES = ("smoke", "full")  # every figure has these; "long" only the extended set
KINDS = ("benchmark", "training", "analysis")
PAPERS = ("sidco", "dragonn", "deft", "thc")


# -- where things go ---------------------------------------------------------------------------


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent.parent


def default_results_root() -> Path:
    """The published reference outputs: results/ of the clone, or $GRADCOMP_RESULTS."""
    return Path(os.environ.get("GRADCOMP_RESULTS", repo_root() / "results"))


def default_outputs_root() -> Path:
    """Where a run writes: outputs/ of the clone (ignored by git), or $GRADCOMP_OUTPUTS."""
    return Path(os.environ.get("GRADCOMP_OUTPUTS", repo_root() / "outputs"))


def outputs_dir(figure_id: str, size: str, out_root: Path | str | None = None) -> Path:
    """The folder a run of `figure_id` writes to: <out_root>/<id>/ when a root is given,
    else outputs/<id>/ (full), outputs/smoke/<id>/ or outputs/long/<id>/."""
    if out_root is not None:
        return Path(out_root) / figure_id
    root = default_outputs_root()
    return (root if size == "full" else root / size) / figure_id


def published_root(root: Path | str | None, size: str) -> Path:
    """Where the published results of a size live: <root>/ for full (and smoke, which
    only reads the full ones), <root>/long/ for the extended set's long runs."""
    base = Path(root) if root is not None else default_results_root()
    return base / "long" if size == "long" else base


# -- the registry -----------------------------------------------------------------------------


@dataclass
class Figure:
    id: str
    paper: str
    title: str
    kind: str  # one of KINDS
    hardware: str  # what the paper ran it on
    expected: str  # the paper's claim, one sentence
    est_seconds: dict[str, float]  # run time on a 2-core CPU when nothing is recorded
    produce: Callable[..., list[Row]]  # produce(ctx: repro.figures.base.Context)
    experiment: str | None = None  # conf/experiment/<name>.yaml when it trains

    def __post_init__(self) -> None:
        if self.paper not in PAPERS:
            raise ValueError(f"figure {self.id!r}: paper {self.paper!r} not in {PAPERS}")
        if self.kind not in KINDS:
            raise ValueError(f"figure {self.id!r}: kind {self.kind!r} not in {KINDS}")
        missing = [s for s in REQUIRED_SIZES if s not in self.est_seconds]
        if missing:
            raise ValueError(f"figure {self.id!r}: est_seconds lacks {missing}")
        unknown = [s for s in self.est_seconds if s not in SIZES]
        if unknown:
            raise ValueError(f"figure {self.id!r}: est_seconds has unknown sizes {unknown}")

    @property
    def sizes(self) -> tuple[str, ...]:
        return tuple(s for s in SIZES if s in self.est_seconds)


_FIGURES: dict[str, Figure] = {}


def figure(*, id: str, paper: str, title: str, kind: str, hardware: str, expected: str,
           est_seconds: Mapping[str, float], experiment: str | None = None):
    """Register `produce(ctx) -> list[Row]` as figure `id` (duplicate ids are refused)."""

    def deco(fn: Callable[..., list[Row]]):
        if id in _FIGURES and _FIGURES[id].produce is not fn:
            raise ValueError(f"figure id {id!r} is already registered")
        _FIGURES[id] = Figure(id, paper, title, kind, hardware, expected, dict(est_seconds), fn,
                              experiment)
        return fn

    return deco


def registered(pattern: str = "*") -> list[str]:
    return sorted(n for n in _FIGURES if fnmatch.fnmatchcase(n, pattern))


def extended_set() -> list[str]:
    """The figures with a long variant (`repro figure --extended`)."""
    return [f for f in registered() if "long" in _FIGURES[f].est_seconds]


def get(figure_id: str) -> Figure:
    try:
        return _FIGURES[figure_id]
    except KeyError:
        raise KeyError(
            f"unknown figure {figure_id!r}; known figures: {', '.join(registered())} "
            "(`repro figure --list` shows them with their status)"
        ) from None


def check_size(fig: Figure, size: str) -> None:
    """Refuse a size the figure has no variant of, naming those it has."""
    if size not in fig.est_seconds:
        raise ValueError(
            f"figure {fig.id} has no {size} variant (it has: {', '.join(fig.sizes)}); "
            f"the figures with a long variant (the extended set): {', '.join(extended_set())}")
