"""Steady-state decode with recall: the method without recall, with recall in the layers
the calibration chose, and with recall in every layer, measured in turn.

    KVCHAT_HOME=. OMP_NUM_THREADS=1 python docs/bench/speed-recall-layers/steady.py 8000 window

Feeds LENGTH essay tokens (exact-then-compress, budget 1024 middle entries, window 1024,
recall 32), then times 48 forced decode steps per session, three rounds in turn, one
thread; prints the best round's ms per step and its ratio to the method without recall.
"""

import sys
import time

import torch

from kvchat.bench.speed import _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

torch.set_num_threads(1)
length, method = int(sys.argv[1]), sys.argv[2]
engine = load_engine(ModelOptions(threads=1))
ids = _prompt_ids(engine, length)
chosen = engine.measured("recall_layers")
sessions = {}
for name, recall, layers in (("off", 0, None), ("chosen", 32, chosen), ("every", 32, list(range(30)))):
    engine._measured["recall_layers"] = layers  # what `new_cache` hands the cache
    session = engine.new_session(CacheSettings(method=method, budget="1024", recall=recall))
    with torch.inference_mode():
        session.feed(ids)
    sessions[name] = session


def per_step(session, steps: int = 48) -> float:
    token = 100
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(steps):
            token = int(engine.forward([token], session.cache).argmax())
        return (time.perf_counter() - start) / steps * 1000


rounds: dict[str, list[float]] = {}
for _ in range(3):
    for name, session in sessions.items():
        rounds.setdefault(name, []).append(per_step(session))
base = min(rounds["off"])
for name, times in rounds.items():
    print(f"{method} {length} {name}: {min(times):.2f} ms/step, ratio {base / min(times):.3f}")
