"""Per-call timings of the research compressors at the speed bench's 8k shapes, two
versions side by side in one process, with a check that they keep identical entries.

Setup as in `kvchat bench speed` at 8k: budget 1024 middle entries, 3 KV heads x 3 query
heads, d 64; the document's middle (8,063 - 4 sinks - 1,024 window tokens) is ingested in
one flush, then 64-token batches stream in (bumblebee observes 64 random attention
steps before each). Reported per layer: the flush, the mean ingest of a 64-token batch
(2 worst dropped), observe, and the amortised cost per decoded token over 30 layers
(30 x ingest / 64 + 30 x observe).

    python docs/bench/compressor-share/capture_qkv.py /tmp/qkv8k.pt
    git archive <old commit> kvchat | tar -x -C /tmp/old && mv /tmp/old/kvchat /tmp/old/kvchat_before
    OMP_NUM_THREADS=1 PYTHONPATH=.:/tmp/old python docs/bench/compressor-share/micro.py --qkv /tmp/qkv8k.pt
    # the engine's defaults instead (torch on 2 threads, NumPy's BLAS on its own pool):
    TT=2 PYTHONPATH=.:/tmp/old python docs/bench/compressor-share/micro.py --qkv /tmp/qkv8k.pt --layers 15
"""

import argparse
import importlib
import os
import statistics
import time

import torch

torch.set_num_threads(int(os.environ.get("TT", "1")))
ap = argparse.ArgumentParser()
ap.add_argument("--qkv", required=True)
ap.add_argument("--methods", default="subgen,bumblebee,balancekv,chelsea")
ap.add_argument("--layers", default="1,15,28")
ap.add_argument("--batches", type=int, default=24)
ap.add_argument("--pkgs", default="kvchat_before,kvchat")
args = ap.parse_args()
data = torch.load(args.qkv)
WINDOW, SINKS, BUDGET, BATCH, LAYERS = 1024, 4, 1024, 64, 30


def run(pkg: str, method: str, layer: int):
    compress = importlib.import_module(pkg + ".compress")
    base = importlib.import_module(pkg + ".compress.base")
    _, k, v = data[layer]
    h, n, d = k.shape
    comp = compress.make(method, base.LayerSpec(layer, h, 3, d, torch.device("cpu"), torch.bfloat16, 0), BUDGET)
    gen = torch.Generator().manual_seed(layer)
    attention = type(comp).needs_attention

    def scores(b: int):
        return torch.rand(h, 3, b, generator=gen).pow(4) * 5 if attention else None

    flush = n - SINKS - WINDOW
    pos = torch.arange(n).expand(h, n)
    part = slice(SINKS, SINKS + flush)
    start = time.perf_counter()
    comp.ingest(k[:, part].contiguous(), v[:, part].contiguous(), pos[:, part].contiguous(), scores=scores(flush))
    flush_s = time.perf_counter() - start
    ingest, observe = [], []
    for i in range(args.batches):
        s = SINKS + flush + (i * BATCH) % WINDOW  # the window's tokens, again with new positions
        if attention:
            for _ in range(BATCH):
                mass = torch.rand(h, 3, comp.entries().length, generator=gen) * 1e-3
                t0 = time.perf_counter()
                comp.observe(mass)
                observe.append(time.perf_counter() - t0)
        p = torch.arange(n + i * BATCH, n + (i + 1) * BATCH).expand(h, BATCH).contiguous()
        t0 = time.perf_counter()
        comp.ingest(k[:, s : s + BATCH].contiguous(), v[:, s : s + BATCH].contiguous(), p, scores=scores(BATCH))
        ingest.append(time.perf_counter() - t0)
    return flush_s, ingest, observe, comp.entries()


pkgs = args.pkgs.split(",")
for method in args.methods.split(","):
    for layer in map(int, args.layers.split(",")):
        kept = {}
        for pkg in pkgs:
            flush_s, ingest, observe, kept[pkg] = run(pkg, method, layer)
            ing = statistics.mean(sorted(ingest)[: max(1, len(ingest) - 2)]) * 1e3
            obs = statistics.median(observe) * 1e3 if observe else 0.0
            print(f"{method:9s} L{layer:2d} {pkg:13s} flush {flush_s * 1e3:8.1f} ms  ingest mean {ing:7.2f} ms "
                  f"(min {min(ingest) * 1e3:6.2f})  observe {obs * 1e3:6.1f} us  "
                  f"amortised {LAYERS * (ing / BATCH + obs):6.3f} ms/token", flush=True)
        if len(pkgs) == 2:
            a, b = kept[pkgs[0]], kept[pkgs[1]]
            same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("keys", "values", "positions", "log_num", "log_den"))
            print(f"   identical entries after the stream: {same}")
