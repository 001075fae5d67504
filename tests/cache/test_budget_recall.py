"""`--recall N` under `--budget 4.5MB`: the recall index (a row per cold token, in RAM) is
held to the byte budget after every forward pass, or the turn is refused before it is
fed (docs/design.md, "Budgets")."""

from __future__ import annotations

import pytest

from kvchat.errors import InputTooLong
from kvchat.settings import CacheSettings

from .test_budget_bytes import observed  # the cache's bytes after every settle

# The real model (float32): 30 layers, 3 KV heads of 64 channels. A window token costs a
# layer ~1.5 KB and an index row 72 bytes (on a CPU) in each of the 14 layers that recall,
# so 1,600 tokens' index is ~1.6 MB, ~1.9 MB with their staging buffers, of the 4.5 MB.
LIMIT = "4.5MB"
LIMIT_BYTES = 4_500_000
WINDOW = 32
RECALL = 32
DOCUMENT_TOKENS = 1600
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def document(engine) -> list[int]:
    from kvchat.calibration.realkv import essays_text

    return engine.tokenizer(essays_text()[:9000], add_special_tokens=False).input_ids[:DOCUMENT_TOKENS]


def run(engine, document: list[int], settings: CacheSettings):
    session = engine.new_session(settings)
    session.check_fits(len(document), DECODE_STEPS)  # the turn is not refused
    sizes = observed(session)
    session.feed(document, chunk=256)
    for token in document[:DECODE_STEPS]:
        engine.forward([token], session.cache)
    return session, sizes


@pytest.mark.parametrize("method", ["window", "h2o", "chelsea"])
def test_kv_bytes_stay_within_the_budget_after_every_pass_with_recall_on(engine, document, method):
    session, sizes = run(engine, document, CacheSettings(method=method, budget=LIMIT, window=WINDOW, recall=RECALL))
    cache = session.cache
    index = sum(layer.recall.nbytes() for layer in cache.compressed_layers)
    assert len(sizes) >= DOCUMENT_TOKENS // 256 + DECODE_STEPS
    assert max(sizes) <= LIMIT_BYTES
    assert index > 0.4 * LIMIT_BYTES  # the index is a large share of the bytes: it was counted, not dodged
    # What the budget plans the index by is what it holds (every row's bias refreshed by
    # the last pass's recall).
    tier = next(layer.recall for layer in cache.compressed_layers if layer.recalls)
    rows = tier.rows  # the rows staged since the last recall are written first
    assert tier.nbytes() == rows * tier.bytes_per_row() + tier.fixed_bytes()
    if method == "window":
        assert cache.allocation.byte_window < cache.allocation.planned_window  # the window made room
    else:
        assert max(cache.layer_budgets()) < max(cache.allocation.allowance)  # the middles made room
        assert cache.allocation.byte_window == WINDOW  # a window given explicitly is kept


def test_a_window_the_budget_sized_shrinks_once_the_middles_are_spent(engine, document):
    session, sizes = run(
        engine, document, CacheSettings(method="h2o", budget="3.5MB", window=1024, fit_window=True, recall=RECALL)
    )
    allocation = session.cache.allocation
    assert max(sizes) <= 3_500_000
    assert session.cache.layer_budgets() == [0] * 30
    assert 1 <= allocation.byte_window < allocation.planned_window


def test_a_lowered_window_is_kept_by_a_fork_and_a_snapshot(engine, document):
    session, _ = run(engine, document, CacheSettings(method="window", budget=LIMIT, recall=RECALL))
    cache = session.cache
    assert cache.meta()["byte_window"] == cache.allocation.byte_window
    assert cache.copy().targets(cache.tokens_seen) == cache.targets(cache.tokens_seen)


@pytest.mark.parametrize(("method", "fit"), [("window", False), ("h2o", False), ("chelsea", True)])
def test_a_turn_whose_recall_index_would_pass_the_budget_is_refused_before_feeding(engine, document, method, fit):
    session = engine.new_session(
        CacheSettings(method=method, budget="3MB", window=WINDOW, fit_window=fit, recall=RECALL)
    )
    with pytest.raises(
        InputTooLong,
        match=r"the recall index keeps 1,008 bytes in RAM for every token.*passes "
        r"--budget 3MB: raise `--budget`, turn recall off \(`--recall off`\), "
        r"or start a new session",
    ):
        session.check_fits(2 * len(document), DECODE_STEPS)  # 3,200 tokens: ~3.2 MB of index rows
    assert session.cache.tokens_seen == 0
    session.check_fits(200, DECODE_STEPS)  # a short turn still fits


def test_recall_off_plans_no_index(engine):
    session = engine.new_session(CacheSettings(method="window", budget=LIMIT, window=WINDOW))
    assert session.cache.index_bytes_per_token() == 0
    assert "byte_window" not in session.cache.meta()
    session.check_fits(100_000 // 100, DECODE_STEPS)
