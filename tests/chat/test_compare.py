"""One question under several methods (kvchat.chat.compare), on the real embedded model
(float32, the exact path: there each fork answers token for token like the method alone)."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest

from kvchat.calibration.realkv import essays_text
from kvchat.chat.compare import check_methods, compare
from kvchat.settings import PREFILL_CHUNK, CacheSettings, SamplingSettings
from kvchat.turns import JSON_KEYS, SEPARATE, SHARED

# sinks 4 + middle 64 + window 64 per KV head: the ~380-token prompt is really compressed.
LAYOUT = CacheSettings(method="window", budget="64", window=64, sinks=4, batch=16, prefill_mode="exact-then-compress")
SAMPLING = SamplingSettings(max_new_tokens=8)
TEXT = essays_text()[:1500] + "\n\nWhat is this text about?"
METHODS = ["full", "window", "h2o", "subgen", "chelsea"]


@pytest.fixture(scope="module")
def compared(engine):
    """One comparison, with what the engine did for it."""
    calls, fed = engine.forward_calls, engine.tokens_fed
    streamed: dict[str, list[str]] = {}
    result = compare(
        engine,
        LAYOUT,
        SAMPLING,
        TEXT,
        METHODS,
        on_token=lambda method, piece: streamed.setdefault(method, []).append(piece),
    )
    return result, engine.forward_calls - calls, engine.tokens_fed - fed, streamed


def test_the_prompt_is_prefilled_once_for_every_method(compared):
    result, calls, fed, _ = compared
    assert result.prefill_mode == SHARED and not result.cancelled and result.note == ""
    decoded = sum(a.new_tokens for a in result.answers)
    # Besides one token per decode step, the model read the prompt once, not once per method.
    assert fed == result.prompt_tokens + decoded
    assert calls == math.ceil(result.prompt_tokens / PREFILL_CHUNK) + decoded
    assert [a.method for a in result.answers] == METHODS


@pytest.mark.parametrize("method", METHODS)
def test_each_answer_is_what_the_method_gives_when_it_prefills_by_itself(engine, compared, method):
    result, *_ = compared
    alone = engine.new_session(replace(LAYOUT, method=method))
    expected = alone.send(TEXT, SAMPLING)
    answer = next(a for a in result.answers if a.method == method)
    assert answer.answer == expected.text and answer.new_tokens == expected.metrics.new_tokens
    assert answer.kv_bytes == alone.cache.nbytes()


def test_on_the_fast_path_too_each_answer_is_the_method_alone(embedded_fast):
    """int8 weights + bf16 compute: every method reads the first prefill chunk through the
    same fused kernel, so a shared prefill (collecting scores for h2o) forks into window
    unchanged."""
    from kvchat.model.engine import Engine

    engine = Engine(embedded_fast)
    sampling = SamplingSettings(max_new_tokens=16)
    result = compare(engine, LAYOUT, sampling, TEXT, ["window", "h2o"])
    for answer in result.answers:
        alone = engine.new_session(replace(LAYOUT, method=answer.method)).send(TEXT, sampling)
        assert answer.answer == alone.text, answer.method


def test_kv_bytes_follow_the_method(engine, compared):
    result, *_ = compared
    kv = {a.method: a.kv_bytes for a in result.answers}
    per_token = engine.loaded.bytes_per_token()
    seen = result.prompt_tokens + result.answers[0].new_tokens
    assert per_token * seen <= kv["full"] < 1.1 * per_token * seen  # full keeps every token (+ positions)
    # window keeps sinks + its window (+ the batch waiting to leave it), far fewer.
    assert kv["window"] < kv["full"] / 2
    for method in ("h2o", "subgen", "chelsea"):
        assert kv["window"] <= kv[method] < kv["full"], method  # a compressed middle besides


def test_answers_stream_per_method_and_report_their_figures(compared):
    result, _, _, streamed = compared
    for answer in result.answers:
        assert "".join(streamed[answer.method]) == answer.answer
        # TTFT counts the shared prefill, then this method's fork and first token.
        assert answer.ttft_s > result.prefill_s > 0
        assert answer.decode_tokens_per_s > 0
        assert list(answer.as_json()) == list(JSON_KEYS)


def test_cancel_between_tokens_keeps_what_was_done(engine):
    cancel = threading.Event()
    pieces: list[str] = []

    def hear(method: str, piece: str) -> None:
        if method == "h2o":
            pieces.append(piece)
            cancel.set()  # stop h2o after its first piece

    result = compare(engine, LAYOUT, SAMPLING, TEXT, ["window", "h2o", "chelsea"], on_token=hear, cancel=cancel)
    assert result.cancelled
    assert [a.method for a in result.answers] == ["window", "h2o"]  # chelsea never started
    assert result.answers[0].stop_reason != "cancelled" and result.answers[1].stop_reason == "cancelled"
    assert result.answers[1].answer.startswith(pieces[0]) and result.answers[1].new_tokens <= 2


def test_cancel_during_the_prefill_stops_before_any_answer(engine):
    cancel = threading.Event()
    cancel.set()
    fed = engine.tokens_fed
    result = compare(engine, LAYOUT, SAMPLING, TEXT, ["window", "h2o"], cancel=cancel)
    assert result.cancelled and result.answers == []
    assert engine.tokens_fed == fed


def test_a_prompt_too_big_for_one_exact_prefill_is_read_once_per_method_and_says_so(engine):
    # `auto` with 1 MB for an exact prefill: this prompt's ~17 MB of exact KV does not fit.
    streaming = replace(LAYOUT, prefill_mode="auto", prefill_memory=1 << 20)
    fed = engine.tokens_fed
    result = compare(engine, streaming, SAMPLING, TEXT, ["window", "h2o"])
    assert result.prefill_mode == SEPARATE
    assert "too big for one exact prefill, so each method read it by itself" in result.note
    assert engine.tokens_fed - fed == 2 * result.prompt_tokens + sum(a.new_tokens for a in result.answers)
    alone = engine.new_session(replace(streaming, method="h2o")).send(TEXT, SAMPLING)
    assert result.answers[1].answer == alone.text


def test_a_question_after_earlier_turns_is_asked_from_the_same_starting_point(engine):
    # Under `full` nothing is dropped, so asking the second question again, with the
    # first turn read back exactly, gives the answer the conversation gave.
    session = engine.new_session(replace(LAYOUT, method="full"))
    session.send("Name a colour.", SAMPLING)
    ids, messages = list(session.token_ids), [dict(m) for m in session.messages]
    second = session.send("And a fruit?", SAMPLING)
    result = compare(
        engine,
        replace(LAYOUT, method="full"),
        SAMPLING,
        "And a fruit?",
        ["full", "window"],
        history_ids=ids,
        history_messages=messages,
        keep_sessions=True,
    )
    assert result.answers[0].answer == second.text
    assert result.answers[0].session.token_ids == session.token_ids
    assert result.answers[0].session.messages == session.messages


def test_unknown_methods_are_named_with_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown method 'nope', 'x' in --methods; choose from: full, window"):
        check_methods(["window", "nope", "x"])
    with pytest.raises(ValueError, match="no methods"):
        check_methods([" "])
    assert check_methods(["h2o", "window", "h2o"]) == ["h2o", "window"]
