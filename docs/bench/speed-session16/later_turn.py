"""A later turn's time to first token with and without recall, and where recall's part
of it goes: timers around the tier's calls, the layer's attention and the settle.

For each setting (recall 0, 32, 0, 32): one prefill of the bench's document, 128 greedy
tokens, then the bench's later-turn question, fed to three fresh forks of that session
and then to the session itself (the app's case). Timers only; nothing measured changes.

    KVCHAT_HOME=. python docs/bench/speed-session16/later_turn.py window 2048
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
TIMED = (
    (recall.RecallTier, "recall", "recall"), (keyindex.KeyIndex, "top", "top"), (keyindex.NativeKeyIndex, "top", "top"),
    (recall.RecallTier, "_refresh", "refresh"), (coldstore.ColdStore, "read", "read"),
    (coldstore.ColdFile, "__init__", "file.init"), (coldstore.ColdStore, "append", "store.append"),
    (keyindex.KeyIndex, "append", "index.append"), (layer.CompressedLayer, "attend", "attend"),
    (cache.CompressedCache, "settle", "settle"),
)


def timed(owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        timers[key] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


def main(method: str, length: int) -> None:
    for owner, name, key in TIMED:
        timed(owner, name, key)
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
            for kind in ("fork", "fork", "fork", "itself"):
                target = session.fork() if kind == "fork" else session
                timers.clear()
                start = time.perf_counter()
                target.feed(follow_up)
                ms = (time.perf_counter() - start) * 1e3
                print(f"recall {n}, {kind}: {ms:.1f} ms", {k: round(v * 1e3, 2) for k, v in timers.items()}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
