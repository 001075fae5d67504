"""The recall tier past the trained window (kvchat/cache/positions.py, kvchat/recall/tier.py): a
compaction re-packs the hot cache's positions, and the tier moves with it instead of
starting again. Its rows are numbered by token; each cold token moves to a position
between those of the held entries around its token (fractional), in order; its stored key
(before RoPE) is not rewritten, the index is quantised again from the keys turned there.

- a planted key that only the tier holds is still found after a compaction and attended
  at its new position;
- through a model pushed past a tiny position limit, every token that left the window
  stays in the tier, in order, between the sinks and the window; rows the middle holds
  exactly are still never recalled;
- a session saved after compactions resumes with the same tier (keys and positions), and
  answers as the one held in one process, through further compactions;
- so does a layer that does not recall (its tier counts rows, no index).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_llama import build_tiny_llama, engine_for, random_ids

from kvchat.cache import positions
from kvchat.kv_types import rerotate
from kvchat.settings import CacheSettings
from kvchat.storage.db import Store

from .test_recall import COLD, PLANTED, SINKS, WINDOW, D, H, exact_over, planted_layer


def rope_freq(dim: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))


def test_a_planted_key_is_still_recalled_after_a_compaction():
    layer, (query, _keys, _values) = planted_layer(recall=1, inv_freq=rope_freq(D))
    tier = layer.recall
    every = torch.arange(COLD).expand(H, -1)
    stored, file = tier.store.read(every), tier.store.own
    attended, _ = tier.read(every)
    total = SINKS + COLD + WINDOW + 1
    _, _, shift = positions.compact([layer], next_position=total, sinks=SINKS, boundary=0, shift=0)
    assert tier.rows == COLD and tier.shift == shift  # kept, not started again
    # The rows on disk carry no position: none is rewritten.
    assert tier.store.own is file and all(torch.equal(a, b) for a, b in zip(tier.store.read(every), stored))
    # No middle (`window`): every cold token lies between the last sink and the window,
    # in order, its key turned by the distance it moved.
    moved = tier.cold_pos
    assert bool((moved > SINKS - 1).all() and (moved < int(layer.window.pos[0])).all())
    assert bool((moved[:, 1:] > moved[:, :-1]).all())
    after, values = tier.read(every)
    old = torch.arange(SINKS, SINKS + COLD).float().expand(H, -1)
    torch.testing.assert_close(after, rerotate(attended, moved - old, rope_freq(D)), rtol=0, atol=1e-5)
    rows, ok = tier.select(query, r=1)
    assert rows.tolist() == [[PLANTED]] * H and bool(ok.all())
    scale = 1 / math.sqrt(D)
    out = layer.attend(query, scale, new_tokens=1)
    planted = slice(PLANTED, PLANTED + 1)
    torch.testing.assert_close(
        out, exact_over(layer, query, after[:, planted], values[:, planted], scale), rtol=1e-5, atol=1e-5
    )


@pytest.fixture(scope="module")
def tiny():
    return engine_for(build_tiny_llama())


def settings(method: str = "h2o") -> CacheSettings:
    return CacheSettings(method=method, budget="32", window=32, sinks=4, batch=16, recall=16)


def feed(engine, cache, ids, chunk=40):
    out = None
    for start in range(0, len(ids), chunk):
        out = engine.forward(ids[start : start + chunk], cache)
    return out


def past_the_limit(tiny, method: str = "h2o", tokens: int = 600):
    cache = tiny.new_cache(settings(method))
    cache.max_positions = 160  # the model has 8,192: a compaction every few chunks
    feed(tiny, cache, random_ids(tokens))
    return cache


@pytest.mark.parametrize("method", ["h2o", "window", "chelsea"])
def test_a_chat_past_the_position_limit_keeps_every_cold_token_in_order(tiny, method):
    cache = past_the_limit(tiny, method)
    assert cache.compactions >= 3 and cache.next_position <= 160
    for layer in cache.compressed_layers:
        tier = layer.recall
        assert tier.rows == cache.tokens_seen - 4 - len(layer.window)  # everything that left the window
        assert tier.tokens().tolist() == list(range(4, 4 + tier.rows))
        where = tier.positions()
        assert bool((where[:, 1:] >= where[:, :-1]).all())  # in token order, per head
        assert bool((where > 3).all() and (where < int(layer.window.pos[0])).all())
    assert cache.recalled() > 0


def test_rows_the_middle_holds_exactly_are_still_blocked_after_compactions(tiny):
    cache = past_the_limit(tiny, "h2o")
    for layer in cache.compressed_layers:
        tier, m = layer.recall, layer.middle
        exact = (m.log_num == 0) & (m.log_den == 0)
        tokens = cache.token_index(layer, m.positions)
        expected = torch.zeros(tier.heads, tier.rows, dtype=torch.bool)
        for head in range(tier.heads):
            rows = tokens[head][exact[head]] - tier.index.first
            expected[head, rows[(rows >= 0) & (rows < tier.rows)]] = True
        assert bool(expected.any())
        assert torch.equal(tier.blocked(m), expected)


def test_a_session_saved_after_compactions_resumes_as_the_one_held_in_one_process(tiny, tmp_path):
    cache = past_the_limit(tiny, "h2o")
    with Store(tmp_path / "kvchat.db") as store:
        sid = store.create_session("t", "tiny", "h2o", {})
        store.save_turn(sid, [], 1, cache.meta(), cache.layer_states(), cold_rows=cache.cold_rows())
    with Store(tmp_path / "kvchat.db") as store:
        snap = store.load_snapshot(sid)
        resumed = tiny.new_cache(settings())
        resumed.max_positions = 160
        resumed.load_layer_states(snap.meta, snap.layers)
        assert resumed.load_cold(lambda sink: store.load_cold(sid, snap.id, sink, resumed.cold_rows))
    for mine, theirs in zip(cache.compressed_layers, resumed.compressed_layers):
        assert theirs.recall.rows == mine.recall.rows
        assert torch.equal(theirs.recall.positions(), mine.recall.positions())
        every = torch.arange(mine.recall.rows).expand(3, -1)
        assert torch.equal(theirs.recall.read(every)[0], mine.recall.read(every)[0])
    compactions = cache.compactions
    more = random_ids(200, seed=7)  # through at least one more compaction, token by token
    for token in more:
        assert torch.equal(tiny.forward([token], cache), tiny.forward([token], resumed))
    assert cache.compactions > compactions and resumed.compactions == cache.compactions


def test_a_layer_that_does_not_recall_keeps_its_rows_in_order_through_compactions_and_a_resume(tiny, tmp_path):
    tiny._measured["recall_layers"] = [1]
    try:
        cache = past_the_limit(tiny, "window", tokens=360)
        resumed = tiny.new_cache(settings("window"))
    finally:
        tiny._measured["recall_layers"] = [0, 1]
    quiet = cache.compressed_layers[0]
    assert not quiet.recalls and cache.compressed_layers[1].recalls
    assert cache.compactions >= 2 and quiet.recall.index.nbytes() == 0
    assert quiet.recall.tokens().tolist() == list(range(4, 4 + quiet.recall.rows))
    where = quiet.recall.positions()
    assert bool((where[:, 1:] >= where[:, :-1]).all() and (where < int(quiet.window.pos[0])).all())
    with Store(tmp_path / "kvchat.db") as store:
        sid = store.create_session("t", "tiny", "window", {})
        store.save_turn(sid, [], 1, cache.meta(), cache.layer_states(), cold_rows=cache.cold_rows())
        snap = store.load_snapshot(sid)
        resumed.max_positions = 160
        resumed.load_layer_states(snap.meta, snap.layers)
        assert resumed.load_cold(lambda sink: store.load_cold(sid, snap.id, sink, resumed.cold_rows))
    assert not resumed.compressed_layers[0].recalls and resumed.compressed_layers[0].recall.rows == quiet.recall.rows
    for token in random_ids(16, seed=9):
        assert torch.equal(tiny.forward([token], cache), tiny.forward([token], resumed))
