"""How a decode step meets the recall tier (kvchat/recall/tier.py, `RecallTier.recall`):

- tokens that leave the window one at a time (a method without a middle) wait in RAM,
  attended exactly at every pass, and are written to the file and the index
  `STAGE_ROWS` at a time (`RecallTier.append`);
- the other tokens a pass sends cold (up to `DEFER_ROWS`: a later turn's question) are
  written by the next pass before it ranks, or by whatever reads the rows first, so a
  turn's first token does not wait for them; a document's chunk is written at once;
- every step chooses its own rows by default; `every` (an ablation hook) lets one
  choice serve several steps, until a chunk or a changed middle."""

from __future__ import annotations

import torch

from kvchat.cache.compressed_cache import CompressedCache
from kvchat.kv_types import Entries, LayerGeometry
from kvchat.recall import row_codec
from kvchat.recall.tier import DEFER_ROWS, STAGE_ROWS

from .test_recall import COLD, PLANTED, D, G, H, planted_layer


def decode_query(direction: torch.Tensor) -> torch.Tensor:
    return (2.0 * direction).repeat_interleave(G, 0)[:, None, :]  # [H*G, 1, D]


def leave_window(tier, keys: torch.Tensor, stage: bool = True) -> None:
    """Tokens [H, b, D] leaving the window, after the tier's last row."""
    deferred = 0 if tier._deferred is None else tier._deferred[0].shape[1]
    first = tier.index.first + tier.index.rows + tier._staged + deferred
    tier.append(keys, torch.randn_like(keys), torch.arange(first, first + keys.shape[1]), stage=stage)


def test_a_token_leaving_the_window_alone_waits_in_ram_and_is_attended_at_once():
    layer, (query, _, _) = planted_layer(recall=1)
    tier = layer.recall
    tier.recall(query, layer.middle)  # a step before: the tier has seen this middle
    direction = torch.nn.functional.normalize(torch.randn(H, D), dim=-1)
    leave_window(tier, (16.0 * direction)[:, None])
    assert tier.store.rows == COLD  # not written yet
    rec = tier.recall(query, layer.middle)
    assert rec.rows.tolist() == [[PLANTED]] * H  # the chosen row, then the staged one
    torch.testing.assert_close(rec.keys[:, -1], 16.0 * direction)
    assert rec.keys.shape[1] == 2 and rec.weights is None


def test_staged_tokens_are_written_sixteen_at_a_time():
    layer, _ = planted_layer(recall=1)
    tier = layer.recall
    for _ in range(STAGE_ROWS - 1):
        leave_window(tier, torch.randn(H, 1, D))
    assert tier.store.rows == COLD and tier.index.rows == COLD
    leave_window(tier, torch.randn(H, 1, D))
    assert tier.store.rows == tier.index.rows == COLD + STAGE_ROWS


def test_a_method_with_a_middle_stages_nothing():
    layer, _ = planted_layer(recall=1)
    leave_window(layer.recall, torch.randn(H, 1, D), stage=False)
    assert layer.recall._staged == 0 and layer.recall.rows == COLD + 1


def test_the_tokens_a_pass_sends_cold_are_written_and_ranked_by_the_next_pass():
    layer, (query, _, _) = planted_layer(recall=1)
    tier = layer.recall
    direction = torch.nn.functional.normalize(torch.randn(H, D), dim=-1)
    keys = 0.1 * torch.randn(H, 3, D)
    keys[:, 1] = 16.0 * direction  # a better match than the planted row, for its own query
    before = tier.nbytes()
    leave_window(tier, keys, stage=False)
    assert tier.store.rows == tier.index.rows == COLD  # the pass ends without writing them
    assert tier.cold_bytes() == (COLD + 3) * H * row_codec.unit_bytes(D)  # but they count as cold
    assert tier.nbytes() == before + 3 * tier.bytes_per_row()  # and in RAM, as the rows they become
    rec = tier.recall(decode_query(direction), layer.middle)
    assert tier.store.rows == tier.index.rows == COLD + 3
    assert rec.rows.tolist() == [[COLD + 1]] * H
    torch.testing.assert_close(rec.keys[:, 0], 16.0 * direction, atol=16.0 / 127, rtol=0)  # as 8-bit keys keep it


def test_reading_the_rows_writes_the_deferred_ones_first():
    layer, _ = planted_layer(recall=1)
    tier = layer.recall
    leave_window(tier, torch.randn(H, 3, D), stage=False)
    assert tier.store.rows == COLD
    assert tier.state_dict()["recall.rows"] == COLD + 3
    assert tier.store.rows == COLD + 3
    leave_window(tier, torch.randn(H, 2, D), stage=False)
    assert tier.fork().rows == COLD + 5


def test_deferred_then_staged_tokens_are_written_in_the_order_they_came():
    layer, _ = planted_layer(recall=1)
    tier = layer.recall
    leave_window(tier, torch.randn(H, 3, D), stage=False)
    leave_window(tier, torch.randn(H, 1, D), stage=True)
    first = tier.index.first
    assert tier.rows == COLD + 4 and tier.index.first == first  # in order: the tier kept its rows


