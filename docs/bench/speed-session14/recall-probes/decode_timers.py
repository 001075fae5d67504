"""Where a decode step with recall spends its time: timers around the recall tier's calls
and each layer's attention, per decode step, over 128 steps from a fork of one prefill
(two rounds). Timers only; nothing measured is changed.

    KVCHAT_HOME=. python docs/bench/speed-session14/recall-probes/decode_timers.py window 8192
"""

from __future__ import annotations

import collections
import sys
import time

from kvchat import coldstore, layer, recall
from kvchat.bench.speed import _after_prefill, _fits, _prefilled, _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

timers: collections.Counter = collections.Counter()


def timed(owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        timers[key] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


for owner, name, key in ((recall.RecallTier, "recall", "recall"), (recall.RecallTier, "_choose", "choose"),
                         (recall.RecallTier, "_scores", "scores"), (recall.RecallTier, "_refresh", "refresh"),
                         (coldstore.ColdStore, "read", "read"), (layer.CompressedLayer, "attend", "attend")):
    timed(owner, name, key)
method, length = sys.argv[1], int(sys.argv[2])
engine = load_engine(ModelOptions(), on_status=lambda message: None)
ids = _prompt_ids(engine, _fits(engine, length))
session, token, _ttft, _mode = _prefilled(engine, ids, CacheSettings(method=method, recall=32))
steps = 128
for _ in range(2):
    timers.clear()
    speed = _after_prefill(engine, session.fork(), token, steps, next_turn=False)["decode_tok_s"]
    print(method, length, f"{speed:.1f} tok/s", {k: round(v / steps * 1e3, 3) for k, v in timers.items()}, "ms a step")
