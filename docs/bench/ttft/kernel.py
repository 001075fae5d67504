"""One prefill chunk's attention, side by side: PyTorch's fused CPU kernel (what kvchat ran
before) against kvchat's blocked bf16 kernel, at 2k, 6k and 8k cached tokens.

The chunk has the embedded model's shape (9 query heads, 3 KV heads, head_dim 64, 512
queries whose own keys are the cache's last). Times are CPU seconds of one thread
(`time.process_time`), medians of interleaved repeats: on a shared box, wall time at 2
threads measures the neighbours more than the kernel. Error: relative L2 distance of the
output from float32 attention on the same bf16 inputs, real queries, keys and values of
every layer of the embedded model on a 2k essay document (the chunk = the last 512).

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/ttft/kernel.py   # writes kernel.json/.md here
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
H, G, L, D = 3, 3, 512, 64
SCALE = D**-0.5
REPEATS = 9


def fused(q, k, v):
    """The call kvchat's `_attend_fused` makes: SDPA with a boolean mask, GQA enabled."""
    n = k.shape[1]
    visible = torch.ones(L, n, dtype=torch.bool)
    visible[:, n - L :] = torch.ones(L, L, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=SCALE, enable_gqa=True)[0]


def main() -> None:
    from kvchat.attention import blocked_prefill_attention, sampled_mass, weighted_attention
    from kvchat.bench import report

    rows = []
    torch.manual_seed(0)
    for n in (2048, 6144, 8192):
        q = torch.randn(H * G, L, D).bfloat16()
        k, v = torch.randn(H, n, D).bfloat16(), torch.randn(H, n, D).bfloat16()
        cases = {
            "fused SDPA": lambda: fused(q, k, v),
            "fused SDPA + mass every 8th (h2o before)": lambda: (fused(q, k, v),
                                                                sampled_mass(q, [(k, v, None, None)], SCALE, 8)),
            "blocked bf16": lambda: blocked_prefill_attention(q, k, v, None, SCALE),
            "blocked bf16 + mass every query (h2o now)": lambda: blocked_prefill_attention(q, k, v, None, SCALE, 1),
        }
        times: dict[str, list[float]] = {c: [] for c in cases}
        for f in cases.values():
            f()
        for _ in range(REPEATS):
            for c, f in cases.items():
                start = time.process_time()
                f()
                times[c].append(time.process_time() - start)
        base = statistics.median(times["fused SDPA"])
        for c, ts in times.items():
            rows.append({"cached": n, "kernel": c, "cpu_ms": statistics.median(ts) * 1000,
                         "vs_fused": statistics.median(ts) / base, "threads": torch.get_num_threads()})
            print(rows[-1], flush=True)

    # Error on real data.
    from kvchat.engine import load_engine
    from kvchat.realkv import capture_qkv, essays_text
    from kvchat.settings import ModelOptions

    engine = load_engine(ModelOptions())
    ids = torch.tensor([engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:2048]])
    errors: dict[str, list[float]] = {"fused SDPA": [], "blocked bf16": []}
    for q, k, v in capture_qkv(engine.model, ids).values():
        q = q[:, -L:]
        zeros = torch.zeros(k.shape[0], k.shape[1])
        ref, _ = weighted_attention(q.float(), k.float(), v.float(), zeros, zeros, SCALE, causal_tail=L)
        for name, out in (("fused SDPA", fused(q, k, v)), ("blocked bf16", blocked_prefill_attention(q, k, v, None,
                                                                                                       SCALE)[0])):
            errors[name].append(float((out.float() - ref).norm() / ref.norm()))
    for r in rows:
        key = "blocked bf16" if r["kernel"].startswith("blocked") else "fused SDPA"
        r["rel_error_real_mean"] = statistics.mean(errors[key])
        r["rel_error_real_max"] = max(errors[key])
    load = Path("/proc/loadavg").read_text().split()[0]
    report.write(HERE, "kernel", rows, ["cached", "kernel", "cpu_ms", "vs_fused", "rel_error_real_mean",
                                        "rel_error_real_max", "threads"],
                 title="One prefill chunk (512 queries, 9/3 heads, head_dim 64, bf16): fused SDPA vs blocked bf16",
                 notes=f"CPU ms of one thread, median of {REPEATS} interleaved repeats (load average {load} at the "
                       "end, shared box). rel_error_real: vs float32 attention on the same bf16 inputs, every layer "
                       "of the embedded model on a 2k essay document (mean, max over layers).")


if __name__ == "__main__":
    main()
