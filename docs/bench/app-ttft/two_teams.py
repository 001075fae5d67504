"""The effect behind kvchat/tui/flows/runner.py's model thread, in a few lines: a large
elementwise product on two OpenMP threads, first from threads that never overlap, then
from a thread started after the main thread has run parallel work of its own (two teams
alive: PyTorch's OpenMP runtime stops its helpers spinning between regions).

    python docs/bench/app-ttft/two_teams.py
"""

from __future__ import annotations

import threading
import time

import torch


def product(tag: str) -> None:
    x, y = torch.randn(512, 1536).bfloat16(), torch.randn(512, 1536).bfloat16()
    for _ in range(50):
        x * y
    start = time.perf_counter()
    for _ in range(2000):
        x * y
    print(f"{tag}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} µs a product", flush=True)


def in_thread(tag: str) -> None:
    thread = threading.Thread(target=product, args=(tag,))
    thread.start()
    thread.join()


in_thread("thread A (no other team)")
in_thread("thread B (A has ended)")
product("main thread")
in_thread("thread C (the main thread's team is alive)")
