"""Decode speed with the recall tier, one selection serving 1, 2, 4 or 8 steps
(`RecallTier.every`), side by side with the same method without recall.

    OMP_NUM_THREADS=1 python docs/bench/recall-every/decode.py 2048 window

Feeds LENGTH essay tokens (exact-then-compress, budget 1024 middle entries, window 1024,
recall 32 where on), then times 64 forced decode steps per session, three rounds in turn,
and prints the best round's ms/step and its ratio to the method without recall.
decode.txt holds the lines this printed for 2,048 and 8,000 tokens, window and h2o.
"""

import sys
import time

import torch

from kvchat.bench.speed import _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

torch.set_num_threads(1)
length, method = int(sys.argv[1]), sys.argv[2]
STEPS = 64
engine = load_engine(ModelOptions())
ids = _prompt_ids(engine, length)
sessions = {}
for every in (0, 1, 2, 4, 8):  # 0: without recall
    session = engine.new_session(CacheSettings(method=method, budget="1024", recall=32 if every else 0))
    if every:
        session.cache.recall_every = every
    with torch.inference_mode():
        session.feed(ids)
    sessions[every] = session


def per_step(session, steps: int) -> float:
    token = 100
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(steps):
            token = int(engine.forward([token], session.cache).argmax())
        return (time.perf_counter() - start) / steps


rounds: dict[int, list[float]] = {}
for _ in range(3):
    for every, session in sessions.items():
        rounds.setdefault(every, []).append(per_step(session, STEPS))
base = min(rounds[0])
for every, times in rounds.items():
    print(f"{method} {length} every={every} ms/step {min(times) * 1000:.2f} ratio {base / min(times):.3f}")
