"""A decode step of a score-based method, its attention in the explicit float32 kernel
(`segment_attention`, what every bf16 step of h2o and bumblebee ran before) or in
`decode_attention` (bf16 products), alternated in one process: one prefill of CONTEXT
tokens, then ROUNDS rounds, each decoding 128 greedy tokens from a fresh fork with each
kernel in turn. Prints tokens/s per round and the medians.

    KVCHAT_HOME=. .venv/bin/python docs/bench/decode-bf16/ab_inprocess.py h2o 2048 [ROUNDS]
"""
import json
import statistics
import sys

import kvchat.layer
from kvchat.attention import segment_attention
from kvchat.bench.speed import _after_prefill, _prefilled, _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

method, context = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
products = kvchat.layer.decode_attention


def explicit(query, segments, scale, want_mass=False):
    """The step as the explicit kernel computes it (the code path before the change)."""
    return segment_attention(query, segments, scale, causal_last=True, split=False, want_mass=want_mass)


engine = load_engine(ModelOptions(), on_status=lambda message: None)
session, first, _, _ = _prefilled(engine, _prompt_ids(engine, context), CacheSettings(method=method))
rates: dict[str, list[float]] = {"explicit": [], "products": []}
for _ in range(rounds):
    for name, kernel in (("explicit", explicit), ("products", products)):
        kvchat.layer.decode_attention = kernel
        decode = _after_prefill(engine, session.fork(), first, 128, next_turn=False)
        rates[name].append(round(decode["decode_tok_s"], 2))
print(json.dumps({"method": method, "context": context, "tok_s": rates,
                  "median": {name: statistics.median(r) for name, r in rates.items()}}))
