"""A bumblebee session's decode with the streaming rounds in NumPy and in kvchat's kernel,
as `kvchat bench speed` measures it (`kvchat.bench.speed._ours`: a document of `tokens`
essay tokens, then `new` forced greedy tokens, each eviction batch streamed through
Algorithm 2's rounds): whether the greedy tokens and every layer's kept tokens are the
same, and each side's decode tokens/s and compress share (`rounds` alternated runs).

    KVCHAT_HOME=. python docs/bench/rounds-native/decode_same.py 2048 256 3
"""

from __future__ import annotations

import statistics
import sys

import torch

from kvchat.bench import speed
from kvchat.compress import bumblebee
from kvchat.engine import load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, ModelOptions


@torch.inference_mode()
def decode(engine, ids: list[int], new: int) -> tuple[list[int], torch.Tensor, float, float]:
    session, token, _, _ = speed._prefilled(engine, ids, CacheSettings(method="bumblebee", budget="25%", recall=0))
    before, answer = session.cache.compress_seconds, []
    start = speed.time.perf_counter()
    for _ in range(new):
        answer.append(token)
        token = int(torch.argmax(engine.forward([token], session.cache)))
    seconds = speed.time.perf_counter() - start
    kept = torch.cat([layer.middle.positions for layer in session.cache._layers])
    return answer, kept, new / seconds, (session.cache.compress_seconds - before) / seconds


def main(tokens: int, new: int, rounds: int) -> None:
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:tokens]
    runs: dict[bool, list] = {False: [], True: []}
    for r in range(rounds):
        for native in ((False, True) if r % 2 == 0 else (True, False)):
            bumblebee.NATIVE_ROUNDS = native
            runs[native].append(decode(engine, ids, new))
    bumblebee.NATIVE_ROUNDS = True
    for native, name in ((False, "NumPy rounds"), (True, "native rounds")):
        print(f"{name:14s} decode {statistics.median(r[2] for r in runs[native]):5.1f} tok/s, compress share "
              f"{statistics.median(r[3] for r in runs[native]):.3f}")
    same_tokens = all(a[0] == b[0] for a in runs[False] for b in runs[True])
    same_kept = all(torch.equal(a[1], b[1]) for a in runs[False] for b in runs[True])
    print(f"same greedy tokens: {same_tokens}; same kept tokens in every layer: {same_kept}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
