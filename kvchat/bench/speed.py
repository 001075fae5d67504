"""`kvchat bench speed`.

Part 1 — our decode loop against transformers' `generate` (exact cache on both sides),
side by side on the same prompt, at prompt lengths 256 / 2k / 6k: prefill and decode
tokens/s. Part 2 — every method at a fixed budget, decode tokens/s and KV MB against
context length, plus the share of decode time spent inside compressors.
"""

from __future__ import annotations

import time

import torch

from ..settings import BenchOptions
from . import report

NEW_TOKENS = 32


def _prompt_ids(engine, length: int) -> list[int]:
    from ..realkv import essays_text

    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


@torch.inference_mode()
def _ours(engine, ids: list[int], settings, new_tokens: int) -> dict[str, float]:
    session = engine.new_session(settings)
    start = time.perf_counter()
    logits, _ = session.feed(ids)
    prefill_s = time.perf_counter() - start
    compress_before = session.cache.compress_seconds
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = int(torch.argmax(logits))
        logits = engine.forward([token], session.cache)
    decode_s = time.perf_counter() - start
    return {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": new_tokens / decode_s,
        "compress_share": (session.cache.compress_seconds - compress_before) / decode_s,
        "kv_mb": session.cache.nbytes() / 2**20,
        "entries_per_head": session.cache.entries_per_head(),
    }


@torch.inference_mode()
def _transformers(engine, ids: list[int], new_tokens: int) -> dict[str, float]:
    model = engine.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        inputs = torch.tensor([ids], device=engine.loaded.device)
        start = time.perf_counter()
        model.generate(inputs, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(inputs, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False)
        total = time.perf_counter() - start
    finally:
        model.set_attn_implementation(previous)
    return {"prefill_tok_s": len(ids) / first, "decode_tok_s": new_tokens / max(total - first, 1e-9)}


def loop_vs_generate(engine, lengths: list[int], repeats: int) -> list[dict]:
    from ..engine import CacheSettings

    rows = []
    exact = CacheSettings(method="full", budget="1000000", window=1024, prefill_mode="exact-then-compress")
    _ours(engine, _prompt_ids(engine, 64), exact, 4)  # warm-up
    _transformers(engine, _prompt_ids(engine, 64), 4)
    for length in lengths:
        ids = _prompt_ids(engine, length)
        best_ours, best_hf = None, None
        for _ in range(repeats):  # interleaved, best of `repeats` for each side
            o = _ours(engine, ids, exact, NEW_TOKENS)
            h = _transformers(engine, ids, NEW_TOKENS)
            best_ours = o if best_ours is None or o["decode_tok_s"] > best_ours["decode_tok_s"] else best_ours
            best_hf = h if best_hf is None or h["decode_tok_s"] > best_hf["decode_tok_s"] else best_hf
        rows.append({
            "prompt_tokens": length,
            "ours_decode_tok_s": best_ours["decode_tok_s"], "generate_decode_tok_s": best_hf["decode_tok_s"],
            "decode_ratio": best_ours["decode_tok_s"] / best_hf["decode_tok_s"],
            "ours_prefill_tok_s": best_ours["prefill_tok_s"], "generate_prefill_tok_s": best_hf["prefill_tok_s"],
        })
        print(rows[-1], flush=True)
    return rows


def methods_vs_context(engine, methods: list[str], lengths: list[int], budget: str) -> list[dict]:
    from ..engine import CacheSettings

    rows = []
    for length in lengths:
        for method in methods:
            # Up to the model's trained context every method is measured at the same length,
            # as close to `length` as fits with the new tokens (8k -> 8,160): the exact cache
            # cannot go further, and the others would re-rotate their keys (position
            # compaction, a one-off every few thousand tokens) inside the 32 measured steps.
            # Beyond it, the exact cache is skipped.
            fits = engine.loaded.max_positions - NEW_TOKENS
            if method == "full" and length > engine.loaded.max_positions:
                continue
            context = min(length, fits) if length <= engine.loaded.max_positions else length
            settings = CacheSettings(method=method, budget=budget, prefill_mode="streaming")
            r = _ours(engine, _prompt_ids(engine, context), settings, NEW_TOKENS)
            rows.append({"method": method, "context": length, "context_tokens": context, **r})
            print(rows[-1], flush=True)
    return rows


def run(options: BenchOptions) -> int:
    from ..compress import available

    engine = options.model.load_engine()
    quick = options.quick
    lengths = list(options.lengths or ([256, 1024] if quick else [256, 2048, 6144]))
    part1 = [] if options.skip_loop else loop_vs_generate(engine, lengths, repeats=1 if quick else 2)
    methods = list(options.methods or available())
    contexts = list(options.contexts or ([1024, 2048] if quick else [1024, 2048, 4096, 8192, 16384]))
    part2 = methods_vs_context(engine, methods, contexts, "1024")
    out = options.out
    if part1:
        report.write(out, "speed_loop", part1,
                     ["prompt_tokens", "ours_decode_tok_s", "generate_decode_tok_s", "decode_ratio",
                      "ours_prefill_tok_s", "generate_prefill_tok_s"],
                     title="Decode loop vs transformers generate (exact cache, greedy, 32 new tokens)",
                     notes="Side by side in one run, best of interleaved repeats for each side.")
    report.write(out, "speed_methods", part2,
                 ["method", "context", "context_tokens", "decode_tok_s", "kv_mb", "entries_per_head", "compress_share", "prefill_tok_s"],
                 title="Decode speed and KV memory against context (budget 1024 middle entries, window 1024, 4 sinks)",
                 notes="Streaming prefill; 32 greedy new tokens after the context; compress_share = time inside "
                       "compressors / decode time.")
    by_method: dict[str, tuple[list[float], list[float]]] = {}
    mem: dict[str, tuple[list[float], list[float]]] = {}
    for r in part2:
        by_method.setdefault(r["method"], ([], []))
        by_method[r["method"]][0].append(r["context"])
        by_method[r["method"]][1].append(r["decode_tok_s"])
        mem.setdefault(r["method"], ([], []))
        mem[r["method"]][0].append(r["context"])
        mem[r["method"]][1].append(r["kv_mb"])
    report.plot(out, "speed_decode", by_method, xlabel="context tokens", ylabel="decode tokens/s",
                title="Decode speed vs context", logx=True)
    report.plot(out, "speed_kv_mb", mem, xlabel="context tokens", ylabel="KV MB", title="KV memory vs context", logx=True)
    print(f"reports written to {out}/")
    return 0
