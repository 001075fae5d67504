"""A turn that cannot fit the model's positions is refused before any work, with the
way out; on the real model (8,192 positions)."""

from __future__ import annotations

import pytest

from kvchat.errors import InputTooLong
from kvchat.settings import CacheSettings, SamplingSettings

LONG = 9_000  # tokens: more than the model's 8,192 positions


@pytest.fixture(scope="module")
def long_text(engine):
    from kvchat.calibration.realkv import essays_text

    ids = engine.tokenizer(essays_text(), add_special_tokens=False).input_ids[:LONG]
    return engine.tokenizer.decode(ids)


def test_full_refuses_a_long_input_before_feeding_anything(engine, long_text):
    session = engine.new_session(CacheSettings(method="full"))
    calls = engine.forward_calls
    with pytest.raises(InputTooLong) as refused:
        session.send(long_text + "\n\nWhat is it about?", SamplingSettings(max_new_tokens=16))
    message = str(refused.value)
    assert "`full` holds at most 8,192" in message and "use a compressing method, e.g. `--method h2o`" in message
    assert engine.forward_calls == calls and session.token_ids == [] and session.messages == []


def test_full_counts_the_answer_tokens_against_the_positions(engine):
    session = engine.new_session(CacheSettings(method="full"))
    session.check_fits(8_000, 100)
    with pytest.raises(InputTooLong, match="up to 500 answer tokens"):
        session.check_fits(8_000, 500)


def test_a_compressing_method_takes_the_same_input_by_streaming_it(engine):
    session = engine.new_session(CacheSettings(method="h2o"))
    session.check_fits(LONG, 512)  # auto prefill streams what an exact prefill could not hold


def test_an_explicit_exact_prefill_of_a_long_input_is_refused_with_the_streaming_way_out(engine):
    session = engine.new_session(CacheSettings(method="h2o", prefill_mode="exact-then-compress"))
    with pytest.raises(InputTooLong, match="`--prefill streaming`"):
        session.check_fits(LONG, 16)


def test_a_percentage_budget_that_would_outgrow_the_positions_is_refused(engine):
    session = engine.new_session(CacheSettings(method="h2o", budget="90%"))
    with pytest.raises(InputTooLong, match="lower `--budget` or `--window`"):
        session.check_fits(LONG, 16)
    engine.new_session(CacheSettings(method="h2o", budget="25%")).check_fits(LONG, 16)
