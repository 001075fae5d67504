"""Why a method with recall misses a needle asked as a second turn that `full` finds
(`window` at 6k, depth 0.1, in sessions 10 and 17; balancekv at 1k, depth 0.7): the same
probe as `kvchat bench recall`'s (the document as one message, an 8-token reply, then the
question), answered by the method with `--recall 32` as the product runs it, and with one
thing changed at a time:

- every layer recalling instead of the 14 retrieval layers (the engine's measured choice
  replaced for the run, as docs/bench/recall-12k/diagnose.py does);
- every query row of the question's chunk ranking, not `CHUNK_QUERIES` (4) of them;
- 64 and 128 recalled tokens per KV head and step instead of 32.

    KVCHAT_HOME=. python docs/bench/recall-6k-session17/diagnose.py [depth [method [context]]]
"""

from __future__ import annotations

import sys
from dataclasses import replace

from kvchat import recall
from kvchat.bench.recall import ANSWER_TOKENS, FIRST_REPLY_TOKENS, is_correct, probes
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings

DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the bench's: the same numbers drawn


def answer(engine, probe, settings: CacheSettings) -> str:
    session = engine.new_session(settings)
    session.send(probe.document, SamplingSettings(max_new_tokens=FIRST_REPLY_TOKENS))
    return session.send(probe.question, SamplingSettings(max_new_tokens=ANSWER_TOKENS)).text


def main(depth: float, method: str, context: int) -> None:
    engine = load_engine(ModelOptions(threads=1))
    probe = next(p for p in probes(engine, (context,), DEPTHS) if p.task == "needle" and p.depth == depth)
    base = CacheSettings(method=method, budget="25%", recall=32)
    chosen = engine.measured("recall_layers")
    runs = [(f"{method}, recall 32 (the product)", base, None, None),
            ("full", CacheSettings(method="full", budget="25%"), None, None),
            ("every layer recalling", base, list(range(len(engine.loaded.model.model.layers))), None),
            ("every chunk row ranking", base, None, 10_000),
            ("recall 64", replace(base, recall=64), None, None),
            ("recall 128", replace(base, recall=128), None, None)]
    for label, settings, layers, chunk_rows in runs:
        engine._measured["recall_layers"] = chosen if layers is None else layers
        recall.CHUNK_QUERIES = 4 if chunk_rows is None else chunk_rows
        text = answer(engine, probe, settings)
        print(f"{label}: {text!r} ({'right' if is_correct(text, probe.answer) else 'wrong'}; {probe.answer})", flush=True)
    engine._measured["recall_layers"] = chosen
    recall.CHUNK_QUERIES = 4


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else 0.1, args[1] if len(args) > 1 else "window", int(args[2]) if len(args) > 2 else 6144)
