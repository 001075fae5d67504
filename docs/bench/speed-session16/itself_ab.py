"""A later turn's time to first token as the app meets it: on the session itself, after
an answer (not on a fresh fork, whose first write opens 30 cold files). Four sessions
read the bench's document and answer 128 greedy tokens; then `rounds` rounds, each
feeding the bench's later-turn question to every session in turn (the order rotated),
followed by a 16-token answer whose end writes the staged rows, as the app's does.
Variants: recall off; recall 32 with `CHUNK_QUERIES` 4 or 2, the question's evicted rows
deferred to the next pass (`DEFER_ROWS` 64); and recall 32 writing them at once (0).
The sessions grow by a turn a round, alike.

    KVCHAT_HOME=. python docs/bench/speed-session16/itself_ab.py window 2048 16
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvchat import recall
from kvchat.bench.speed import _fits, _prefilled, _prompt_ids, next_turn_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

method, length, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = load_engine(ModelOptions(), on_status=lambda m: None)
ids = _prompt_ids(engine, _fits(engine, length) - 40 * rounds)
VARIANTS = {"off": (0, 4, 64), "cq4": (32, 4, 64), "cq2": (32, 2, 64), "cq4-atonce": (32, 4, 0)}
with torch.inference_mode():
    bases = {}
    for name, (n, cq, defer) in VARIANTS.items():
        session, token, _, _ = _prefilled(engine, ids, CacheSettings(method=method, recall=n))
        ans = []
        session.cache.start_recall_log()
        for _ in range(128):
            ans.append(token); token = int(torch.argmax(engine.forward([token], session.cache)))
        session.cache.end_recall_log()
        bases[name] = session
        q = next_turn_ids(session, ans)
    res = {k: [] for k in VARIANTS}
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            n, cq, defer = VARIANTS[name]
            s = bases[name]
            recall.CHUNK_QUERIES, recall.DEFER_ROWS = cq, defer
            t = time.perf_counter(); s.feed(q); res[name].append((time.perf_counter() - t) * 1e3)
            s.cache.start_recall_log()
            for _ in range(16): engine.forward([198], s.cache)
            s.cache.end_recall_log()
            recall.CHUNK_QUERIES, recall.DEFER_ROWS = 4, 64
base = statistics.median(res["off"])
print(method, length, "question", len(q))
for k, v in res.items():
    print(k, "median %.1f x%.3f  min %.1f x%.3f" % (statistics.median(v), statistics.median(v) / base, min(v), min(v) / min(res["off"])))
