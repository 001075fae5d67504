"""The engine's decode loop on the real embedded model."""

from __future__ import annotations

import threading

import torch

from kvchat.engine import CacheSettings, SamplingSettings
from kvchat.realkv import essays_text

EXACT = CacheSettings(method="full", budget="100000")


def test_full_cache_greedy_matches_transformers_generate(engine):
    session = engine.new_session(EXACT)
    text = essays_text()[:6500] + "\n\nSummarize the text above."
    prompt = session.prompt_ids(text)
    assert 1400 <= len(prompt) <= 1700
    ours = session.send(text, SamplingSettings(max_new_tokens=32)).token_ids

    model = engine.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    finally:
        model.set_attn_implementation("kvchat")
    reference = out[0, len(prompt):].tolist()
    assert len(ours) == 32
    assert ours == reference


def test_second_turn_feeds_only_the_new_message(engine):
    session = engine.new_session(EXACT)
    session.send("What is the capital of France?", SamplingSettings(max_new_tokens=16))
    fed_before = len(session.token_ids)
    result = session.send("And of Germany?", SamplingSettings(max_new_tokens=16))
    # the closing tags of the first answer + the new user turn + the generation prompt
    assert result.metrics.prompt_tokens < 20
    assert len(session.token_ids) == fed_before + result.metrics.prompt_tokens + len(result.token_ids)
    assert "Berlin" in result.text


def test_sampling_is_deterministic_under_a_seed(engine):
    sampling = SamplingSettings(max_new_tokens=16, temperature=0.8, top_p=0.9)
    answers = [
        engine.new_session(CacheSettings(method="window", seed=7)).send("Tell me a story.", sampling).token_ids
        for _ in range(2)
    ]
    assert answers[0] == answers[1]


def test_cancel_stops_between_tokens_and_keeps_the_partial_answer(engine):
    session = engine.new_session(EXACT)
    cancel = threading.Event()
    pieces: list[str] = []

    def on_token(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            cancel.set()

    result = session.send("Write a long poem about the sea.", SamplingSettings(max_new_tokens=64),
                          on_token=on_token, cancel=cancel)
    assert result.cancelled and result.stop_reason == "cancelled"
    assert 3 <= len(result.token_ids) < 64
    assert session.messages[-1] == {"role": "assistant", "content": result.text}
    assert result.text.startswith("".join(pieces[:3]))


def test_turn_metrics_are_filled(engine):
    result = engine.new_session(CacheSettings(method="window")).send("Hi!", SamplingSettings(max_new_tokens=8))
    m = result.metrics
    assert m.prompt_tokens > 0 and m.new_tokens > 0
    assert m.prefill_tokens_per_s > 0 and m.decode_tokens_per_s > 0 and m.ttft_s > 0
    assert m.kv_bytes > 0 and m.rss_bytes > 0
