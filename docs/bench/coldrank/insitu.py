"""Recall's ranking kernels in place, side by side in one process: decode speed and a
later turn's time to first token for recall off, recall 32 ranking in PyTorch's int4
kernel and reading rows in PyTorch (`kvchat.native.ENABLED` False: `PackedKeyIndex`,
before) and recall 32 in kvchat's own kernels (`NativeKeyIndex`, `_coldrank.gather`).

Each setting reads the bench's document and answers 128 greedy tokens. Then `rounds`
rounds, the order of the settings rotated each round: a fork of each session decodes 64
greedy tokens (timed: decode); then the session itself is given the bench's later-turn
question (timed: its first token, the app's case) and a 16-token answer, whose end writes
the staged rows as the app's does. Medians over the rounds, and each ratio to recall off.

    KVCHAT_HOME=. python docs/bench/coldrank/insitu.py window 2048 9
    KVCHAT_HOME=. python docs/bench/coldrank/insitu.py h2o 2048 7 "off,own kernel"   # some settings only
    KVCHAT_HOME=. python docs/bench/coldrank/insitu.py window 2048 9 "off,own kernel,own AVX2"
    KVCHAT_HOME=. python docs/bench/coldrank/insitu.py window 2048 5 "off,own AVX2" float32  # a CPU without bf16
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvchat import native
from kvchat.bench.speed import _fits, _prefilled, _prompt_ids, next_turn_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions

# (recall, native.ENABLED, native.FORCE_PATH): "own AVX2" is the path a CPU
# without AVX512-VNNI runs (session 18), forced on this one.
SETTINGS = {"off": (0, True, None), "int4 kernel": (32, False, None), "own kernel": (32, True, None),
            "own AVX2": (32, True, "avx2")}


def use(name: str) -> None:
    native.ENABLED, native.FORCE_PATH = SETTINGS[name][1], SETTINGS[name][2]
DECODE, ANSWER = 64, 16


def answer(engine, session, token: int, steps: int) -> tuple[list[int], int]:
    session.cache.start_recall_log()
    tokens = []
    for _ in range(steps):
        tokens.append(token)
        token = int(torch.argmax(engine.forward([token], session.cache)))
    session.cache.end_recall_log()
    return tokens, token


def main(method: str, length: int, rounds: int, names: list[str], dtype: str = "auto") -> None:
    global SETTINGS
    SETTINGS = {name: SETTINGS[name] for name in names}
    engine = load_engine(ModelOptions(dtype=dtype), on_status=lambda message: None)
    ids = _prompt_ids(engine, _fits(engine, length) - 40 * rounds)
    sessions, question = {}, None
    with torch.inference_mode():
        for name, (recall, _enabled, _path) in SETTINGS.items():
            use(name)
            session, token, _ttft, _mode = _prefilled(engine, ids, CacheSettings(method=method, recall=recall))
            tokens, token = answer(engine, session, token, 128)
            kinds = {type(layer.recall.index).__name__ for layer in session.cache._layers if layer.recalls}
            print(f"{name}: index {sorted(kinds) or '-'}", flush=True)
            sessions[name] = (session, token)
            question = next_turn_ids(session, tokens)
        native.ENABLED, native.FORCE_PATH = True, None
        decode: dict[str, list[float]] = {name: [] for name in SETTINGS}
        later: dict[str, list[float]] = {name: [] for name in SETTINGS}
        names = list(SETTINGS)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                use(name)
                session, token = sessions[name]
                fork = session.fork()
                start = time.perf_counter()
                answer(engine, fork, token, DECODE)
                decode[name].append(DECODE / (time.perf_counter() - start))
                del fork
                start = time.perf_counter()
                logits, _mode = session.feed(question)
                later[name].append((time.perf_counter() - start) * 1e3)
                _tokens, token = answer(engine, session, int(torch.argmax(logits)), ANSWER)
                sessions[name] = (session, token)
    native.ENABLED, native.FORCE_PATH = True, None
    print(f"{method}, {length} tokens, {rounds} rounds, {len(question)} question tokens, dtype {dtype}")
    base_decode, base_later = statistics.median(decode["off"]), statistics.median(later["off"])
    for name in SETTINGS:
        d, t = statistics.median(decode[name]), statistics.median(later[name])
        # Paired: each round's turn over recall off's in the same round. The sessions take
        # the same tokens, so a compressor's batch (subgen's clustering, every 64 tokens)
        # falls in the same round for each: a median of times can mix rounds with and
        # without one (48 against 175 ms for subgen at 8k), a median of ratios cannot.
        paired = statistics.median(x / y for x, y in zip(later[name], later["off"]))
        print(f"  {name:16s} decode {d:5.1f} tok/s (x{d / base_decode:.3f}), later turn {t:5.1f} ms "
              f"(x{t / base_later:.3f}; paired x{paired:.3f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",") if len(sys.argv) > 4 else list(SETTINGS),
         *sys.argv[5:6])
