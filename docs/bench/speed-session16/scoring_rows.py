"""What ranking costs per query row: the CPU int4 kernel's scores of 7,000 cold rows of 3
KV heads (random keys, the index `kvchat.keyindex` builds) for M query rows per KV head,
on 1 and 2 threads, and the top-32 of the scores. A decode step ranks with M = 3 (a GQA
group's query heads); a prefill chunk with M = 3 x `CHUNK_QUERIES`.

    python docs/bench/speed-session16/scoring_rows.py
"""

from __future__ import annotations

import time

import torch

from kvchat.keyindex import key_index, top_rows

HEADS, HEAD_DIM, ROWS = 3, 64, 7000


def per_call_us(fn, calls: int = 300) -> float:
    for _ in range(30):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.manual_seed(0)
    with torch.inference_mode():
        index = key_index(HEADS, HEAD_DIM, torch.device("cpu"), None, True)
        index.append(torch.randn(HEADS, ROWS, HEAD_DIM, dtype=torch.bfloat16), torch.arange(ROWS))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (3, 6, 12, 24):
                query = torch.randn(HEADS, m, HEAD_DIM, dtype=torch.bfloat16)
                scores = index.rank_scores(query)
                print(f"{type(index).__name__}, {threads} thread(s), M = {m}: scores "
                      f"{per_call_us(lambda: index.rank_scores(query)):.1f} µs, top-32 "
                      f"{per_call_us(lambda: top_rows(scores, 32)):.1f} µs")


if __name__ == "__main__":
    main()
