"""Where recalled rows sit, and which rows every layer recalls (kvchat/recall/tier.py).

- in a session that passes the trained context, the rows a pass recalls are laid out in
  token order on the positions just before the window (before the staged rows, which
  keep their own), each stored key (before RoPE) turned to exactly that position, those
  sent cold since a compaction too: a recalled passage and the window read as one short text;
  inside the context, recalled rows stay where their tokens are;
- a session knows it passes the context from the prompt that takes it there, before the
  prompt's first token, or from a compaction;
- a prefill chunk pins its best block, with the block after it, for every recalling
  layer; the answer's steps recall the pinned rows, once each, beside their own best
  rows; the next chunk pins anew;
- pins are part of a cache's state: a copy and a saved session keep them.
"""

from __future__ import annotations

import math

import torch
from tiny_llama import build_tiny_llama, engine_for, random_ids

from kvchat.cache import positions
from kvchat.kv_types import rerotate
from kvchat.recall.tier import PIN_BLOCK, RecallPins
from kvchat.settings import CacheSettings

from .test_recall import COLD, PLANTED, SINKS, WINDOW, D, planted_layer
from .test_recall_compaction import rope_freq

TINY = CacheSettings(method="window", budget="32", window=32, sinks=4, batch=16, recall=8)


def tiny_cache(limit: int = 160):
    """A tiny Llama engine and a cache of `TINY` settings held to `limit` positions."""
    engine = engine_for(build_tiny_llama())
    cache = engine.new_cache(TINY)
    cache.max_positions = limit
    return engine, cache


def rotary_layer(recall: int, compacted: bool = True):
    """`planted_layer` with RoPE; `compacted`: after a compaction that moved every cold row."""
    layer, planted = planted_layer(recall=recall, inv_freq=rope_freq(D))
    if compacted:
        total = SINKS + COLD + WINDOW + 1
        positions.compact([layer], next_position=total, sinks=SINKS, boundary=0, shift=0)
        assert layer.recall.cold_pos.shape[1] == COLD
        layer.recall.lay_out = True  # (the cache sets it: a session past the trained context)
    return layer, planted


def test_rows_a_compaction_moved_sit_in_token_order_just_before_the_window():
    layer, (query, _keys, _values) = rotary_layer(recall=5)
    tier = layer.recall
    start = int(layer.window.pos[0])
    rec = tier.recall(query, layer.middle, before=start)
    rows = rec.rows
    assert PLANTED in rows[0].tolist()
    stored, _ = tier.store.read(rows)
    target = (start - rows.shape[1] + rows.argsort(1).argsort(1)).float()
    assert sorted(target[0].tolist()) == list(range(start - rows.shape[1], start))
    torch.testing.assert_close(rec.keys, rerotate(stored, target, rope_freq(D)), rtol=0, atol=0)
    # (the same as the keys where their tokens sit, turned by the distance they moved)
    now = torch.gather(tier.positions(), 1, rows)
    torch.testing.assert_close(rec.keys, rerotate(tier.read(rows)[0], target - now, rope_freq(D)), rtol=0, atol=1e-5)


def test_inside_the_trained_context_recalled_rows_stay_where_their_tokens_are():
    layer, (query, _keys, _values) = rotary_layer(recall=5, compacted=False)
    rec = layer.recall.recall(query, layer.middle, before=int(layer.window.pos[0]))
    assert torch.equal(rec.keys, layer.recall.read(rec.rows)[0])


def test_after_a_compaction_rows_sent_cold_since_are_laid_out_with_the_others():
    layer, (query, _keys, _values) = rotary_layer(recall=4)
    tier = layer.recall
    tier.per_step = COLD + 1  # every cold row, the one sent cold after the compaction too
    window = layer.window
    tier.append(window.keys[:, :1], window.values[:, :1], window.pos[:1])
    start = int(window.pos[1])
    rec = tier.recall(query, layer.middle, before=start)
    assert bool((rec.rows == COLD).sum(1).eq(1).all())  # the row sent cold after the compaction
    stored, _ = tier.store.read(rec.rows)
    target = (start - (COLD + 1) + rec.rows.argsort(1).argsort(1)).float()
    assert sorted(target[0].tolist()) == list(range(start - COLD - 1, start))
    torch.testing.assert_close(rec.keys, rerotate(stored, target, rope_freq(D)), rtol=0, atol=0)


def test_without_a_window_start_recalled_rows_stay_where_their_tokens_sit():
    layer, (query, _keys, _values) = rotary_layer(recall=5)
    rec = layer.recall.recall(query, layer.middle)
    assert torch.equal(rec.keys, layer.recall.read(rec.rows)[0])


