"""Time to first token of a long document, every method on the fast path, against float32
transformers `generate`, for one source tree (issue #20, the long-document row).

Run it once per tree, alternately, so that a shared machine's load falls on both alike:

    git worktree add /tmp/base-ttft <commit>          # the tree to compare against
    for i in 1 2 3; do
      PYTHONPATH=/tmp/base-ttft .venv/bin/python docs/bench/ttft/bench.py --tree base
      .venv/bin/python docs/bench/ttft/bench.py --tree after
    done
    .venv/bin/python docs/bench/ttft/summary.py       # tables and plots from results.jsonl

Each run appends one JSON line per measurement to results.jsonl beside this file: tree,
method, context, ttft wall seconds, the process's CPU seconds over the same span, the
threads in use and the 1-minute load average. Per context the document is the first
`context` tokens of the essays (`kvchat.realkv.essays_text`), read as one message:
`ChatSession.feed` with the app's prefill mode (exact-then-compress while it fits, then
the compression), then the first token's argmax, as `kvchat bench speed` times it.

`--agreement N`: also N greedy tokens after the 2k and 6k documents under `full`, saved
so that summary.py compares them with float32 (`--tree exact` runs the float32 path).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
METHODS = ("full", "window", "h2o", "subgen", "balancekv", "bumblebee", "chelsea")
CONTEXTS = (2048, 6144, 8192)


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else -1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", required=True, help="label of the source tree on PYTHONPATH (base, after, exact)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                        help="also time float32 transformers generate (its first token)")
    parser.add_argument("--agreement", type=int, default=0, help="greedy tokens after the 2k/6k document (full)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=str(HERE / "results.jsonl"))
    args = parser.parse_args()

    import kvchat
    from kvchat.engine import load_engine
    from kvchat.realkv import essays_text
    from kvchat.settings import CacheSettings, ModelOptions

    engine = load_engine(ModelOptions(dtype=args.dtype))
    ids_all = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    limit = engine.loaded.max_positions - 129  # what `kvchat bench speed` measures at 8k (8,063)
    out = open(args.out, "a")

    def record(**row) -> None:
        row.update(tree=args.tree, source=str(Path(kvchat.__file__).parent), precision=engine.loaded.precision,
                   threads=torch.get_num_threads(), load1=load(), when=time.time())
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(row, flush=True)

    exact = None
    if args.generate:
        from kvchat.models import load_model

        exact = engine.model if engine.loaded.precision == "float32" else load_model(None, device="cpu",
                                                                                      dtype="float32").model
    with torch.inference_mode():
        # Warm-up: the first forward pass of a process pays one-off costs.
        engine.new_session(CacheSettings()).feed(ids_all[:600])
        for length in contexts:
            context = min(length, limit)
            ids = ids_all[:context]
            if exact is not None:
                previous = exact.config._attn_implementation
                exact.set_attn_implementation("sdpa")
                try:
                    wall, cpu = time.perf_counter(), time.process_time()
                    exact(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
                    record(method="generate (fp32)", context=length, context_tokens=context,
                           ttft_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)
                finally:
                    exact.set_attn_implementation(previous)
            for method in methods:
                engine.threads.adjust(force=True)
                session = engine.new_session(CacheSettings(method=method, budget="1024"))
                wall, cpu = time.perf_counter(), time.process_time()
                logits, mode = session.feed(ids)
                token = int(torch.argmax(logits))
                ttft, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
                row = dict(method=method, context=length, context_tokens=context, ttft_s=ttft, cpu_s=cpu_s,
                           compress_s=session.cache.compress_seconds, prefill_mode=mode)
                if args.agreement and method == "full" and length in (2048, 6144):
                    tokens = [token]
                    for _ in range(args.agreement - 1):
                        tokens.append(int(torch.argmax(engine.forward([tokens[-1]], session.cache))))
                    row["greedy"] = tokens
                record(**row)
    out.close()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
