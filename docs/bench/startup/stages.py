"""Where one start's time goes, inside the process: run it with a kvchat checkout first on
PYTHONPATH (from a folder that is not a checkout). Prints one JSON line; the process's
whole wall time (exit included) is what bench.py measures.

    PYTHONPATH=/tmp/base-startup python docs/bench/startup/stages.py
"""

import json
import time

t0 = time.perf_counter()
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings

t1 = time.perf_counter()
from kvchat.engine import load_engine  # torch, transformers, kvchat's cache

t2 = time.perf_counter()
engine = load_engine(ModelOptions(), on_status=lambda message: None)  # transformers' model code, weights, tokenizer
t3 = time.perf_counter()
from kvchat.controller import Controller

answer = Controller(engine, None, CacheSettings(), SamplingSettings(temperature=0)).send("Say hi.")
t4 = time.perf_counter()
print(json.dumps({
    "import_engine_s": round(t2 - t1, 3), "load_engine_s": round(t3 - t2, 3), "answer_s": round(t4 - t3, 3),
    "until_answer_s": round(t4 - t0, 3), "threads": engine.threads.threads,
}))
