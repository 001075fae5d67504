"""Why recall finds nothing at 12k that `window` misses (session 9's open question):
is the needle recalled at the answer's steps, and would the model use it if it were?

    KVCHAT_HOME=. OMP_NUM_THREADS=1 python docs/bench/recall-12k/diagnose.py 12288 > docs/bench/recall-12k/diagnose.txt

For each depth the misses were at (0.1, 0.5), `window` with the recall tier reads the
12k needle document in streaming chunks (one compaction of positions on the way, as in
needle12k.py), at two recall sizes:

- `--recall 32` (the size measured everywhere else): the answer, and how many of the
  needle sentence's tokens some recalling layer brought back during the answer, out of
  how many (the cache's recall log: every token a layer recalled at some step);
- recall of every cold token (`RECALL_ALL`, more than the document's length): each
  recalling layer attends every token that left the window, exact, at its compacted
  position; first in the 14 layers the calibration chose, then in all 30 (the engine's
  measured choice replaced for the run, as docs/bench/speed-recall-layers/steady.py
  does). If that misses too, retrieval is not what fails: the model does not read the
  number back from keys at interpolated positions past its trained window.
"""

import random
import sys
import time

from kvchat.bench.recall import ANSWER_TOKENS, NEEDLE_QUESTION, RNG_SEED, is_correct, needle_probe
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.turns import user_message

context = int(sys.argv[1])
DEPTHS = (0.1, 0.5)
RECALL_ALL = 16384
# Optional: other recall sizes to try in the chosen layers, and the depths to try them at
# (`diagnose.py 12288 64,128,256 0.5`); without them, the three settings above.
SIZES = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else None
ONLY = [float(d) for d in sys.argv[3].split(",")] if len(sys.argv) > 3 else DEPTHS
engine = load_engine(ModelOptions(threads=1))
rng = random.Random(RNG_SEED)
numbers = [rng.randrange(10000, 100000) for _ in (0.1, 0.5, 0.9)]  # needle12k.py's draws
probes = [needle_probe(engine, essays_text(), context, depth, number) for depth, number in zip(DEPTHS, numbers)]


def needle_tokens(token_ids: list[int], needle: str) -> range:
    """Where the needle sentence's tokens sit among everything the session fed."""
    ids = engine.tokenizer(" " + needle, add_special_tokens=False).input_ids
    for start in range(len(token_ids) - len(ids) + 1):
        if token_ids[start : start + len(ids)] == ids:
            return range(start, start + len(ids))
    raise SystemExit(f"the needle {needle!r} is not among the fed tokens")


chosen = engine.measured("recall_layers")
every = list(range(engine.loaded.num_layers))
settings = [(n, chosen) for n in SIZES] if SIZES else [(32, chosen), (RECALL_ALL, chosen), (RECALL_ALL, every)]
for probe in (p for p in probes if p.depth in ONLY):
    for recall, layers in settings:
        engine._measured["recall_layers"] = layers  # what `new_session` hands the cache
        session = engine.new_session(CacheSettings(method="window", budget="25%", recall=recall,
                                                   prefill_mode="streaming"))
        start = time.perf_counter()
        answer = session.send(user_message(NEEDLE_QUESTION, probe.document),
                              SamplingSettings(max_new_tokens=ANSWER_TOKENS)).text
        span = needle_tokens(session.token_ids, probe.fact)
        _steps, _means, recalled, by_layers = session.cache.recall_log
        hit = [int(n) for t, n in zip(recalled.tolist(), by_layers.tolist()) if t in span]
        print(f"depth {probe.depth} recall {recall} in {len(layers)} layers compactions {session.cache.compactions} "
              f"({time.perf_counter() - start:.0f} s): {answer!r} expected {probe.answer} "
              f"{'right' if is_correct(answer, probe.answer) else 'wrong'}; needle tokens {span.start}-{span.stop} "
              f"recalled by some layer: {len(hit)} of {len(span)} (layers per token {hit})", flush=True)
