"""Time to first token of a 4k document, window against bumblebee, on the default CPU
path with the threads kvchat picks: one JSON line per method. Run with a kvchat tree
first on PYTHONPATH to compare trees side by side (see README.md)."""

from __future__ import annotations

import json
import sys
import time

from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
engine = load_engine(ModelOptions(), on_status=lambda message: None)
text = engine.tokenizer.decode(engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:TOKENS])
for method in ("window", "bumblebee"):
    session = engine.new_session(CacheSettings(method=method, budget="25%"))
    cpu, wall = time.process_time(), time.perf_counter()
    result = session.send(text + "\n\nWhat is the first essay about?", SamplingSettings(max_new_tokens=1))
    print(json.dumps({"method": method, "tokens": result.metrics.prompt_tokens, "ttft_s": round(result.metrics.ttft_s, 2),
                      "wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
                      "settle_s": round(session.cache._settle_seconds, 2), "threads": engine.threads.threads, "prefill_mode": result.metrics.prefill_mode}), flush=True)
