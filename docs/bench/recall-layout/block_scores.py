"""Each retrieval layer's row scores at the prompt's last chunk, and where the needle is.

    KVCHAT_HOME=... [TAG=name] python docs/bench/recall-layout/block_scores.py LENGTH DEPTHS

`measure.py`'s needles (one per depth, comma-separated), as kvchat runs them; the scores a
chunk ranks its pins by (`RecallTier._best_blocks`) are saved per layer with the needle's
tokens in /tmp/scores{TAG}_{LENGTH}_{DEPTH}.pt for `rank_rules.py`. One JSON line per depth.
"""

import json
import os
import sys
import time

import torch

from kvchat.bench.recall import fact_positions, is_correct, needle_probe
from kvchat.calibration.realkv import essays_text
from kvchat.model.engine import load_engine
from kvchat.recall import tier
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

length = int(sys.argv[1])
depths = [float(x) for x in sys.argv[2].split(",")]
engine = load_engine(ModelOptions())
captured: dict = {}
best_blocks = tier.RecallTier._best_blocks


def hook(self, scores):
    captured[id(self)] = (scores.detach().float().cpu().clone(), int(self.index.first))
    return best_blocks(self, scores)


tier.RecallTier._best_blocks = hook
haystack = essays_text()
for depth in depths:
    probe = needle_probe(engine, haystack, length, depth, 40000 + int(depth * 1000))
    session = engine.new_session(CacheSettings(recall=32))
    captured.clear()
    started = time.time()
    answer = session.send(user_message(probe.question, probe.document), SamplingSettings(max_new_tokens=12)).text
    needle = fact_positions(engine, session, probe.fact)
    layers = {}
    for i, layer in enumerate(session.cache.compressed_layers):
        if layer.recall is not None and id(layer.recall) in captured:
            scores, first = captured[id(layer.recall)]
            layers[i] = {"scores": scores, "first": first}
    torch.save({"needle": needle, "layers": layers}, f"/tmp/scores{os.environ.get('TAG', '')}_{length}_{depth}.pt")
    print(
        json.dumps(
            {
                "length": length,
                "depth": depth,
                "correct": is_correct(answer, probe.answer),
                "answer": answer,
                "needle": [int(needle.min()), int(needle.max())],
                "seconds": round(time.time() - started, 1),
            }
        ),
        flush=True,
    )
