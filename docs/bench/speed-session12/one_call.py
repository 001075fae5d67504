"""Warm microbenchmark behind kvchat/layer.py `_attend_decode`: one decode query (9 heads,
GQA 3) against 4 sinks + 1,024 window entries (bf16), as two segments merged by
log-sum-exp, as one segment made by concatenating, and as one segment already joined.

    .venv/bin/python docs/bench/speed-session12/one_call.py

Session 12, quiet dev box (µs per call): 1 thread: two 235.6, one_cat 211.1, one 181.6,
window only 160.6; 2 threads: two 195.5, one_cat 220.1, one 123.7, window only 120.2."""

import torch, time
from kvchat.attention import fused_segment_attention
for th in (1, 2):
    torch.set_num_threads(th)
    H, G, d = 3, 3, 64
    q = torch.randn(9, 1, d, dtype=torch.bfloat16)
    sk, sv = torch.randn(H, 4, d, dtype=torch.bfloat16), torch.randn(H, 4, d, dtype=torch.bfloat16)
    wk, wv = torch.randn(H, 1024, d, dtype=torch.bfloat16), torch.randn(H, 1024, d, dtype=torch.bfloat16)
    allk, allv = torch.cat([sk, wk], 1), torch.cat([sv, wv], 1)
    two = lambda: fused_segment_attention(q, [(sk, sv, None, None), (wk, wv, None, None)], 0.125)
    one_cat = lambda: fused_segment_attention(q, [(torch.cat([sk, wk], 1), torch.cat([sv, wv], 1), None, None)], 0.125)
    one = lambda: fused_segment_attention(q, [(allk, allv, None, None)], 0.125)
    win = lambda: fused_segment_attention(q, [(wk, wv, None, None)], 0.125)
    print(th, (two() - one()).abs().max().item())
    for name, f in (("two", two), ("one_cat", one_cat), ("one", one), ("window only", win)):
        for _ in range(100): f()
        t = time.perf_counter()
        for _ in range(2000): f()
        print(th, name, round((time.perf_counter() - t) / 2000 * 1e6, 1), "us")
