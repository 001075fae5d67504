"""bumblebee's time to first token on a document past greedy_max (its held prefill streams
through Algorithm 2 in pieces) with the eviction rounds in NumPy
(`kvchat.compress.bumblebee.NATIVE_ROUNDS` False) and in kvchat's kernel
(`kvchat/compress/_summary.c`), beside `window`'s, side by side in one process: `rounds`
rounds, the order rotated each round; each a new session (budget 25%, recall off, as
`kvchat bench speed`'s rows) sent the document and a question, timed to its first token,
and the flush's share (`settle_s`). Also whether the two kept the same tokens.

    KVCHAT_HOME=. python docs/bench/rounds-native/ttft.py 6144 3
"""

from __future__ import annotations

import statistics
import sys

import torch

from kvchat.compress import bumblebee
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings

RUNS = {"window": ("window", True), "bumblebee, NumPy rounds": ("bumblebee", False), "bumblebee, native rounds": ("bumblebee", True)}


def main(tokens: int, rounds: int) -> None:
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:tokens]
    text = engine.tokenizer.decode(ids) + "\n\nWhat is the first essay about?"
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    flush: dict[str, list[float]] = {name: [] for name in RUNS}
    kept: dict[str, torch.Tensor] = {}
    names = list(RUNS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            method, native = RUNS[name]
            bumblebee.NATIVE_ROUNDS = native
            session = engine.new_session(CacheSettings(method=method, budget="25%", recall=0))
            result = session.send(text, SamplingSettings(max_new_tokens=1))
            times[name].append(result.metrics.ttft_s)
            flush[name].append(session.cache._settle_seconds)
            kept[name] = torch.cat([layer.middle.positions for layer in session.cache._layers])
    bumblebee.NATIVE_ROUNDS = True
    base = statistics.median(times["window"])
    for name in RUNS:
        t = statistics.median(times[name])
        print(f"{name:26s} ttft {t:5.2f} s (x{t / base:.2f} window's), flush {statistics.median(flush[name]):5.2f} s; "
              f"rounds {[round(x, 2) for x in times[name]]}")
    same = torch.equal(kept["bumblebee, NumPy rounds"], kept["bumblebee, native rounds"])
    print(f"the two loops kept the same tokens in every layer: {same}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