def test_a_document_chunk_sent_cold_is_written_at_once():
    layer, _ = planted_layer(recall=1)
    leave_window(layer.recall, torch.randn(H, DEFER_ROWS + 1, D), stage=False)
    assert layer.recall.store.rows == COLD + DEFER_ROWS + 1


def test_the_window_layer_stages_what_it_evicts():
    layer, _ = planted_layer(recall=1)
    layer.evict(1)  # `window` keeps no middle
    assert layer.recall.store.rows == COLD and layer.recall._staged == 1


def test_reading_the_rows_writes_the_staged_ones_first():
    layer, _ = planted_layer(recall=1)
    tier = layer.recall
    leave_window(tier, torch.randn(H, 2, D))
    assert tier.store.rows == COLD
    assert tier.state_dict()["recall.rows"] == COLD + 2
    assert tier.store.rows == COLD + 2
    leave_window(tier, torch.randn(H, 1, D))
    assert tier.fork().rows == COLD + 3


def test_counting_the_cold_bytes_writes_nothing_and_counts_the_staged_tokens():
    # The app's status bar counts them from the UI thread while the model's thread appends.
    layer, _ = planted_layer(recall=1)
    tier = layer.recall
    leave_window(tier, torch.randn(H, 2, D))
    assert tier.cold_bytes() == (COLD + 2) * H * row_codec.unit_bytes(D)
    assert tier._staged == 2 and tier.store.rows == COLD  # still waiting in RAM


def test_a_prefill_chunk_attends_the_staged_tokens_exactly_without_writing_them():
    layer, (query, _, _) = planted_layer(recall=1)
    tier = layer.recall
    tier.recall(query, layer.middle)  # a step before: the tier has seen this middle
    direction = torch.nn.functional.normalize(torch.randn(H, D), dim=-1)
    leave_window(tier, (16.0 * direction)[:, None])
    chunk = torch.cat([query] * 2, 1)
    rec = tier.recall(chunk, layer.middle)
    assert tier._staged == 1 and tier.store.rows == COLD  # still waiting in RAM
    assert rec.rows.tolist() == [[PLANTED]] * H  # the chosen row, then the staged one
    torch.testing.assert_close(rec.keys[:, -1], 16.0 * direction)


def test_a_changed_middle_writes_the_staged_tokens_before_choosing():
    layer, (query, _, _) = planted_layer(recall=1)
    tier = layer.recall
    tier.recall(query, layer.middle)
    leave_window(tier, torch.randn(H, 1, D))
    tier.recall(query, layer.middle)
    assert tier._staged == 1  # the same middle: still waiting
    tier.recall(query, Entries.empty(H, D, torch.device("cpu"), torch.float32))
    assert tier._staged == 0 and tier.store.rows == COLD + 1


def test_the_staging_buffers_are_a_fixed_cost_of_the_tier():
    layer, _ = planted_layer(recall=1)
    assert layer.recall.fixed_bytes() == 2 * H * STAGE_ROWS * D * 4  # keys and values, float32


def test_every_step_chooses_by_default():
    layer, (query, _, _) = planted_layer(recall=4)
    assert layer.recall.every == 1
    assert layer.recall.recall(query, layer.middle) is not layer.recall.recall(query, layer.middle)


def test_with_every_a_choice_serves_that_many_decode_passes():
    layer, (query, _, _) = planted_layer(recall=4)
    tier = layer.recall
    tier.every = 3
    first = tier.recall(query, layer.middle)
    assert tier.recall(query, layer.middle) is first
    assert tier.recall(query, layer.middle) is first
    fourth = tier.recall(query, layer.middle)
    assert fourth is not first
    assert torch.equal(fourth.rows.sort().values, first.rows.sort().values)  # the same query, the same rows


def test_with_every_a_chunk_or_a_changed_middle_chooses_afresh():
    layer, (query, _, _) = planted_layer(recall=4)
    tier = layer.recall
    tier.every = 4
    first = tier.recall(query, layer.middle)
    assert tier.recall(torch.cat([query, query], 1), layer.middle) is not first
    held = tier.recall(query, layer.middle)
    assert tier.recall(query, Entries.empty(H, D, torch.device("cpu"), torch.float32)) is not held


def test_the_cache_sets_every_for_each_tier_and_a_copy_keeps_it():
    cache = CompressedCache(
        num_layers=2,
        num_kv_heads=H,
        group_size=G,
        head_dim=D,
        device=torch.device("cpu"),
        dtype=torch.float32,
        geometry=[LayerGeometry(inv_freq=torch.ones(D // 2))] * 2,
        max_positions=10_000,
        method="window",
        budget="64",
        window=8,
        sinks=2,
        recall=2,
    )
    cache.recall_every = 2
    assert {layer.recall.every for layer in cache.compressed_layers} == {2}
    assert cache.copy().recall_every == 2
    assert {layer.recall.every for layer in cache.copy().compressed_layers} == {2}
