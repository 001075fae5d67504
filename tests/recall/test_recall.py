"""The recall tier (kvchat/recall/tier.py): cold tokens kept on disk (8-bit keys, 4-bit
values), found again by the query that needs them.

- a key that only the cold tier holds is found by `select` and attended as kept: the
  layer's output equals exact attention over sinks + that token as the store reads it
  back + window;
- nothing is counted twice: rows the middle holds exactly are never recalled, and
  merged stand-ins give up the tokens recalled (rule `scale`);
- recall off is today's code path; recall covering every cold token is exact attention
  over every token (the `full` method's greedy tokens);
- every method runs a chat turn with recall on and stays within its budget;
- copies get their own, consistent cold tier; the files never show in the folder and
  go with the cache; a loaded state without its rows starts the tier again, a compaction
  keeps it (saved tiers: tests/recall/test_recall_saved.py; compactions:
  tests/recall/test_recall_compaction.py).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from tiny_llama import build_tiny_llama, engine_for, random_ids

from kvchat import compress
from kvchat.cache.attention import weighted_attention
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.cache.layer import CompressedLayer
from kvchat.compress.base import LayerSpec
from kvchat.kv_types import Entries, LayerGeometry
from kvchat.recall import row_codec
from kvchat.recall.tier import CHUNK_QUERIES, RecallTier, chunk_queries
from kvchat.settings import CacheSettings, SamplingSettings

Tensor = torch.Tensor
H, G, D = 2, 2, 16  # KV heads, query heads per KV head, head dim
SINKS, COLD, WINDOW = 2, 96, 8
PLANTED = 37  # the cold row that holds the planted key


def planted_layer(
    recall: int, method: str = "window", folder=None, inv_freq: Tensor | None = None
) -> tuple[CompressedLayer, tuple]:
    """A layer whose cold tier holds one key far along `direction` (row PLANTED) among
    small random keys; the window holds WINDOW small keys and this step's token.
    `inv_freq`: the layer's RoPE (None: none; the keys are then as they would be rotated)."""
    torch.manual_seed(0)
    spec = LayerSpec(0, H, G, D, torch.device("cpu"), torch.float32)
    tier = RecallTier(
        heads=H, head_dim=D, dtype=torch.float32, device=spec.device, recall=recall, folder=folder, inv_freq=inv_freq
    )
    layer = CompressedLayer(
        spec, compress.make(method, spec, 0), SINKS, tier, geometry=LayerGeometry(inv_freq=inv_freq)
    )
    direction = torch.nn.functional.normalize(torch.randn(H, D), dim=-1)
    total = SINKS + COLD + WINDOW
    keys = 0.1 * torch.randn(H, total, D)
    keys[:, SINKS + PLANTED] = 8.0 * direction
    values = torch.randn(H, total, D)
    layer.append(keys, values, torch.arange(total))
    layer.evict(COLD)
    # This step's token joins the window, as `update` does before attention.
    layer.append(0.1 * torch.randn(H, 1, D), torch.randn(H, 1, D), torch.tensor([total]))
    query = (2.0 * direction).repeat_interleave(G, 0)[:, None, :]  # [H*G, 1, D]
    return layer, (query, keys, values)


