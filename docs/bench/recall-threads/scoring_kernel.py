"""The key index's scoring of one decode step (3 KV heads, 3 query heads each, 32 channels
in 4 bits) on one thread and on two, µs per call, warm, at 1k-7k cold rows:

    .venv/bin/python docs/bench/recall-threads/scoring_kernel.py
"""
import time, torch
from kvchat.keyindex import PackedKeyIndex
from kvchat.threads import threads
def us(f, n=2000):
    for _ in range(100): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return round((time.perf_counter()-t)/n*1e6, 1)
for rows in (1024, 2048, 3072, 4096, 7168):
    idx = PackedKeyIndex(3, 64, torch.device("cpu"), torch.arange(32))
    idx.append(torch.randn(3, rows, 64), torch.arange(rows))
    q = torch.randn(3, 3, 64, dtype=torch.bfloat16)
    r = {}
    for t in (1, 2):
        with threads(t):
            r[t] = us(lambda: idx.scores(q))
    print(rows, r)
