"""Decode speed of one method from one tree: load, prefill an essay of CONTEXT tokens,
then three forks each decode 128 forced greedy tokens (RECALL, the third argument, sets
`--recall`; 0 by default). Prints one JSON line (tokens/s of
each fork, their median, the last token). Run alternately for two trees:

    for r in 1 2 3 4 5 6; do for t in /tmp/wt-old /work/main; do
        PYTHONPATH=$t KVCHAT_HOME=/work/main .venv/bin/python docs/bench/speed-session12/ab_decode.py window 2048
    done; done
"""
import sys, time, statistics, torch, json
from kvchat.engine import load_engine
from kvchat.settings import ModelOptions, CacheSettings
from kvchat.bench.speed import _prompt_ids, _prefilled
import kvchat
method, ctx = sys.argv[1], int(sys.argv[2])
recall = int(sys.argv[3]) if len(sys.argv) > 3 else 0
engine = load_engine(ModelOptions(), on_status=lambda m: None)
ids = _prompt_ids(engine, ctx)
session, token0, _, _ = _prefilled(engine, ids, CacheSettings(method=method, recall=recall))
rates = []
with torch.inference_mode():
    for _ in range(3):
        s = session.fork(); token = token0
        t = time.perf_counter()
        for _ in range(128):
            token = int(torch.argmax(engine.forward([token], s.cache)))
        rates.append(128 / (time.perf_counter() - t))
print(json.dumps({"tree": kvchat.__file__, "method": method, "recall": recall, "tok_s": [round(r, 2) for r in rates], "median": round(statistics.median(rates), 2), "last_token": token}))
