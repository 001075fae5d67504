"""A later turn's time to first token with and without recall, on the session that
answered (not a fork), with timers around recall's calls, the cold writes and the
settle; then the same turn on seven forks of that session (the speed bench's rounds run
on forks). One prefill per setting, 128 decoded tokens, then the bench's later-turn
question. Timers only; nothing measured is changed.

    KVCHAT_HOME=. python docs/bench/speed-session14/recall-probes/later_turn.py window 8192
"""

from __future__ import annotations

import collections
import sys
import time

import torch

from kvchat import cache, coldstore, keyindex, layer, recall
from kvchat.bench.speed import _fits, _prefilled, _prompt_ids, next_turn_ids
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


for owner, name, key in ((recall.RecallTier, "recall", "recall"), (recall.RecallTier, "_scores", "scores"),
                         (recall.RecallTier, "append", "append"), (coldstore.ColdStore, "append", "store.append"),
                         (keyindex.KeyIndex, "append", "index.append"), (layer.CompressedLayer, "attend", "attend"),
                         (cache.CompressedCache, "settle", "settle")):
    timed(owner, name, key)
method, length = sys.argv[1], int(sys.argv[2])
engine = load_engine(ModelOptions(), on_status=lambda message: None)
ids = _prompt_ids(engine, _fits(engine, length))
with torch.inference_mode():
    for n in (0, 32, 0, 32):
        session, token, _ttft, _mode = _prefilled(engine, ids, CacheSettings(method=method, recall=n))
        answer = []
        for _ in range(128):
            answer.append(token)
            token = int(torch.argmax(engine.forward([token], session.cache)))
        follow_up = next_turn_ids(session, answer)
        forks = []
        for _ in range(7):
            fork = session.fork()
            start = time.perf_counter()
            fork.feed(follow_up)
            forks.append(round((time.perf_counter() - start) * 1e3, 1))
        timers.clear()
        start = time.perf_counter()
        session.feed(follow_up)
        own = (time.perf_counter() - start) * 1e3
        print(f"recall {n}: the session itself {own:.1f} ms", {k: round(v * 1e3, 2) for k, v in timers.items()},
              "| forks", sorted(forks), "ms", flush=True)
