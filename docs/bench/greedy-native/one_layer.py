"""One layer's offline greedy as a 4k prefill's flush runs it (3,068 held tokens, 3 KV
heads of 64 channels, bf16, budget 1,024, one thread), the Python loop against kvchat's
kernel, alternated; best of `rounds` each, in ms, and the kept tokens compared.

    python docs/bench/greedy-native/one_layer.py 5
"""

from __future__ import annotations

import sys
import time

import torch

from kvchat import compress
from kvchat.compress import bumblebee
from kvchat.compress.base import LayerSpec

N, BUDGET = 3068, 1024


def ingest(enabled: bool, keys: torch.Tensor, scores: torch.Tensor) -> tuple[float, torch.Tensor]:
    bumblebee.NATIVE_GREEDY = enabled
    bee = compress.make("bumblebee", LayerSpec(0, 3, 3, 64, torch.device("cpu"), torch.bfloat16, 0), BUDGET)
    start = time.perf_counter()
    bee.ingest(keys, keys, torch.arange(N).expand(3, -1).contiguous(), scores=scores)
    return (time.perf_counter() - start) * 1e3, bee.entries().positions


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, N, 64, generator=gen).bfloat16()
    scores = torch.rand(3, 3, N, generator=gen)
    best = {True: float("inf"), False: float("inf")}
    kept = {}
    for _ in range(rounds):
        for enabled in (False, True):
            ms, kept[enabled] = ingest(enabled, keys, scores)
            best[enabled] = min(best[enabled], ms)
    bumblebee.NATIVE_GREEDY = True
    print(f"one layer: Python loop {best[False]:.0f} ms, kernel {best[True]:.0f} ms; "
          f"same tokens kept: {torch.equal(kept[True], kept[False])}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
