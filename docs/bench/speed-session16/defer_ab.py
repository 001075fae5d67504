"""A later turn's time to first token, three settings side by side in one process:
recall off, recall 32 writing the question's evicted rows at once (`DEFER_ROWS` 0), and
recall 32 deferring them to the next pass (`DEFER_ROWS` 64). With PRIMED=1 each fork first
takes a turn and a 16-token answer, so what is timed is a turn of a session that already
has its own cold files (the app's case) rather than a fork's first write. One prefill of the bench's
document and 128 greedy tokens per recall setting, then `rounds` rounds, each feeding the
bench's later-turn question to a fresh fork in every setting, the order rotated per round;
medians and minima, and each recall setting's ratio to recall off.

    KVCHAT_HOME=. python docs/bench/speed-session16/defer_ab.py window 2048 15
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from kvchat import recall
from kvchat.bench.speed import _fits, _prefilled, _prompt_ids, next_turn_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

PRIMED = os.environ.get("PRIMED") == "1"
SETTINGS = {"off": (0, 0), "at once": (32, 0), "deferred": (32, 64)}  # name: (recall, DEFER_ROWS)


def main(method: str, length: int, rounds: int) -> None:
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = _prompt_ids(engine, _fits(engine, length))
    with torch.inference_mode():
        bases = {}
        for n in (0, 32):
            session, token, _ttft, _mode = _prefilled(engine, ids, CacheSettings(method=method, recall=n))
            answer = []
            session.cache.start_recall_log()  # as an answer in the app: its end writes the staged rows
            for _ in range(128):
                answer.append(token)
                token = int(torch.argmax(engine.forward([token], session.cache)))
            session.cache.end_recall_log()
            bases[n] = (session, next_turn_ids(session, answer))
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        names = list(SETTINGS)
        for r in range(rounds):
            for name in names[r % 3:] + names[: r % 3]:
                n, defer = SETTINGS[name]
                recall.DEFER_ROWS = defer
                session, follow_up = bases[n]
                fork = session.fork()
                if PRIMED:  # a turn and its answer first: the fork's cold files exist, as in a session
                    recall.DEFER_ROWS = 64
                    fork.feed(follow_up)
                    fork.cache.start_recall_log()
                    for _ in range(16):
                        engine.forward([198], fork.cache)
                    fork.cache.end_recall_log()
                    recall.DEFER_ROWS = defer
                start = time.perf_counter()
                fork.feed(follow_up)
                times[name].append((time.perf_counter() - start) * 1e3)
    base_med, base_min = statistics.median(times["off"]), min(times["off"])
    print(f"{method} {length}, {rounds} rounds, {len(follow_up)} question tokens, primed {PRIMED}")
    for name, ms in times.items():
        print(f"  {name:9s} median {statistics.median(ms):6.1f} ms (x{statistics.median(ms) / base_med:.3f}), "
              f"min {min(ms):6.1f} ms (x{min(ms) / base_min:.3f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
