"""Name → compressor class table, filled by the @register decorator (timm style)."""

from __future__ import annotations

import fnmatch
import inspect
from typing import Any, Callable, TypeVar

from compressors.base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}

C = TypeVar("C", bound=type[Compressor])


def register(name: str) -> Callable[[C], C]:
    """Register a Compressor subclass under `name`; a second class with the same name is
    refused (silently replacing an algorithm would make results lie)."""

    def deco(cls: C) -> C:
        if not (inspect.isclass(cls) and issubclass(cls, Compressor)):
            raise TypeError(f"@register({name!r}) decorates Compressor subclasses, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"compressor name {name!r} is already registered by "
                f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}; pick another name"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def list_compressors(pattern: str = "*") -> list[str]:
    """Registered names matching a shell-style wildcard, sorted."""
    return sorted(n for n in _REGISTRY if fnmatch.fnmatchcase(n, pattern))


def get_class(name: str) -> type[Compressor]:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = [n for n in _REGISTRY if n.startswith(name[:3])] or list_compressors()
        raise KeyError(
            f"unknown compressor {name!r}; registered: {', '.join(list_compressors())}"
            + (f" (did you mean {', '.join(close[:3])}?)" if close else "")
        ) from None


def build(name: str, **params: Any) -> Compressor:
    """Instantiate a registered compressor; unknown parameters name the accepted ones."""
    cls = get_class(name)
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in sig.parameters if p != "self"]
    unknown = [p for p in params if p not in accepted]
    if unknown:
        raise TypeError(
            f"compressor {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"it accepts: {', '.join(accepted) or '(none)'}"
        )
    return cls(**params)


def default_params(name: str) -> dict[str, Any]:
    """The constructor defaults of a registered compressor (the papers' values)."""
    sig = inspect.signature(get_class(name).__init__)
    return {
        p.name: p.default
        for p in sig.parameters.values()
        if p.name != "self" and p.default is not inspect.Parameter.empty
    }
