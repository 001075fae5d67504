"""Compressor work on the calling thread only.

A compressor's ingest and observe are chains of small tensor operations. With the
engine's thread count above one, each of them enters an OpenMP region, and with the
cores shared those regions stall: under load, BalanceKV's ingest at 8k took a median
19 ms on 2 threads against 3.5 ms on one (docs/BENCHMARKS.md, session 4). The model's
large matrix products keep the engine's count; the compressors run single-threaded
and give it back when they return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def one_thread() -> Iterator[None]:
    """torch runs on one thread inside the block (about a microsecond to switch)."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def single_threaded(method: F) -> F:
    """Decorate a compressor method so that it runs inside `one_thread`."""

    @wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_thread():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
