"""The engine's decode loop on the real embedded model."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from kvchat.calibration.realkv import essays_text
from kvchat.settings import CacheSettings, SamplingSettings

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
    reference = out[0, len(prompt) :].tolist()
    assert len(ours) == 32
    assert ours == reference


def test_a_turn_passes_the_cache_without_a_deprecation_warning(engine):
    """transformers 5.24 renamed `past_key_values` to `cache` in Llama's forward; the old
    keyword still works there but warns, on the terminal, at every start."""
    session = engine.new_session(EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        session.send("Hi.", SamplingSettings(max_new_tokens=2))


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

    result = session.send(
        "Write a long poem about the sea.", SamplingSettings(max_new_tokens=64), on_token=on_token, cancel=cancel
    )
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


def test_streamed_pieces_join_to_the_answer_even_with_multibyte_characters(engine):
    pieces: list[str] = []
    result = engine.new_session(CacheSettings(method="window")).send(
        "Write the words café, naïve and 東京 three times.",
        SamplingSettings(max_new_tokens=40),
        on_token=pieces.append,
    )
    assert any(ord(c) > 127 for c in result.text), "the answer should exercise multi-byte characters"
    assert "".join(pieces) == result.text
    assert all("\ufffd" not in p for p in pieces)


# -- forks ----------------------------------------------------------------------------
FORK_LAYOUT = dict(budget="25%", window=1024, sinks=4, prefill_mode="exact-then-compress")
FORK_DOCUMENT = essays_text()[:2500] + "\n\nWhat is this text about?"


@pytest.mark.parametrize("base,method", [("full", "chelsea"), ("full", "subgen"), ("h2o", "bumblebee")])
def test_a_fork_of_a_held_exact_prefill_answers_like_a_fresh_session(engine, base, method):
    # The exact prefill is the same for every method (score-based ones fork from a
    # score-collecting base), so one prefill can serve them all: the fork must match a
    # session that ran `method` from the start, token for token and entry for entry.
    sampling = SamplingSettings(max_new_tokens=12)
    fresh = engine.new_session(CacheSettings(method=method, **FORK_LAYOUT))
    expected = fresh.send(FORK_DOCUMENT, sampling)

    held = engine.new_session(CacheSettings(method=base, **FORK_LAYOUT))
    logits = held.prefill_message(FORK_DOCUMENT, hold=True)
    fork = held.fork(CacheSettings(method=method, **FORK_LAYOUT))
    answer = fork.reply(logits, sampling)

    assert answer.token_ids == expected.token_ids
    assert fork.token_ids == fresh.token_ids and fork.messages == fresh.messages
    assert fork.cache.entries_per_head() == fresh.cache.entries_per_head()
    assert fork.cache.nbytes() == fresh.cache.nbytes()


def test_a_fork_leaves_the_original_untouched(engine):
    session = engine.new_session(CacheSettings(method="chelsea", budget="64", window=32))
    session.send("Name three colours.", SamplingSettings(max_new_tokens=8))
    tokens, messages, seen = list(session.token_ids), list(session.messages), session.cache.tokens_seen
    keys = session.cache.compressed_layers[0].window.keys.clone()

    fork = session.fork(CacheSettings(method="window", budget="64", window=32))
    fork.send("And three animals?", SamplingSettings(max_new_tokens=8))

    assert fork.cache.method == "window" and session.cache.method == "chelsea"
    assert session.token_ids == tokens and session.messages == messages
    assert session.cache.tokens_seen == seen and torch.equal(session.cache.compressed_layers[0].window.keys, keys)
    with pytest.raises(ValueError, match="layout"):
        session.fork(CacheSettings(method="window", budget="128", window=32))
