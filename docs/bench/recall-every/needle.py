"""One needle probe (1,024 tokens, depth 0.1, document and question in one message,
`window` at 25%, recall 32) answered with a recalled choice serving 1 or 4 decode steps
(`RecallTier.every`), with the CPU int4 index and the portable one, forked from an exact
prefill as `kvchat bench recall` does and fed directly.

    python docs/bench/recall-every/needle.py

needle.txt holds what it printed.
"""

import random

import torch

import kvchat.keyindex as keyindex
import kvchat.recall as recall
from kvchat.bench import recall as bench
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

torch.set_num_threads(1)
engine = load_engine(ModelOptions())
probe = bench.needle_probe(engine, essays_text(), 1024, 0.1, random.Random(bench.RNG_SEED).randrange(10000, 100000))
print("answer", probe.answer)
settings = CacheSettings(method="window", budget="25%", recall=32, prefill_mode="exact-then-compress")
for portable in (False, True):
    # The index layout the tiers are made with (an experiment's switch, not a product one).
    recall.key_index = keyindex.KeyIndex if portable else keyindex.key_index
    for every in (1, 4):
        for mode in ("fork", "direct"):
            if mode == "fork":
                base = engine.new_session(CacheSettings(method="full", budget="25%", recall=32,
                                                        prefill_mode="exact-then-compress"))
                logits = base.prefill_message(user_message(probe.question, probe.document), hold=True)
                session = base.fork(settings)
            else:
                session = engine.new_session(settings)
                logits = session.prefill_message(user_message(probe.question, probe.document))
            session.cache.recall_every = every
            text = session.reply(logits, SamplingSettings(max_new_tokens=12)).text
            print("portable" if portable else "packed", f"every={every}", mode, repr(text), flush=True)
