"""Warm microbenchmark behind kvchat/layer.py `_attend_decode`: one decode query (9 heads,
GQA 3) against 4 sinks + 1,024 window entries (bf16), as two segments merged by
log-sum-exp, as one segment made by concatenating, and as one segment already joined.

    .venv/bin/python docs/bench/speed-session12/one_call.py

Session 12, quiet dev box (µs per call): 1 thread: two 235.6, one_cat 211.1, one 181.6,
window only 160.6; 2 threads: two 195.5, one_cat 220.1, one 123.7, window only 120.2."""

import time

import torch

from kvchat.attention import fused_segment_attention

H, D, SCALE = 3, 64, 0.125


def per_call_us(call, repeats: int = 2000) -> float:
    for _ in range(100):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


for threads in (1, 2):
    torch.set_num_threads(threads)
    query = torch.randn(9, 1, D, dtype=torch.bfloat16)
    sink_k, sink_v = torch.randn(H, 4, D, dtype=torch.bfloat16), torch.randn(H, 4, D, dtype=torch.bfloat16)
    win_k, win_v = torch.randn(H, 1024, D, dtype=torch.bfloat16), torch.randn(H, 1024, D, dtype=torch.bfloat16)
    joined_k, joined_v = torch.cat([win_k, sink_k], 1), torch.cat([win_v, sink_v], 1)
    calls = {
        "two": lambda: fused_segment_attention(query, [(sink_k, sink_v, None, None), (win_k, win_v, None, None)], SCALE),
        "one_cat": lambda: fused_segment_attention(
            query, [(torch.cat([win_k, sink_k], 1), torch.cat([win_v, sink_v], 1), None, None)], SCALE),
        "one": lambda: fused_segment_attention(query, [(joined_k, joined_v, None, None)], SCALE),
        "window only": lambda: fused_segment_attention(query, [(win_k, win_v, None, None)], SCALE),
    }
    print(threads, "largest difference, two vs one:", (calls["two"]() - calls["one"]()).abs().max().item())
    for name, call in calls.items():
        print(threads, name, round(per_call_us(call), 1), "us")
