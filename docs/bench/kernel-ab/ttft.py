"""A compressor's time to first token on a long document with one of its kernels switched
off and on, beside `window`'s, side by side in one process: `module`.`switch` (a module
flag such as `kvchat.compress._kcenter.NATIVE_FARTHEST`) False then True; `rounds` rounds,
the order rotated each round; each a new session (budget 25%, recall off, as `kvchat
bench speed`'s rows) sent the document and a question, timed to its first token, and the
flush's share (`settle_s`). Also whether the two kept the same tokens in every layer.

    KVCHAT_HOME=. python docs/bench/kernel-ab/ttft.py kvchat.compress._kcenter NATIVE_FARTHEST subgen 6144 3
    KVCHAT_HOME=. python docs/bench/kernel-ab/ttft.py kvchat.compress.bumblebee NATIVE_ROUNDS bumblebee 6144 3
"""

from __future__ import annotations

import importlib
import statistics
import sys

import torch

from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings


def main(module_name: str, switch: str, method: str, tokens: int, rounds: int) -> None:
    module = importlib.import_module(module_name)
    runs = {"window": ("window", True), f"{method}, {switch} off": (method, False),
            f"{method}, {switch} on": (method, True)}
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:tokens]
    text = engine.tokenizer.decode(ids) + "\n\nWhat is the first essay about?"
    times: dict[str, list[float]] = {name: [] for name in runs}
    flush: dict[str, list[float]] = {name: [] for name in runs}
    kept: dict[str, torch.Tensor] = {}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            chosen, enabled = runs[name]
            setattr(module, switch, enabled)
            session = engine.new_session(CacheSettings(method=chosen, budget="25%", recall=0))
            result = session.send(text, SamplingSettings(max_new_tokens=1))
            times[name].append(result.metrics.ttft_s)
            flush[name].append(session.cache._settle_seconds)
            kept[name] = torch.cat([layer.middle.positions for layer in session.cache._layers])
    setattr(module, switch, True)
    base = statistics.median(times["window"])
    for name in runs:
        t = statistics.median(times[name])
        print(f"{name:30s} ttft {t:5.2f} s (x{t / base:.2f} window's), flush {statistics.median(flush[name]):5.2f} s; "
              f"rounds {[round(x, 2) for x in times[name]]}")
    same = torch.equal(kept[names[1]], kept[names[2]])
    print(f"the two kept the same tokens in every layer: {same}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
