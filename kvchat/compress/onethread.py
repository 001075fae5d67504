"""Compressor work of decode on the calling thread only.

During decode a compressor ingests one small batch per layer (64 tokens) and observes
one step's attention: chains of small tensor operations. With the engine's thread count
above one, each of them enters an OpenMP region, and with the cores shared those regions
stall: measured under load in session 4, BalanceKV's ingest of a 64-token batch at 8k
took a median 19 ms on 2 threads against 3.5 ms on one, and Chelsea's 17.7 ms against
3.1 ms. So small batches run single-threaded and give the engine its count back when they
return; a prefill's flush (thousands of tokens, large products) keeps the engine's count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])

# Largest ingest (tokens per head) that runs on one thread: decode's batches (the cache
# evicts 64 at a time) are far below it, a flushed document far above.
SMALL_INGEST = 512


@contextmanager
def one_thread() -> Iterator[None]:
    """torch runs on one thread inside the block (switching costs well under a microsecond)."""
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
    """Decorate a compressor method (`observe`) so that it runs inside `one_thread`."""

    @wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_thread():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def small_ingest_single_threaded(ingest: F) -> F:
    """Decorate `Compressor.ingest(keys, ...)`: batches of at most SMALL_INGEST tokens run
    inside `one_thread`, larger ones on the engine's threads."""

    @wraps(ingest)
    def wrapper(self: Any, keys: Tensor, *args: Any, **kwargs: Any) -> Any:
        if keys.shape[1] > SMALL_INGEST:
            return ingest(self, keys, *args, **kwargs)
        with one_thread():
            return ingest(self, keys, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
