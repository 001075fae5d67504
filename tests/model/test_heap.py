"""Freed memory goes back to the system after the big passes (kvchat/runtime.py)."""

from __future__ import annotations

import ctypes
import ctypes.util

import psutil
import pytest

from kvchat.runtime import _malloc_trim, release_free_heap

BLOCK = 100 * 1024  # below glibc's mmap threshold: served from the heap, as a prefill's pieces are
BLOCKS = 1500  # ~150 MB


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.skipif(_malloc_trim() is None, reason="no malloc_trim in this C library (not glibc)")
def test_free_heap_pages_go_back_to_the_system() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # resident
    # Everything but the last block is freed: the heap's top stays in use, so free()
    # alone cannot shrink the heap, and the freed pages stay resident.
    for block in blocks[:-1]:
        libc.free(block)
    held = rss()
    try:
        assert release_free_heap()
        assert held - rss() > BLOCK * BLOCKS // 2
    finally:
        libc.free(blocks[-1])