def test_staged_rows_keep_their_positions_and_recalled_rows_end_where_they_begin():
    layer, (query, _keys, _values) = rotary_layer(recall=3)
    tier = layer.recall
    tier.recall(query, layer.middle)  # (the tier has seen this middle: a staged row stays staged)
    # The window's first token goes cold as a middle-less method's step sends it: staged.
    window = layer.window
    tier.append(window.keys[:, :1], window.values[:, :1], window.pos[:1], stage=True)
    staged = tier._staged
    assert staged == 1
    start = int(window.pos[1])
    rec = tier.recall(query, layer.middle, before=start)
    r = rec.rows.shape[1]
    assert rec.keys.shape[1] == r + staged
    assert torch.equal(rec.keys[:, r:], tier._stage_keys[:, :staged])
    target = (start - staged - r + rec.rows.argsort(1).argsort(1)).float()
    stored, _ = tier.store.read(rec.rows)
    torch.testing.assert_close(rec.keys[:, :r], rerotate(stored, target, rope_freq(D)), rtol=0, atol=0)


def test_a_chunk_replaces_the_pins_and_a_step_keeps_them():
    pins = RecallPins()
    pins.start_pass(8)
    pins.add(torch.tensor([5, 6]))
    pins.add(torch.tensor([6, 40]))
    assert pins.tokens.tolist() == [5, 6, 40]  # every layer of the chunk adds its blocks
    pins.start_pass(1)
    assert pins.tokens.tolist() == [5, 6, 40]  # a decode step pins nothing
    pins.start_pass(8)
    pins.add(torch.tensor([90]))
    assert pins.tokens.tolist() == [90]


def test_a_chunk_pins_the_block_of_its_best_row_and_the_block_after_it():
    layer, (query, _keys, _values) = rotary_layer(recall=1)
    tier = layer.recall
    tier.pins = pins = RecallPins()
    pins.start_pass(2)
    chunk = torch.cat([query, query], 1)
    tier.recall(chunk, layer.middle, before=int(layer.window.pos[0]))
    block = PLANTED // PIN_BLOCK * PIN_BLOCK
    expected = [t for t in range(block, block + 2 * PIN_BLOCK) if t < COLD]
    assert (pins.tokens - tier.index.first).tolist() == expected


def test_a_step_recalls_each_pinned_row_once_beside_its_own_best_rows():
    layer, (query, _keys, _values) = rotary_layer(recall=2)
    tier = layer.recall
    pinned = torch.tensor([3, 4, 5]) + tier.index.first
    tier.pins = RecallPins(pinned)
    rec = tier.recall(query, layer.middle, before=int(layer.window.pos[0]))
    for head in rec.rows.tolist():
        assert head[:3] == [3, 4, 5] and len(set(head)) == len(head) == 5
        assert PLANTED in head[3:]  # its own best row besides
    assert math.isclose(tier.recalled(), 5.0)


def test_a_copy_and_a_saved_state_keep_the_pins(tmp_path):
    engine, cache = tiny_cache(limit=8192)
    for start in range(0, 400, 40):
        engine.forward(random_ids(400)[start : start + 40], cache)
    assert cache.pins.tokens.numel()
    twin = cache.copy()
    assert torch.equal(twin.pins.tokens, cache.pins.tokens) and twin.pins is not cache.pins
    assert all(layer.recall.pins is twin.pins for layer in twin.compressed_layers)
    resumed = engine.new_cache(TINY)
    resumed.load_layer_states(cache.meta(), cache.layer_states())
    assert torch.equal(resumed.pins.tokens, cache.pins.tokens)
    assert all(layer.recall.pins is resumed.pins for layer in resumed.compressed_layers)


def test_a_prompt_that_passes_the_trained_context_lays_rows_out_from_its_first_token():
    engine, cache = tiny_cache()
    cache.expect(150)
    assert not cache.long_context  # it fits
    cache.expect(161)
    assert cache.long_context and cache.compactions == 0
    assert all(layer.recall.lay_out for layer in cache.compressed_layers)


def test_a_compaction_marks_the_session_long_and_a_resume_keeps_it():
    engine, cache = tiny_cache()
    for start in range(0, 400, 40):
        engine.forward(random_ids(400)[start : start + 40], cache)
    assert cache.compactions and cache.long_context
    resumed = engine.new_cache(TINY)
    resumed.load_layer_states(cache.meta(), cache.layer_states())
    assert resumed.long_context and all(layer.recall.lay_out for layer in resumed.compressed_layers)
