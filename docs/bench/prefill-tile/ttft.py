"""Time to first token of one long document per method, in one process, with a kvchat
tree first on PYTHONPATH (README.md alternates trees): one JSON line per method.

    KVCHAT_HOME=. PYTHONPATH=<tree> python docs/bench/prefill-tile/ttft.py 6144 window,bumblebee,subgen
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvchat.bench.speed import _fits, _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

length = int(sys.argv[1]) if len(sys.argv) > 1 else 6144
methods = (sys.argv[2] if len(sys.argv) > 2 else "window").split(",")
engine = load_engine(ModelOptions(), on_status=lambda message: None)
ids = _prompt_ids(engine, _fits(engine, length))
engine.new_session(CacheSettings()).feed(ids[:1024])  # warm: the first prefill of a process builds kernels
for method in methods:
    session = engine.new_session(CacheSettings(method=method))
    start = time.perf_counter()
    logits, mode = session.feed(ids)
    int(torch.argmax(logits))
    print(json.dumps({"method": method, "tokens": len(ids), "ttft_s": round(time.perf_counter() - start, 2),
                      "settle_s": round(session.cache._settle_seconds, 2), "prefill_mode": mode}), flush=True)
