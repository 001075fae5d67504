"""bumblebee's 4k time to first token at two budgets, with timers around each layer's
greedy (thread CPU time and wall time, summed over the layers): one line per budget.
Run with a kvchat tree first on PYTHONPATH to compare trees side by side (README.md):

    KVCHAT_HOME=. PYTHONPATH=<tree> python docs/bench/flush-bf16/flush_timers.py LABEL
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from kvchat.compress import bumblebee
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings

timers: dict[str, float] = collections.defaultdict(float)
lock = threading.Lock()
greedy = bumblebee.BumbleBee._greedy


def timed_greedy(*args, **kwargs):
    cpu, wall = time.thread_time(), time.perf_counter()
    result = greedy(*args, **kwargs)
    with lock:
        timers["cpu"] += time.thread_time() - cpu
        timers["wall"] += time.perf_counter() - wall
    return result


bumblebee.BumbleBee._greedy = timed_greedy  # timers only: the greedy itself is unchanged
engine = load_engine(ModelOptions(), on_status=lambda message: None)
text = engine.tokenizer.decode(engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:4096])
engine.new_session(CacheSettings(method="window")).send(text[:3000], SamplingSettings(max_new_tokens=1))  # warm
for budget in ("1024", "25%"):
    timers.clear()
    session = engine.new_session(CacheSettings(method="bumblebee", budget=budget))
    result = session.send(text + "\n\nWhat is the first essay about?", SamplingSettings(max_new_tokens=1))
    print(sys.argv[1] if len(sys.argv) > 1 else "tree", budget, "ttft", round(result.metrics.ttft_s, 2),
          "settle", round(session.cache._settle_seconds, 2), "greedy cpu", round(timers["cpu"], 2),
          "wall", round(timers["wall"], 2), flush=True)
