"""One layer's offline greedy (3,068 held tokens, 3 KV heads of 64 channels, bf16, budget
1,024, one thread) and the kernel's share of it: best of 5 of the whole `ingest` and of
the time inside `_greedy.greedy` (the rest: the n x n cosine products, the picks' own
neighbours, the pool's arrays).

    python docs/bench/greedy-native/kernel_share.py
"""

from __future__ import annotations

import time

import torch

from kvchat import compress
from kvchat.compress import bumblebee
from kvchat.compress.base import LayerSpec

N, BUDGET = 3068, 1024


class _Timed:
    """`_greedy` with its `greedy` calls timed."""

    def __init__(self, module) -> None:
        self.module, self.seconds = module, 0.0

    def greedy(self, *args):
        start = time.perf_counter()
        self.module.greedy(*args)
        self.seconds += time.perf_counter() - start

    def vector(self) -> bool:
        return self.module.vector()


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, N, 64, generator=generator).to(torch.bfloat16)
    scores = torch.rand(3, 3, N, generator=generator)
    timed = _Timed(bumblebee._greedy)
    bumblebee._greedy = timed
    layer, kernel = [], []
    for _ in range(5):
        timed.seconds = 0.0
        bee = compress.make("bumblebee", LayerSpec(0, 3, 3, 64, torch.device("cpu"), torch.bfloat16, 0), BUDGET)
        start = time.perf_counter()
        bee.ingest(keys, keys, torch.arange(N).expand(3, -1).contiguous(), scores=scores)
        layer.append(time.perf_counter() - start)
        kernel.append(timed.seconds)
    print(f"one layer {1e3 * min(layer):.1f} ms, of which the greedy kernel {1e3 * min(kernel):.1f} ms")


if __name__ == "__main__":
    main()
