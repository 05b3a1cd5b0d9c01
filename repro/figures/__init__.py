"""Paper figures as one command each (`repro figure ID`, `scripts/repro_figure.sh ID`).

Each paper has one module here (sidco, dragonn, deft, thc) whose functions register
themselves with `@figure(...)`. The shared modules hold what they build on: registry.py
(the figures and where their runs go), verdicts.py (the rule table every verdict comes
from), records.py (comparison files, status.json, publishing), machine.py (the machine
and its recorded run times), base.py (the context a figure runs in and the pipeline),
common.py (helpers of several papers' figures). Paper modules share helpers only through
these, never by importing one another. Importing this package imports the shared
modules; `load_all` imports the paper modules; none of them runs anything at import time.
"""

from __future__ import annotations

import importlib
import pkgutil

from repro.figures.base import Context, run_figure, run_figures
from repro.figures.records import publish, read_status, results_readme, write_results_readme
from repro.figures.registry import SIZES, Figure, figure, get, registered
from repro.figures.verdicts import CAUSES, RULES, VERDICTS, Row, judge, verdict

# The default set of `scripts/repro_figure.sh` with no argument: one or more figures per
# paper, chosen from the full variants' measured run times (each figure's recorded time is
# in its published status.json; `repro figure --list` adds them up).
DEFAULT_SET: tuple[str, ...] = (
    "sidco-fig16", "dragonn-fig5a", "dragonn-fig5b", "dragonn-lemmaA10", "dragonn-fig1b",
    "deft-fig9", "thc-fig2b", "thc-fig10",
    "deft-fig1", "sidco-fig1", "dragonn-fig7", "sidco-fig9", "thc-fig4",
)

# The modules of this package that hold no figures: what the paper modules share.
SHARED_MODULES = ("base", "common", "machine", "records", "registry", "verdicts")

_loaded = False


def load_all() -> None:
    """Import every paper module once, so its figures register."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.name in SHARED_MODULES:
            continue
        importlib.import_module(f"{__name__}.{mod.name}")


def list_figures(pattern: str = "*") -> list[str]:
    load_all()
    return registered(pattern)


__all__ = [
    "CAUSES", "DEFAULT_SET", "RULES", "SIZES", "VERDICTS", "Context", "Figure", "Row", "figure", "get",
    "judge", "list_figures", "load_all", "publish", "read_status", "registered",
    "results_readme", "run_figure", "run_figures", "verdict", "write_results_readme",
]
