"""Decode at 8k (the speed bench's prompt, held then flushed): the compressor time per decoded
token split into settle (window overflow streamed into the compressor) and observe
(attention mass handed to score keepers), wall clock like the bench, REPS rounds.
Run: OMP_NUM_THREADS=2 PYTHONPATH=. python docs/bench/speed-session5/split.py METHOD..."""
import sys
import time

import torch

from kvchat.bench import speed
from kvchat.engine import Engine
from kvchat.models import load_model
from kvchat.settings import CacheSettings

torch.set_num_threads(2)
engine = Engine(load_model())
ids = speed._prompt_ids(engine, speed._fits(engine, 8192))
for rep in range(int(__import__("os").environ.get("REPS", 2))):
    for method in sys.argv[1:]:
        settings = CacheSettings(method=method, budget="1024", window=1024, sinks=4)
        session = engine.new_session(settings)
        with torch.inference_mode():
            logits, mode = session.feed(ids)
            token = int(torch.argmax(logits))
            cache = session.cache
            s0, o0 = cache._settle_seconds, sum(l.observe_seconds for l in cache._layers)
            t0 = time.perf_counter()
            for _ in range(128):
                logits = engine.forward([token], cache); token = int(torch.argmax(logits))
            dt = time.perf_counter() - t0
        s1, o1 = cache._settle_seconds, sum(l.observe_seconds for l in cache._layers)
        print(f"{method}: decode {1000*dt/128:.1f} ms/token; settle {1000*(s1-s0)/128:.2f} ms/token, observe {1000*(o1-o0)/128:.2f} ms/token; share {((s1-s0)+(o1-o0))/dt:.3f}", flush=True)
