"""Attention error of bumblebee's streaming rule: the sequential Algorithm 2 before the
batched rounds (registered as `bumblebee_seq`), now with batches of 1 (exactly Algorithm 2)
and of 64 (rounds), against uniform sampling. Layers 1/8/15 of the essays.

The old rule must be put back under another name first:
    git show e1ae56f:kvchat/compress/bumblebee.py \
      | sed 's/    name = "bumblebee"/    name = "bumblebee_seq"/' > kvchat/compress/_old_bumblebee.py
then: OMP_NUM_THREADS=1 PYTHONPATH=. python docs/bench/fidelity/bumblebee_batched_vs_sequential.py
"""
import time

from kvchat.evaluate import attention_error, compress_middle, uniform_middle
from kvchat.models import load_model
from kvchat.realkv import capture_qkv, essays_text

m = load_model()
ids = m.tokenizer(essays_text()[:6000], return_tensors="pt").input_ids
qkv = capture_qkv(m.model, ids, [1, 8, 15])
S = R = 256
for name, params, batch in [("bumblebee_seq", {"greedy_max": 0}, 64), ("bumblebee", {"greedy_max": 0}, 1), ("bumblebee", {"greedy_max": 0}, 64), ("bumblebee", {"greedy_max": 0, "lam": 0.9}, 1), ("bumblebee", {"greedy_max": 0, "lam": 0.9}, 64), ("uniform", None, 0)]:
    errs, t = [], 0.0
    for layer, (q, k, v) in qkv.items():
        budget = (k.shape[1] - S - R) // 4
        for seed in range(3 if name == "uniform" else 1):
            t0 = time.perf_counter()
            mid = uniform_middle(k, v, budget=budget, sinks=S, recent=R, seed=seed) if name == "uniform" else \
                compress_middle(name, q, k, v, budget=budget, sinks=S, recent=R, layer=layer, batch=batch, params=params)
            t += time.perf_counter() - t0
            errs.append(attention_error(q, k, v, mid, sinks=S, recent=R))
    print(f"{name:14s} {params} batch {batch} attention error {sum(errs)/len(errs):.4f} per layer {[round(e,4) for e in errs[:3]]} time {t:.2f}s", flush=True)
