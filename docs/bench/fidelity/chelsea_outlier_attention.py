"""Attention error of chelsea's outlier-head choices on the layers that have outlier heads
(read from models/chelsea-calibration-*.json, which any chelsea session writes).
Run: OMP_NUM_THREADS=1 PYTHONPATH=. python docs/bench/fidelity/chelsea_outlier_attention.py"""
import glob
import json

import torch

from kvchat.evaluate import attention_error, compress_middle, uniform_middle
from kvchat.models import load_model
from kvchat.realkv import capture_qkv, essays_text

m = load_model()
cal = json.load(open(glob.glob("models/chelsea-calibration-*.json")[0]))["layers"]
layers = [int(l) for l, p in cal.items() if p["outlier_heads"]]
ids = m.tokenizer(essays_text(), return_tensors="pt").input_ids[:, :2048]
qkv = capture_qkv(m.model, ids, layers)
S = R = 256
for label, extra in [("no outlier heads", None), ("recent (default)", "recent"), ("full (paper)", "full")]:
    errs, kv = [], []
    for layer, (q, k, v) in qkv.items():
        budget = (k.shape[1] - S - R) // 4
        params = {} if extra is None else {"outlier_heads": cal[str(layer)]["outlier_heads"], "outlier_cache": extra}
        mid = compress_middle("chelsea", q, k, v, budget=budget, sinks=S, recent=R, layer=layer, batch=64, params=params)
        errs.append(attention_error(q, k, v, mid, sinks=S, recent=R))
        kv.append(int(torch.isfinite(mid.log_num).sum()))
    print(f"{label:18s} layers {layers}: attention error {sum(errs)/len(errs):.4f} {[round(e, 4) for e in errs]}, middle entries (all heads) {sum(kv)}")
errs = []
for layer, (q, k, v) in qkv.items():
    budget = (k.shape[1] - S - R) // 4
    for seed in range(3):
        errs.append(attention_error(q, k, v, uniform_middle(k, v, budget=budget, sinks=S, recent=R, seed=seed), sinks=S, recent=R))
print(f"uniform (3 seeds): {sum(errs)/len(errs):.4f}")
