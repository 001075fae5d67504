"""Session 5: attention error of bumblebee's streaming rule with per-head eviction rounds,
batch 1 (= Algorithm 2, sequential) against batch 64 (rounds) and a 2000-token flush (pieces
of 256), against uniform sampling. Layers 1/8/15 of the essays, as in
bumblebee_batched_vs_sequential.py (256 sinks, 256 recent, budget = middle / 4).

Optional: the previous rule (same count in every head) registered as `bumblebee_before`:
    git show 56e6736~1:kvchat/compress/bumblebee.py \
      | sed 's/    name = "bumblebee"/    name = "bumblebee_before"/' > kvchat/compress/bumblebee_before.py
Run: OMP_NUM_THREADS=1 PYTHONPATH=. python docs/bench/fidelity/bumblebee_per_head_rounds.py
"""
import importlib.util
import time

from kvchat.evaluate import attention_error, compress_middle, uniform_middle
from kvchat.models import load_model
from kvchat.realkv import capture_qkv, essays_text

runs = [("bumblebee", 1), ("bumblebee", 64), ("bumblebee", 2000)]
if importlib.util.find_spec("kvchat.compress.bumblebee_before"):
    import kvchat.compress.bumblebee_before  # noqa: F401  (registers the previous rule)
    runs.insert(0, ("bumblebee_before", 64))
m = load_model()
ids = m.tokenizer(essays_text()[:6000], return_tensors="pt").input_ids
qkv = capture_qkv(m.model, ids, [1, 8, 15])
S = R = 256
for name, batch in runs + [("uniform", 0)]:
    errs, t = [], 0.0
    for layer, (q, k, v) in qkv.items():
        budget = (k.shape[1] - S - R) // 4
        for seed in range(3 if name == "uniform" else 1):
            t0 = time.perf_counter()
            mid = (uniform_middle(k, v, budget=budget, sinks=S, recent=R, seed=seed) if name == "uniform" else
                   compress_middle(name, q, k, v, budget=budget, sinks=S, recent=R, layer=layer, batch=batch,
                                   params={"greedy_max": 0}))
            t += time.perf_counter() - t0
            errs.append(attention_error(q, k, v, mid, sinks=S, recent=R))
    print(f"| {name}, batch {batch or '-'} | {sum(errs) / len(errs):.4f} | {[round(e, 4) for e in errs[:3]]} | {t:.2f} s |",
          flush=True)
