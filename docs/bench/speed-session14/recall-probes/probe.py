"""Where recall's time goes: timers around the recall tier's calls, the cold writes and
each layer's attention. Timers only; nothing measured is changed.

- `decode`: per decode step, over 128 steps from a fork of one prefill (two rounds).
- `later-turn`: a later turn's time to first token with and without recall, on the
  session that answered (not a fork), then on seven forks of that session (the speed
  bench's rounds run on forks). One prefill per setting, 128 decoded tokens, then the
  bench's later-turn question.

    KVCHAT_HOME=. python docs/bench/speed-session14/recall-probes/probe.py decode|later-turn window 8192
"""

from __future__ import annotations

import collections
import sys
import time

import torch

from kvchat import cache, coldstore, keyindex, layer, recall
from kvchat.bench.speed import _after_prefill, _fits, _prefilled, _prompt_ids, next_turn_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

timers: collections.Counter = collections.Counter()
TIMED = {
    "decode": ((recall.RecallTier, "recall", "recall"), (recall.RecallTier, "_choose", "choose"),
               (recall.RecallTier, "_scores", "scores"), (recall.RecallTier, "_refresh", "refresh"),
               (coldstore.ColdStore, "read", "read"), (layer.CompressedLayer, "attend", "attend")),
    "later-turn": ((recall.RecallTier, "recall", "recall"), (recall.RecallTier, "_scores", "scores"),
                   (recall.RecallTier, "append", "append"), (coldstore.ColdStore, "append", "store.append"),
                   (keyindex.KeyIndex, "append", "index.append"), (layer.CompressedLayer, "attend", "attend"),
                   (cache.CompressedCache, "settle", "settle")),
}


def timed(owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        timers[key] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


def decode(engine, ids: list[int], method: str, length: int) -> None:
    session, token, _ttft, _mode = _prefilled(engine, ids, CacheSettings(method=method, recall=32))
    steps = 128
    for _ in range(2):
        timers.clear()
        speed = _after_prefill(engine, session.fork(), token, steps, next_turn=False)["decode_tok_s"]
        print(method, length, f"{speed:.1f} tok/s", {k: round(v / steps * 1e3, 3) for k, v in timers.items()}, "ms a step")


def later_turn(engine, ids: list[int], method: str, length: int) -> None:
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


probe, method, length = sys.argv[1], sys.argv[2], int(sys.argv[3])
for owner, name, key in TIMED[probe]:
    timed(owner, name, key)
engine = load_engine(ModelOptions(), on_status=lambda message: None)
{"decode": decode, "later-turn": later_turn}[probe](engine, _prompt_ids(engine, _fits(engine, length)), method, length)
