"""The needle past the trained window: 12k tokens (the embedded model has 8,192
positions), with and without the recall tier, for methods that read a document in
streaming chunks (issue 19 asks to report 12k).

    KVCHAT_HOME=. OMP_NUM_THREADS=1 python docs/bench/recall-12k/needle12k.py window,h2o 12288 > out.txt

`kvchat bench recall` forks every method from one exact prefill, which cannot hold more
than the model's positions; here each session reads the document itself, in 512-token
chunks (`--prefill streaming`), and the cache compacts its positions as it goes
(kvchat/positions.py), the recall tier moving with it. `full` cannot run here: it would
need 12k exact positions. Budget 25%, one message (document, then the question), three
depths, the bench's needle and question; prints one line per answer and a tally.
"""

import random
import sys
import time

from kvchat.bench.recall import ANSWER_TOKENS, NEEDLE_QUESTION, RNG_SEED, is_correct, needle_probe
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

methods, context = sys.argv[1].split(","), int(sys.argv[2])
DEPTHS = (0.1, 0.5, 0.9)
engine = load_engine(ModelOptions(threads=1))
rng = random.Random(RNG_SEED)
probes = [needle_probe(engine, essays_text(), context, depth, rng.randrange(10000, 100000)) for depth in DEPTHS]
tally: dict[str, int] = {}
for method in methods:
    for recall in (0, 32):
        label = f"{method}+recall{recall}" if recall else method
        for probe in probes:
            session = engine.new_session(CacheSettings(method=method, budget="25%", recall=recall,
                                                       prefill_mode="streaming"))
            start = time.perf_counter()
            answer = session.send(user_message(NEEDLE_QUESTION, probe.document),
                                  SamplingSettings(max_new_tokens=ANSWER_TOKENS)).text
            right = is_correct(answer, probe.answer)
            tally[label] = tally.get(label, 0) + right
            print(f"{label} depth {probe.depth} tokens {session.cache.tokens_seen} compactions "
                  f"{session.cache.compactions} ({time.perf_counter() - start:.0f} s): {answer!r} "
                  f"expected {probe.answer} {'right' if right else 'wrong'}", flush=True)
for label, right in tally.items():
    print(f"{label}: {right}/{len(DEPTHS)}")
