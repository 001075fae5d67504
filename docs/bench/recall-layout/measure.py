"""Needle past the trained window: where recalled rows sit, and what is recalled.

    KVCHAT_HOME=... python docs/bench/recall-layout/measure.py VARIANT LENGTH DEPTHS [RECALL]

Paul Graham essays with "The special magic number is N." at each depth (comma-separated),
asked in the same message (`kvchat.bench.recall.needle_probe`), defaults everywhere but
`recall`. One JSON line per depth. VARIANT:

- `kvchat`: as kvchat runs;
- `forced`: the needle's tokens (± 8) are forced into every recalling layer's recall at
  every pass once they are cold, laid out as kvchat lays recalled rows out;
- `forced-in-place`: the same rows attended where their keys are rotated (the positions a
  compaction gives cold keys), not laid out before the window;
- `no-pins`: kvchat without the blocks a chunk pins for every layer.

`ALL_LAYERS=1` makes every layer a retrieval layer.
"""

import contextlib
import json
import os
import sys
import time

import torch

from kvchat.bench.recall import fact_positions, is_correct, needle_probe
from kvchat.calibration.realkv import essays_text
from kvchat.model.engine import load_engine
from kvchat.recall import key_index, tier
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

MARGIN = 8

variant, length = sys.argv[1], int(sys.argv[2])
depths = [float(x) for x in sys.argv[3].split(",")]
recall = int(sys.argv[4]) if len(sys.argv) > 4 else 32
engine = load_engine(ModelOptions())
if os.environ.get("ALL_LAYERS"):
    engine._measured["recall_layers"] = list(range(engine.loaded.num_layers))
state: dict = {}

top = key_index.NativeKeyIndex.top


def forced_top(index, query, k, bias=None):
    rows = top(index, query, k, bias)
    needle = state.get("needle")
    if needle is None or not variant.startswith("forced"):
        return rows
    want = torch.arange(int(needle.min()) - MARGIN, int(needle.max()) + 1 + MARGIN) - index.first
    want = want[(want >= 0) & (want < index.rows)]
    if not want.numel():
        return rows
    return torch.stack([torch.cat([want, head[~torch.isin(head, want)]])[: rows.shape[1]] for head in rows])


key_index.NativeKeyIndex.top = forced_top
recall_pass = tier.RecallTier.recall


def recall_hook(self, query, middle, before=None):
    if "needle" not in state:
        with contextlib.suppress(ValueError):  # not fed yet
            state["needle"] = fact_positions(engine, state["session"], state["fact"])
    if variant == "no-pins":
        self.pins = None
    return recall_pass(self, query, middle, None if variant == "forced-in-place" else before)


tier.RecallTier.recall = recall_hook
haystack = essays_text()
for depth in depths:
    probe = needle_probe(engine, haystack, length, depth, 40000 + int(depth * 1000))
    session = engine.new_session(CacheSettings(recall=recall))
    state.clear()
    state.update(session=session, fact=probe.fact)
    started = time.time()
    answer = session.send(user_message(probe.question, probe.document), SamplingSettings(max_new_tokens=12)).text
    print(
        json.dumps(
            {
                "variant": variant,
                "all_layers": bool(os.environ.get("ALL_LAYERS")),
                "length": length,
                "depth": depth,
                "recall": recall,
                "correct": is_correct(answer, probe.answer),
                "answer": answer,
                "seconds": round(time.time() - started, 1),
                "compactions": session.cache.compactions,
            }
        ),
        flush=True,
    )