def exact_over(layer: CompressedLayer, query: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """Exact attention of `query` over sinks + (keys, values) + window."""
    k = torch.cat([layer.sink_keys, keys, layer.window.keys], 1)
    v = torch.cat([layer.sink_values, values, layer.window.values], 1)
    zeros = torch.zeros(H, k.shape[1])
    return weighted_attention(query, k, v, zeros, zeros, scale, causal_tail=1)[0]


def test_a_key_only_the_cold_tier_holds_is_found_and_attended_as_kept():
    layer, (query, keys, values) = planted_layer(recall=1)
    assert layer.middle.length == 0 and layer.recall.rows == COLD  # only the cold tier holds it
    rows, ok = layer.recall.select(query, r=1)
    assert rows.tolist() == [[PLANTED]] * H and bool(ok.all())
    scale = 1 / math.sqrt(D)
    out = layer.attend(query, scale, new_tokens=1)
    expected = exact_over(layer, query, *layer.recall.store.read(torch.full((H, 1), PLANTED)), scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Without the tier the planted value is lost: the output differs.
    layer.recall = None
    assert not torch.allclose(layer.attend(query, scale, new_tokens=1), expected, atol=1e-3)


def test_a_prefill_chunk_recalls_for_all_its_queries():
    layer, (query, keys, values) = planted_layer(recall=1)
    # Two new tokens (a chunk): the planted row is recalled once, for both queries.
    layer.append(0.1 * torch.randn(H, 1, D), torch.randn(H, 1, D), torch.tensor([SINKS + COLD + WINDOW + 1]))
    chunk = torch.cat([query, 0.01 * torch.randn_like(query)], 1)
    scale = 1 / math.sqrt(D)
    out = layer.attend(chunk, scale, new_tokens=2)
    planted_key, planted_value = layer.recall.store.read(torch.full((H, 1), PLANTED))
    k = torch.cat([layer.sink_keys, planted_key, layer.window.keys], 1)
    v = torch.cat([layer.sink_values, planted_value, layer.window.values], 1)
    zeros = torch.zeros(H, k.shape[1])
    expected = weighted_attention(chunk, k, v, zeros, zeros, scale, causal_tail=2)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_long_chunk_ranks_by_a_few_of_its_queries_evenly_spaced():
    layer, (query, _keys, _values) = planted_layer(recall=1)
    length = 4 * CHUNK_QUERIES + 1
    rows = chunk_queries(length, torch.device("cpu"))
    assert rows.tolist() == torch.linspace(0, length - 1, CHUNK_QUERIES).round().long().tolist()
    assert rows[0] == 0 and rows[-1] == length - 1
    # Only the ranking rows count: a planted query elsewhere in the chunk does not.
    chunk = -query.expand(-1, length, -1).clone()  # every row looks away from the planted key
    tier = layer.recall
    chunk[:, 1] = query[:, 0]  # row 1 ranks for no one
    assert tier.select(chunk, r=1)[0].tolist() != [[PLANTED]] * H
    chunk[:, length - 1] = query[:, 0]  # the last row always ranks
    assert tier.select(chunk, r=1)[0].tolist() == [[PLANTED]] * H


def test_rows_the_middle_holds_exactly_are_never_recalled():
    # `full` holds every cold token exactly: there is nothing to recall.
    layer, (query, _keys, _values) = planted_layer(recall=16, method="full")
    assert bool(layer.recall.blocked(layer.middle).all())
    assert layer.recall.recall(query, layer.middle) is None
    # A middle holding the planted token exactly: the best rows but that one are recalled.
    layer, (query, _keys, _values) = planted_layer(recall=4)
    held = Entries(
        layer.window.keys[:, :1].clone(),
        layer.window.values[:, :1].clone(),
        torch.full((H, 1), SINKS + PLANTED),
        torch.zeros(H, 1),
        torch.zeros(H, 1),
    )
    blocked = layer.recall.blocked(held)
    assert blocked[:, PLANTED].all() and int(blocked.sum()) == H
    rec = layer.recall.recall(query, held)
    assert rec is not None and rec.weights is None  # every recalled row is a candidate
    assert not bool((rec.rows == PLANTED).any())
    # Once the candidates run out, a held row fills a slot at weight -inf (attends nothing).
    layer.recall.per_step = COLD
    rec = layer.recall.recall(query, held)
    assert rec is not None and rec.weights is not None
    assert bool(torch.isinf(rec.weights[rec.rows == PLANTED]).all())
    assert bool((rec.weights[rec.rows != PLANTED] == 0).all())


def test_merged_stand_ins_give_up_as_many_tokens_as_are_recalled():
    layer, (query, _keys, _values) = planted_layer(recall=32)
    # Per head: one exact token (kept as is) and two stand-ins for 40 and 60 tokens.
    log = torch.tensor([[0.0, math.log(40), math.log(60)]] * H)
    middle = Entries(torch.zeros(H, 3, D), torch.zeros(H, 3, D), torch.tensor([[SINKS + 90, 10, 20]] * H), log, log)
    rec = layer.recall.recall(query, middle)
    assert rec is not None
    kept = rec.middle_den.exp()
    torch.testing.assert_close(kept[:, 0], torch.ones(H))
    # W = 100 tokens, R = 32 recalled per head: the stand-ins now count 68, in proportion.
    torch.testing.assert_close(kept[:, 1:].sum(1), torch.full((H,), 68.0))
    torch.testing.assert_close(kept[:, 1] / kept[:, 2], torch.full((H,), 40 / 60))
    torch.testing.assert_close(rec.middle_num, rec.middle_den)


def test_cold_files_never_show_in_their_folder_and_go_with_the_tier(tmp_path):
    layer, _ = planted_layer(recall=16, folder=tmp_path)
    assert layer.recall.cold_bytes() == COLD * H * row_codec.unit_bytes(D)
    assert list(tmp_path.iterdir()) == []  # unlinked as soon as created
    closed = layer.recall.store.own._close
    assert closed.alive
    del layer
    gc.collect()
    assert not closed.alive  # the descriptor (and so the file) is gone


# -- through the cache ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return engine_for(build_tiny_llama())


def feed(engine, cache, ids, chunk=32):
    for start in range(0, len(ids), chunk):
        engine.forward(ids[start : start + chunk], cache)


def tiny_cache(tiny, method="h2o", recall=32, **kwargs) -> CompressedCache:
    return tiny.new_cache(
        CacheSettings(method=method, budget="32", window=32, sinks=4, batch=16, recall=recall, **kwargs)
    )


def test_the_index_counts_in_kv_bytes_and_the_rows_in_cold_bytes(tiny):
    plain, recalling = tiny_cache(tiny, recall=0), tiny_cache(tiny)
    ids = random_ids(300)
    feed(tiny, plain, ids)
    feed(tiny, recalling, ids)
    tiers = [layer.recall for layer in recalling.compressed_layers]
    assert all(layer.recall is None for layer in plain.compressed_layers) and plain.cold_bytes() == 0
    assert recalling.nbytes() == plain.nbytes() + sum(t.nbytes() for t in tiers)
    rows = tiers[0].rows
    assert rows == 300 - 4 - len(recalling.compressed_layers[0].window)
    # every cold token: 8-bit keys, 4-bit values and their scales, per KV head
    assert recalling.cold_bytes() == len(tiers) * rows * 3 * row_codec.unit_bytes(64)
    assert recalling.recalled() > 0


def test_a_copy_has_its_own_consistent_cold_tier(tiny):
    cache = tiny_cache(tiny, method="window", recall=16)
    ids = random_ids(400)
    feed(tiny, cache, ids[:203], chunk=29)
    twin = cache.copy()
    mine, theirs = cache.compressed_layers[1].recall, twin.compressed_layers[1].recall
    assert theirs is not mine and theirs.rows == mine.rows == 203 - 4 - 32  # sinks 4, window 32
    every = torch.arange(mine.rows).expand(3, -1)
    for a, b in zip(mine.store.read(every), theirs.store.read(every)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    query = torch.randn(mine.heads, 2, mine.head_dim)
    torch.testing.assert_close(theirs.index.scores(query), mine.index.scores(query), rtol=0, atol=0)
    before = [t.clone() for t in mine.store.read(every)]
    # Diverge: different tokens into each; each keeps its own rows, the shared ones unchanged.
    feed(tiny, cache, ids[203:300], chunk=1)
    feed(tiny, twin, random_ids(97, seed=1), chunk=1)
    assert mine.rows == theirs.rows
    after_mine, after_theirs = mine.store.read(every), theirs.store.read(every)
    for old, new_mine, new_theirs in zip(before, after_mine, after_theirs):
        torch.testing.assert_close(new_mine, old, rtol=0, atol=0)
        torch.testing.assert_close(new_theirs, old, rtol=0, atol=0)
    later = torch.arange(every.shape[1], mine.rows).expand(3, -1)
    assert not torch.equal(mine.store.read(later)[0], theirs.store.read(later)[0])
    # A copy of the copy, then the original dropped: the shared pages stay readable.
    grandchild = twin.copy()
    del cache, mine
    gc.collect()
    got = grandchild.compressed_layers[1].recall.store.read(every)
    torch.testing.assert_close(got[0], after_theirs[0], rtol=0, atol=0)
    feed(tiny, grandchild, random_ids(40, seed=2), chunk=1)


def test_a_loaded_state_without_its_rows_starts_with_an_empty_tier_and_a_compaction_keeps_it(tiny):
    cache = tiny_cache(tiny)
    feed(tiny, cache, random_ids(300))
    resumed = tiny_cache(tiny)
    # The rows are saved apart (kvchat/storage/cold.py); a state alone brings none.
    resumed.load_layer_states(cache.meta(), cache.layer_states())
    assert all(layer.recall.rows == 0 for layer in resumed.compressed_layers)
    feed(tiny, resumed, random_ids(80, seed=3), chunk=1)  # goes on, recalling what goes cold now
    rows = resumed.compressed_layers[0].recall.rows
    assert rows > 0
    resumed.compact_positions()  # the tier moves with the hot cache (tests/recall/test_recall_compaction.py)
    assert resumed.compressed_layers[0].recall.rows == rows
    feed(tiny, resumed, random_ids(60, seed=4), chunk=1)
    assert resumed.compressed_layers[0].recall.rows > rows


def test_a_method_that_keeps_every_token_writes_no_cold_rows(tiny):
    # full's middle holds every cold token exactly: rows of them could never be recalled.
    cache = tiny_cache(tiny, method="full", recall=16)
    feed(tiny, cache, random_ids(200))
    assert all(layer.recall.rows == 0 for layer in cache.compressed_layers)
    assert cache.cold_bytes() == 0
    assert cache.compressed_layers[0].recall.recall(torch.randn(9, 1, 64), cache.compressed_layers[0].middle) is None


def test_a_switch_away_from_full_writes_its_middle_cold_and_reads_the_new_middle(tiny):
    ids = random_ids(200)
    cache = tiny_cache(tiny, method="full", recall=16)
    feed(tiny, cache, ids)
    assert cache.switch_method("h2o")
    layer = cache.compressed_layers[0]
    assert layer.recall.rows == 200 - 4 - len(layer.window)
    assert layer.recall.recall(torch.randn(9, 1, 64), layer.middle) is not None
    # The rows are the ones a tier that wrote all along holds: the first layer's keys and
    # values depend on the tokens alone, so they match a `window` session's to the bit (its
    # window is larger: it has gone cold up to an earlier token).
    along = tiny_cache(tiny, method="window", recall=16)
    feed(tiny, along, ids)
    theirs = along.compressed_layers[0].recall
    common = min(layer.recall.rows, theirs.rows)
    assert common > 150 and torch.equal(layer.recall.tokens()[:common], theirs.tokens()[:common])
    every = torch.arange(common).expand(3, -1)
    for mine, written in zip(layer.recall.store.read(every), theirs.store.read(every)):
        torch.testing.assert_close(mine, written, rtol=0, atol=0)
    feed(tiny, cache, random_ids(40, seed=7), chunk=1)  # later tokens follow on from them
    assert layer.recall.rows > 200 - 4 - len(layer.window)


# -- the real model -----------------------------------------------------------------------
QUESTION = "What did the author do after he left the company? Answer briefly."


def document(engine, tokens: int) -> str:
    from kvchat.calibration.realkv import essays_text

    ids = engine.tokenizer(essays_text()[: tokens * 8], add_special_tokens=False).input_ids[:tokens]
    return engine.tokenizer.decode(ids)


def greedy(engine, settings: CacheSettings, text: str, tokens: int = 16) -> list[int]:
    return engine.new_session(settings).send(text, SamplingSettings(max_new_tokens=tokens)).token_ids


def test_recall_off_is_the_path_without_a_tier_and_recall_of_everything_is_full(engine):
    text = f"{document(engine, 400)}\n\n{QUESTION}"
    base = {"budget": "64", "window": 64, "sinks": 4, "batch": 16, "prefill_mode": "streaming"}
    off = engine.new_session(CacheSettings(method="window", **base))
    assert all(layer.recall is None for layer in off.cache.compressed_layers)
    tokens = off.send(text, SamplingSettings(max_new_tokens=16)).token_ids
    assert tokens == greedy(engine, CacheSettings(method="window", recall=0, **base), text)
    assert off.cache.cold_bytes() == 0 and off.cache.recalled() == 0
    # Recalling at least every cold token: exact attention over all of them, every step
    # and every later prefill chunk, as the exact cache computes it.
    everything = greedy(engine, CacheSettings(method="window", recall=1024, **base), text)
    assert everything == greedy(engine, CacheSettings(method="full", **base), text)


@pytest.mark.parametrize("method", compress.available())
def test_every_method_runs_a_chat_turn_with_recall_within_its_budget(engine, method):
    settings = CacheSettings(
        method=method, budget="32", window=32, sinks=4, batch=16, recall=32, prefill_mode="streaming"
    )
    session = engine.new_session(settings)
    result = session.send(f"{document(engine, 200)}\n\n{QUESTION}", SamplingSettings(max_new_tokens=6))
    assert result.token_ids and not result.cancelled
    cache = session.cache
    if compress.get(method).bounded:
        assert cache.entries_per_head() <= 4 + 32 + 32  # the tier adds no hot entries
    # full holds every token exactly: it writes none cold (nothing could be recalled).
    assert (cache.cold_bytes() > 0) == compress.get(method).bounded
    if method != "full":
        assert cache.recalled() > 0
    assert result.metrics.kv_bytes == cache.nbytes()


def test_an_exact_prefill_flushed_after_its_passes_goes_cold(tiny):
    # The bench's and the app's exact-then-compress path: forward passes (inference mode)
    # hold the prefill exact, `flush` evicts afterwards, outside inference mode.
    cache = tiny_cache(tiny, method="chelsea")
    cache.defer_eviction = True
    feed(tiny, cache, random_ids(300))
    assert cache.compressed_layers[0].recall.rows == 0
    cache.flush()
    assert cache.compressed_layers[0].recall.rows == 300 - 4 - len(cache.compressed_layers[0].window)
    twin = cache.copy()
    feed(tiny, twin, random_ids(40, seed=5), chunk=1)
    twin.defer_eviction = True
    feed(tiny, twin, random_ids(100, seed=6))
    twin.flush()
    assert twin.compressed_layers[0].recall.rows == 440 - 4 - len(twin.compressed_layers[0].window)
