"""Compressors, one file per method, registered by name.

Adding a method is one new file here (a `Compressor` subclass decorated with
`@register`) plus its test file; `METHOD_MODULES` lists the files to import.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Compressor, Entries, LayerSpec, StateDict

_REGISTRY: dict[str, type[Compressor]] = {}

# Order is the order of the method picker and of `ctrl+t` cycling.
METHOD_MODULES = ["full", "window", "h2o", "subgen", "balancekv", "bumblebee", "chelsea"]


def register(cls: type[Compressor]) -> type[Compressor]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for module in METHOD_MODULES:
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as err:
            # A method file that does not exist yet is simply not offered.
            if err.name != f"{__name__}.{module}":
                raise


def available() -> list[str]:
    _load_all()
    return [m for m in METHOD_MODULES if m in _REGISTRY] + sorted(
        set(_REGISTRY) - set(METHOD_MODULES)
    )


def get(name: str) -> type[Compressor]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(available())}") from None


def make(name: str, spec: LayerSpec, budget: int, **params: Any) -> Compressor:
    return get(name)(spec, budget, **params)


__all__ = ["Compressor", "Entries", "LayerSpec", "StateDict", "available", "get", "make", "register"]
