"""A later turn's time to first token with recall over without, side by side: one prefill
and 128 greedy tokens per setting, then `rounds` rounds, each feeding the bench's
later-turn question to a fresh fork of each session in turn (alternating which goes
first); medians and minima. `CQ=n` sets `CHUNK_QUERIES` for the run.

    KVCHAT_HOME=. CQ=4 python docs/bench/speed-session16/ratio.py window 8192 15
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


def main(method: str, length: int, rounds: int) -> None:
    recall.CHUNK_QUERIES = int(os.environ.get("CQ", recall.CHUNK_QUERIES))
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = _prompt_ids(engine, _fits(engine, length))
    with torch.inference_mode():
        bases = {}
        for n in (0, 32):
            session, token, _ttft, _mode = _prefilled(engine, ids, CacheSettings(method=method, recall=n))
            answer = []
            for _ in range(128):
                answer.append(token)
                token = int(torch.argmax(engine.forward([token], session.cache)))
            bases[n] = (session, next_turn_ids(session, answer))
        times: dict[int, list[float]] = {0: [], 32: []}
        for r in range(rounds):
            for n in (0, 32) if r % 2 == 0 else (32, 0):
                session, follow_up = bases[n]
                fork = session.fork()
                start = time.perf_counter()
                fork.feed(follow_up)
                times[n].append((time.perf_counter() - start) * 1e3)
    without, with_ = statistics.median(times[0]), statistics.median(times[32])
    print(f"{method} {length} CQ={recall.CHUNK_QUERIES}: median without {without:.1f} ms, with {with_:.1f} ms, "
          f"ratio {with_ / without:.3f}; minima {min(times[0]):.1f} / {min(times[32]):.1f} ms, "
          f"ratio {min(times[32]) / min(times[0]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
