"""One decode query (9 heads, GQA 3, d = 64, bf16) against n cached entries: the explicit
float32 kernel with the mass (`segment_attention`, what score-based methods' steps used
before), PyTorch's fused CPU kernel (`fused_segment_attention`, what steps without
attention mass use; it gives no mass) and `decode_attention` (bf16 matrix products with
the mass, what score-based methods' steps use from 1,024 entries),
µs per call, warm. Three cases for the products: operands already contiguous, a strided
view of a larger buffer (a window inside its storage), and n growing by one each call
(a new shape every call, as a cache that grows does).

    .venv/bin/python docs/bench/decode-bf16/kernel.py
"""

import time

import torch

from kvchat.attention import decode_attention, fused_segment_attention, segment_attention

H, D, SCALE = 3, 64, 0.125


def per_call_us(call, repeats: int = 1000) -> float:
    for i in range(100):
        call(i)
    start = time.perf_counter()
    for i in range(repeats):
        call(100 + i)
    return (time.perf_counter() - start) / repeats * 1e6


for threads in (1, 2):
    torch.set_num_threads(threads)
    query = torch.randn(9, 1, D, dtype=torch.bfloat16)
    for n in (1028, 2052, 8196):
        store_k = torch.randn(H, n + 1200, D, dtype=torch.bfloat16)
        store_v = torch.randn(H, n + 1200, D, dtype=torch.bfloat16)
        keys, values = store_k[:, :n].contiguous(), store_v[:, :n].contiguous()
        view_k, view_v = store_k[:, 50 : 50 + n], store_v[:, 50 : 50 + n]
        calls = {
            "explicit": lambda i: segment_attention(query, [(keys, values, None, None)], SCALE, causal_last=True,
                                                    split=False, want_mass=True),
            "fused": lambda i: fused_segment_attention(query, [(keys, values, None, None)], SCALE),
            "products": lambda i: decode_attention(query, [(keys, values, None, None)], SCALE, want_mass=True),
            "products, strided view": lambda i: decode_attention(query, [(view_k, view_v, None, None)], SCALE),
            "products, new shape each call": lambda i: decode_attention(
                query, [(store_k[:, : n + i], store_v[:, : n + i], None, None)], SCALE),
            "fused, new shape each call": lambda i: fused_segment_attention(
                query, [(store_k[:, : n + i], store_v[:, : n + i], None, None)], SCALE),
        }
        row = {name: round(per_call_us(call), 1) for name, call in calls.items()}
        print(f"threads {threads}, n {n}: {row}")
