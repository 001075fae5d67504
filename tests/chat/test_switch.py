"""Switching method mid-conversation (ctrl+t): the next method gets real tokens, or an
honest rebuild from the transcript when the old state holds none."""

from __future__ import annotations

import pytest
import torch

from kvchat.settings import CacheSettings

pytestmark = pytest.mark.slow  # the real embedded model

# A small budget so that 600 tokens push subgen's stream mode into sampling.
SETTINGS = dict(budget="96", window=64, sinks=4, batch=32)
PROMPT_TOKENS = 600


@pytest.fixture(scope="module")
def essay_ids(engine):
    from kvchat.calibration.realkv import essays_text

    ids = engine.tokenizer(essays_text()[:6000], add_special_tokens=False).input_ids
    return ids[: PROMPT_TOKENS + 32]


def session_after(engine, method, params, ids):
    session = engine.new_session(CacheSettings(method=method, params=params, **SETTINGS))
    session.feed(ids)
    return session


def real_entries(middle):
    return torch.isfinite(middle.log_num) | torch.isfinite(middle.log_den)


def test_subgen_stream_samples_are_not_handed_over_as_tokens(engine, essay_ids):
    session = session_after(engine, "subgen", {"mode": "stream"}, essay_ids[:PROMPT_TOKENS])
    # Its denominator samples hold no values: a switch may not re-stream them.
    assert all(layer.compressor.tokens() is None for layer in session.cache.compressed_layers)
    assert session.cache.switch_method("h2o") is False
    assert session.cache.method == "subgen", "a refused re-stream changes nothing"


def test_switch_from_subgen_stream_to_h2o_equals_h2o_from_scratch(engine, essay_ids):
    prompt, following = essay_ids[:PROMPT_TOKENS], essay_ids[PROMPT_TOKENS:]
    switched = session_after(engine, "subgen", {"mode": "stream"}, prompt)
    assert switched.switch_method("h2o") is False, "rebuilt from the transcript, not re-streamed"
    scratch = session_after(engine, "h2o", {}, prompt)
    # The rebuild re-prefills the same tokens through h2o: every layer's middle is the
    # same entries, bit for bit (same computation, same order)...
    for ours, theirs in zip(switched.cache.compressed_layers, scratch.cache.compressed_layers):
        assert ours.compressor.name == "h2o"
        for name in ("keys", "values", "positions", "log_num", "log_den"):
            assert torch.equal(getattr(ours.middle, name), getattr(theirs.middle, name)), name
    # ... so the following tokens see the same cache: their logits agree to float rounding.
    ours, _ = switched.feed(following)
    theirs, _ = scratch.feed(following)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_after_a_switch_from_subgen_no_entry_is_a_zero_value_placeholder(engine, essay_ids):
    session = session_after(engine, "subgen", {"mode": "stream"}, essay_ids[:PROMPT_TOKENS])
    session.switch_method("h2o")
    for layer in session.cache.compressed_layers:
        middle = layer.middle
        zero_value = (middle.values == 0).all(-1)
        assert not (zero_value & real_entries(middle)).any()
        assert real_entries(middle).sum(1).min() > 0


def test_switch_from_subgen_kcenter_restreams_its_tokens_without_recompute(engine, essay_ids):
    session = session_after(engine, "subgen", {"mode": "kcenter"}, essay_ids[:PROMPT_TOKENS])
    old = [layer.middle for layer in session.cache.compressed_layers]
    assert session.switch_method("h2o") is True
    for layer, before in zip(session.cache.compressed_layers, old):
        new = layer.middle
        assert new.length > 0
        # Every entry h2o holds is one of kcenter's tokens, key, value and position unchanged.
        for h in range(new.positions.shape[0]):
            index = (new.positions[h][:, None] == before.positions[h][None, :]).int().argmax(1)
            assert torch.equal(before.positions[h][index], new.positions[h])
            assert torch.equal(before.keys[h][index], new.keys[h])
            assert torch.equal(before.values[h][index], new.values[h])
