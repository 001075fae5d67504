"""`kvchat bench speed`'s side-by-side rows for one method and context, with more rounds:
a method and its `--recall 32` row prefilled once each, then `rounds` rounds in turn,
each decoding 128 tokens on a fork and giving it the later turn (`_paired`, as the bench
does with 3), medians.

    KVCHAT_HOME=. python docs/bench/speed-session17/paired.py window 8192 9
"""

from __future__ import annotations

import sys

import torch

from kvchat.bench.speed import _fits, _paired, _prompt_ids
from kvchat.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions


def main(method: str, length: int, rounds: int) -> None:
    engine = load_engine(ModelOptions(), on_status=lambda message: None)
    ids = _prompt_ids(engine, _fits(engine, length))
    with torch.inference_mode():
        off, on = _paired(engine, ids, [CacheSettings(method=method), CacheSettings(method=method, recall=32)], 128, rounds)
    print(f"{method} {length}, {rounds} rounds: decode {off['decode_tok_s']:.1f} / {on['decode_tok_s']:.1f} tok/s "
          f"(x{on['decode_tok_s'] / off['decode_tok_s']:.3f}); later turn {off['next_turn_ttft_s'] * 1e3:.1f} / "
          f"{on['next_turn_ttft_s'] * 1e3:.1f} ms (x{on['next_turn_ttft_s'] / off['next_turn_ttft_s']:.3f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
