"""Paper figures as one command each (`repro figure ID`, `scripts/repro_figure.sh ID`).

Each paper has one module here (sidco, dragonn, deft, thc) whose functions register
themselves with `@figure(...)` (see repro/figures/base.py for the pipeline). They share
helpers only through base.py and common.py, never by importing one another. Importing this
package imports those modules; none of them runs anything at import time.
"""

from __future__ import annotations

import importlib
import pkgutil

from repro.figures.base import (
    CAUSES,
    RULES,
    SIZES,
    VERDICTS,
    Context,
    Figure,
    Row,
    figure,
    get,
    judge,
    publish,
    read_status,
    registered,
    results_readme,
    run_figure,
    run_figures,
    verdict,
    write_results_readme,
)

# The default set of `scripts/repro_figure.sh` with no argument: one or more figures per
# paper, chosen from the full variants' measured run times (each figure's recorded time is
# in its published status.json; `repro figure --list` adds them up).
DEFAULT_SET: tuple[str, ...] = (
    "sidco-fig16", "dragonn-fig5a", "dragonn-fig5b", "dragonn-lemmaA10", "dragonn-fig1b",
    "deft-fig9", "thc-fig2b", "thc-fig10",
    "deft-fig1", "sidco-fig1", "dragonn-fig7", "sidco-fig9", "thc-fig4",
)

# The modules of this package that hold no figures: what the paper modules share.
SHARED_MODULES = ("base", "common")

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
