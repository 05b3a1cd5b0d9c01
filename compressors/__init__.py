"""gradcomp-repro's compressor library: published gradient compressors behind one API.

    import compressors
    compressors.list_compressors("sidco*")          # ['sidco_e', 'sidco_gp', 'sidco_p']
    c = compressors.build("topk", ratio=0.01)

Every module of this package that does not start with "_" is imported on first use and
registers its compressors with @register; nothing here imports torch.distributed, Hydra,
W&B, torchvision or transformers.
"""

from __future__ import annotations

import importlib
import pkgutil

from compressors.base import (
    Compressor,
    Context,
    DenseSent,
    Outcome,
    Pattern,
    Segment,
    Selected,
    Sent,
    Sparsifier,
    SparseSent,
    flatten_named,
    unflatten,
)
from compressors.feedback import ErrorFeedback, MomentumCorrection, NoFeedback, Residual, make_feedback
from compressors.registry import default_params as _default_params
from compressors.registry import get_class as _get_class
from compressors.registry import register
from compressors.registry import build as _build
from compressors.registry import list_compressors as _list
from compressors.requests import AllGather, AllReduce, Broadcast
from compressors.session import Session
from compressors.simulated import SimulatedGroup, drive

_INFRASTRUCTURE = {"base", "batched", "feedback", "integer_sum", "kernels", "multiplex", "registry", "requests",
                   "session", "simulated"}
_loaded = False


def _load_all() -> None:
    """Import every algorithm module once, so each registers itself."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.name in _INFRASTRUCTURE:
            continue
        importlib.import_module(f"{__name__}.{mod.name}")


def list_compressors(pattern: str = "*") -> list[str]:
    """Registered compressor names matching a shell-style wildcard, sorted."""
    _load_all()
    return _list(pattern)


def build(name: str, **params) -> Compressor:
    """Instantiate compressor `name` with the paper's defaults overridden by `params`."""
    _load_all()
    return _build(name, **params)


def get_class(name: str) -> type[Compressor]:
    """The registered class of `name` (KeyError listing the known names otherwise)."""
    _load_all()
    return _get_class(name)


def default_params(name: str) -> dict:
    """Constructor defaults of compressor `name`: the papers' values."""
    _load_all()
    return _default_params(name)


__all__ = [
    "AllGather", "AllReduce", "Broadcast", "Compressor", "Context", "DenseSent",
    "ErrorFeedback", "MomentumCorrection", "NoFeedback", "Outcome", "Pattern", "Residual",
    "Segment", "Selected", "Sent", "Session", "SimulatedGroup", "SparseSent", "Sparsifier", "build",
    "default_params", "drive", "flatten_named", "unflatten", "get_class", "list_compressors", "make_feedback", "register",
]
