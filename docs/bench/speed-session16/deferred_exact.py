"""Deferring the cold writes changes no number: for window, h2o and chelsea with recall 32,
a 2k document, 8 answer tokens, the bench's later-turn question and 24 greedy tokens, run
with the writes deferred (`DEFER_ROWS` 64) and written at once (0); the tokens and the
last logits are compared bit for bit.

    KVCHAT_HOME=. python docs/bench/speed-session16/deferred_exact.py
"""

from __future__ import annotations

import torch

from kvchat import recall
from kvchat.bench.speed import _fits, _prompt_ids, next_turn_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions


def run(engine, ids: list[int], method: str) -> tuple[list[int], torch.Tensor]:
    session = engine.new_session(CacheSettings(method=method, recall=32))
    with torch.inference_mode():
        logits, _ = session.feed(ids)
        answer = []
        for _ in range(8):
            answer.append(int(torch.argmax(logits)))
            logits = engine.forward([answer[-1]], session.cache)
        logits, _ = session.feed(next_turn_ids(session, answer))
        tokens = []
        for _ in range(24):
            tokens.append(int(torch.argmax(logits)))
            logits = engine.forward([tokens[-1]], session.cache)
    return tokens, logits


def main() -> None:
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = _prompt_ids(engine, _fits(engine, 2048))
    for method in ("window", "h2o", "chelsea"):
        recall.DEFER_ROWS = 64
        deferred = run(engine, ids, method)
        recall.DEFER_ROWS = 0
        at_once = run(engine, ids, method)
        print(f"{method}: tokens equal {deferred[0] == at_once[0]}, logits bit-equal {torch.equal(deferred[1], at_once[1])}")


if __name__ == "__main__":
    main()
