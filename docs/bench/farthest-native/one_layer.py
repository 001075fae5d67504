"""One layer's farthest-first (3 KV heads of 64 channels, 5,900 points, 772 centres: a 6k
prefill's layer at budget 25%) with the torch loop and with kvchat's kernel, on random
keys in bf16 and float32; `rounds` timings each, alternated, and whether the centres and
owners are the same.

    python docs/bench/farthest-native/one_layer.py 5
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvchat.compress import _kcenter


def main(rounds: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        keys = (3 * torch.randn(3, 5900, 64, generator=generator)).to(dtype)
        times: dict[bool, list[float]] = {False: [], True: []}
        result = {}
        for _ in range(rounds):
            for native in (False, True):
                _kcenter.NATIVE_FARTHEST = native
                start = time.perf_counter()
                result[native] = _kcenter.farthest_first(keys, 772, track_owner=True)
                times[native].append(time.perf_counter() - start)
        _kcenter.NATIVE_FARTHEST = True
        same = all(torch.equal(a, b) for a, b in zip(result[False], result[True]))
        print(f"{str(dtype):15s} torch {1000 * statistics.median(times[False]):6.1f} ms, "
              f"kernel {1000 * statistics.median(times[True]):6.1f} ms; same centres and owners: {same}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
