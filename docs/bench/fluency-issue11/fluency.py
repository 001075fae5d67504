"""Run from the repo root as: PYTHONPATH=. python docs/bench/fluency-issue11/fluency.py

Fluency check: 5 questions at 25% of ~2k-token essay documents (document + question in one message)."""
import time

from kvchat.cli import build_parser, load_engine
from kvchat.realkv import essays_text
from kvchat.settings import CacheSettings, SamplingSettings

args = build_parser().parse_args(["bench", "attention"])
engine = load_engine(args)
tok = engine.tokenizer
ids = tok(essays_text(), add_special_tokens=False).input_ids
questions = [
    "What is the main point of this essay?",
    "According to the text, what should a founder do first?",
    "Summarize the passage in two sentences.",
    "What example does the author use, and why?",
    "What is the author's advice in this passage?",
]
methods = [("subgen", {}), ("balancekv", {})]
for i, q in enumerate(questions):
    doc = tok.decode(ids[i * 2000 + 5000 : i * 2000 + 5000 + 1900])
    prompt = f"{doc}\n\n{q}"
    for method, params in methods:
        session = engine.new_session(CacheSettings(method=method, budget="25%", params=params))
        t = time.perf_counter()
        result = session.send(prompt, SamplingSettings(max_new_tokens=60, temperature=0.0))
        print(f"## doc {i+1} | {method} {params} | prompt {result.metrics.prompt_tokens} tok | {time.perf_counter()-t:.0f}s\nQ: {q}\nA: {result.text!r}\n", flush=True)
