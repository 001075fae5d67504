"""Past the trained window, on the embedded model (8,192 positions): what the recall tier
reads back once positions have been compacted (kvchat/recall/tier.py, "Recalled rows sit
just before the window" and "A chunk pins blocks for every layer" in docs/design.md).

- a number planted in the middle of a 16k-token document is answered;
- a fact given in the first turn is answered after more than 8k tokens of conversation.
"""

from __future__ import annotations

import pytest

from kvchat.bench.recall import fit_tokens, is_correct, needle_probe
from kvchat.calibration.realkv import essays_text
from kvchat.settings import DEFAULT_RECALL, CacheSettings, SamplingSettings
from kvchat.turns import user_message

pytestmark = pytest.mark.slow

ANSWER = SamplingSettings(max_new_tokens=12)


def test_a_number_planted_in_the_middle_of_a_16k_document_is_answered(engine):
    probe = needle_probe(engine, essays_text(), 16384, 0.5, 40500)
    session = engine.new_session(CacheSettings(recall=DEFAULT_RECALL))
    answer = session.send(user_message(probe.question, probe.document), ANSWER).text
    assert session.cache.compactions >= 1  # past the trained window
    assert is_correct(answer, probe.answer), answer


def test_a_fact_from_the_first_turn_is_answered_after_8k_tokens_of_conversation(engine):
    session = engine.new_session(CacheSettings(recall=DEFAULT_RECALL))
    session.send(user_message("Remember this: the password for the vault is 7316."), ANSWER)
    essay = fit_tokens(engine, essays_text(), 9000)
    session.send(user_message("Summarize this essay in one sentence.", essay), ANSWER)
    answer = session.send(user_message("What is the password for the vault?"), ANSWER).text
    assert session.cache.tokens_seen > 8192 and session.cache.compactions >= 1
    assert "7316" in answer, answer
