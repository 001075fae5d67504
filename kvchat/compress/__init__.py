"""Compressors, one file per method, registered by name.

Adding a method is one new file here (a `Compressor` subclass decorated with
`@register`) plus its test file; `METHOD_MODULES` lists the files to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvchat.compress.base import Compressor, LayerSpec
    from kvchat.kv_types import Entries, StateDict

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
    return [m for m in METHOD_MODULES if m in _REGISTRY] + sorted(set(_REGISTRY) - set(METHOD_MODULES))


def get(name: str) -> type[Compressor]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(available())}") from None


def make(name: str, spec: LayerSpec, budget: int, **params: Any) -> Compressor:
    return get(name)(spec, budget, **params)


def check_name(name: str) -> None:
    """Raise ValueError naming the choices unless `name` is a method. A built-in name is
    checked without importing the methods (and torch): the CLI checks `--method` before
    the app's first frame."""
    if name not in METHOD_MODULES and name not in _REGISTRY:
        get(name)


_INTERFACE = ("Compressor", "Entries", "LayerSpec", "StateDict")


def __getattr__(name: str) -> Any:
    # The interface types need torch; they load on first use (PEP 562), so that the
    # registry's names can be read without it.
    if name in _INTERFACE:
        from kvchat.compress import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Compressor", "Entries", "LayerSpec", "StateDict", "available", "check_name", "get", "make", "register"]
