"""Decode speed of `window` at 2k with parts of the model under torch.compile (issue 20:
"torch.compile of the decode step might be [available on CPU]. Measure it.").

    KVCHAT_HOME=. .venv/bin/python docs/bench/compile/decode_compiled.py none|mlp+norm|model

`mlp+norm`: each layer's MLP and both RMSNorms compiled alone (static shapes).
`model`: the whole model's forward (`dynamic=True`), graph breaks at kvchat's cache
and attention. Prints the seconds until three steps have run (compilation included),
then three forks of 128 greedy steps each (tokens/s) and the last token. Not part of
kvchat: an experiment, see README.md.
"""
import sys, time, torch, statistics
from kvchat.engine import load_engine
from kvchat.settings import ModelOptions, CacheSettings
from kvchat.bench.speed import _prompt_ids, _prefilled
what = sys.argv[1]
engine = load_engine(ModelOptions(), on_status=lambda m: None)
ids = _prompt_ids(engine, 2048)
session, token0, _, _ = _prefilled(engine, ids, CacheSettings(method="window"))
layers = engine.model.model.layers
t0 = time.perf_counter()
if what == "model":
    engine.model.forward = torch.compile(engine.model.forward, dynamic=True)
elif what != "none":
    for l in layers:
        if "mlp" in what: l.mlp.forward = torch.compile(l.mlp.forward, dynamic=False)
        if "norm" in what:
            l.input_layernorm.forward = torch.compile(l.input_layernorm.forward, dynamic=False)
            l.post_attention_layernorm.forward = torch.compile(l.post_attention_layernorm.forward, dynamic=False)
with torch.inference_mode():
    s = session.fork(); token = token0
    for _ in range(3): token = int(torch.argmax(engine.forward([token], s.cache)))
    print("compile+3 steps", round(time.perf_counter()-t0, 1), "s")
    rates = []
    for _ in range(3):
        s = session.fork(); token = token0
        t = time.perf_counter()
        for _ in range(128): token = int(torch.argmax(engine.forward([token], s.cache)))
        rates.append(128/(time.perf_counter()-t))
print(what, [round(r,2) for r in rates], "median", round(statistics.median(rates),2), "last", token)
