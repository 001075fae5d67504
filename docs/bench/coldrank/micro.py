"""One layer's ranking of the recall tier, in the int4 kernel's layout (`PackedKeyIndex`:
the kernel's scores, the bias, `top_rows`) against kvchat's own kernel (`NativeKeyIndex.top`:
one call), on 1 thread, for 3 KV heads of real size (64 channels, the slow 32 ranked), M
query rows per KV head (a decode step: 3, a GQA group; a prefill chunk: 12) and 1k-8k
cold rows of random keys; a row bias with every tenth row blocked. Also how many of the
32 rows the two choose alike (they quantise the query differently: bf16 against int8).
Since session 18 also kvchat's kernel on its AVX2 path (`kvchat.native.FORCE_PATH`, the
path of a CPU without AVX512-VNNI; it chooses the same rows as the VNNI path).

    python docs/bench/coldrank/micro.py
"""

from __future__ import annotations

import time

import torch

from kvchat import native
from kvchat.keyindex import NativeKeyIndex, PackedKeyIndex

HEADS, HEAD_DIM, K = 3, 64, 32
CHANNELS = torch.cat([torch.arange(16), torch.arange(16) + 32])


def per_call_us(fn, calls: int = 400) -> float:
    for _ in range(40):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with torch.inference_mode():
        for rows in (1024, 2048, 4096, 8192):
            keys = torch.randn(HEADS, rows, HEAD_DIM, dtype=torch.bfloat16)
            packed = PackedKeyIndex(HEADS, HEAD_DIM, torch.device("cpu"), CHANNELS)
            own = NativeKeyIndex(HEADS, HEAD_DIM, torch.device("cpu"), CHANNELS)
            for index in (packed, own):
                index.append(keys, torch.arange(rows))
            bias = torch.zeros(HEADS, max(packed.capacity, own.capacity))
            bias[:, ::10] = -float("inf")
            for m in (3, 12):
                query = torch.randn(HEADS, m, HEAD_DIM, dtype=torch.bfloat16)
                old = packed.top(query, K, bias)
                new = own.top(query, K, bias)
                alike = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(old, new)) / HEADS
                t_old = per_call_us(lambda: packed.top(query, K, bias))
                t_new = per_call_us(lambda: own.top(query, K, bias))
                native.FORCE_PATH = "avx2"
                t_avx2 = per_call_us(lambda: own.top(query, K, bias))
                same = torch.equal(own.top(query, K, bias).sort(1).values, new.sort(1).values)
                native.FORCE_PATH = None
                print(f"{rows:5d} rows, M = {m:2d}: packed + top_rows {t_old:6.1f} µs, native {t_new:5.1f} µs "
                      f"({t_old / t_new:4.1f}x), native AVX2 {t_avx2:5.1f} µs ({t_old / t_avx2:4.1f}x, the same "
                      f"rows: {same}); {alike:.1f} of {K} rows alike")


if __name__ == "__main__":
    main()
