"""Runtime facts of this machine: how many intra-op threads to use, whether the CPU runs
bfloat16 natively, and handing freed memory back to the system.

**Threads.** On a busy machine PyTorch's default (one thread per core) is the worst choice: a
decode step is a few hundred tiny ops, each ending in a barrier, and one thread that
the scheduler has parked on a core another process is using stalls every barrier
(measured on the 2-core box: about 1 tok/s with 2 threads against 11-14 with 1, under
one competing CPU-bound process). So kvchat counts the cores it may run on (affinity),
subtracts what other processes keep busy (system CPU time, including time stolen by a
hypervisor, minus our own), and uses the rest, at least one. The engine asks again
between turns and every few dozen decode steps, so a competitor that appears in the
middle of an answer costs a few steps, not the answer. `--threads N` (or OMP_NUM_THREADS)
fixes the count.

**Freed memory.** A document's prefill allocates hundreds of megabytes for a few seconds (the exact cache
before it is compressed, the layers' activations, the attention tiles) and frees them.
glibc keeps most freed blocks in its heaps for reuse rather than returning the pages, so
the process memory the status bar shows would stay high after the answer: on a 2-core
EPYC a 5.2k-token document's turn leaves the process at 831 MB, of which `malloc_trim(0)`
gives back 130 MB in 9.5 ms (0.8-3 ms after a short turn). The engine calls `release_free_heap`
after each turn, method switch and rebuild, once the answer is complete, never between the
prompt and the first token.

Elsewhere (macOS, Windows, musl) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import psutil
import torch

# How long to watch the machine before the first choice, and the shortest span over
# which a later reading is trusted.
FIRST_SAMPLE_S = 0.1
MIN_SPAN_S = 0.25
# A core counts as free when others use less than this share of it.
FREE_BELOW = 0.6


def allowed_cores() -> int:
    """Cores this process may run on (CPU affinity), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy, stolen time included."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _own_seconds() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


class ThreadGovernor:
    """Chooses and applies the intra-op thread count; `fixed` overrides it."""

    def __init__(self, fixed: int | None = None) -> None:
        if fixed is None and os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
            fixed = int(os.environ["OMP_NUM_THREADS"])  # the user (or the test command) chose
        if fixed is not None and fixed < 1:
            raise ValueError("--threads must be at least 1")
        self.fixed = fixed
        self.cores = allowed_cores()
        self.threads = 0
        self._mark: tuple[float, float, float] | None = None
        self.others_busy = 0.0  # cores' worth of CPU other processes used in the last span

    def _reading(self) -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(), _own_seconds()

    def _apply(self, threads: int) -> int:
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def choose(self, others_busy: float) -> int:
        """Threads for a machine where other processes use `others_busy` cores."""
        free = self.cores - others_busy
        return max(1, min(self.cores, math.floor(free + (1 - FREE_BELOW))))

    def start(self) -> int:
        """Pick the first count (watches the machine for FIRST_SAMPLE_S) and apply it."""
        if self.fixed is not None:
            return self._apply(self.fixed)
        self._mark = self._reading()
        time.sleep(FIRST_SAMPLE_S)
        return self.adjust(force=True)

    def adjust(self, force: bool = False) -> int:
        """Re-read the machine since the last reading and apply the count it gives.
        Cheap (two /proc reads); does nothing until MIN_SPAN_S has passed."""
        if self.fixed is not None:
            return self._apply(self.fixed)
        now = self._reading()
        if self._mark is None:
            self._mark = now
            return self._apply(self.threads or self.cores)
        span = now[0] - self._mark[0]
        if span < MIN_SPAN_S and not force:
            return self.threads
        if span > 0:
            others = ((now[1] - self._mark[1]) - (now[2] - self._mark[2])) / span
            self.others_busy = max(0.0, others)
        self._mark = now
        return self._apply(self.choose(self.others_busy))


# Compressor work of decode runs on the calling thread only. During decode a compressor
# ingests one small batch per layer (64 tokens) and observes one step's attention: chains
# of small tensor operations. With more than one thread each enters an OpenMP region, and
# with the cores shared those regions stall: on a 2-core EPYC under load, BalanceKV's
# ingest of a 64-token batch at 8k took a median 19 ms on 2 threads against 3.5 ms on one,
# Chelsea's 17.7 ms against 3.1 ms. A prefill's flush (thousands of tokens, large
# products) keeps the engine's count. The cache applies this to every method
# (`CompressedLayer.evict` and `_observe`).
SMALL_INGEST = 512


def one_thread() -> AbstractContextManager[int]:
    """torch runs on one thread inside the block, and gets its count back after (switching
    costs well under a microsecond). Yields the count it replaced (`threads` brings it
    back for one large op inside)."""
    return threads(1)


@contextmanager
def threads(count: int) -> Iterator[int]:
    """torch runs on `count` threads inside the block, and gets its count back after.
    Yields the count it replaced."""
    previous = torch.get_num_threads()
    if previous == count:
        yield previous
        return
    torch.set_num_threads(count)
    try:
        yield previous
    finally:
        torch.set_num_threads(previous)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bfloat16 natively (AVX512-BF16 or AMX), so bf16 products are
    fast rather than emulated."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def int4_available() -> bool:
    """Whether this PyTorch build has the CPU int4 weight-pack matmul."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 8)
        torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.zeros(1, 64, dtype=torch.bfloat16),
            packed,
            32,
            torch.ones(2, 16, 2, dtype=torch.bfloat16),
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def process_memory() -> tuple[int, int]:
    """(process RSS bytes, CUDA bytes allocated by this process)."""
    rss = psutil.Process(os.getpid()).memory_info().rss
    cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    return rss, cuda


# -- freed memory ----------------------------------------------------------------------
@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system (every arena's). True when something
    was returned, False when nothing was or this C library cannot."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
