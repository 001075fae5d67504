"""The compressed cache: memory bound, what each baseline keeps, percentage budgets,
method switch.

Streaming tests run a small random-weight Llama with the embedded model's attention
shape (9 query heads, 3 KV heads, head_dim 64, hidden 576, GQA group 3) but 2 layers:
the cache only sees per-layer keys/values, so 2 layers exercise every code path at a
fifteenth of the cost, and no weights are downloaded.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from tiny_llama import build_tiny_llama, engine_for, random_ids

from kvchat import compress
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.cache.window_buffer import WINDOW_SLACK
from kvchat.compress.base import LayerSpec
from kvchat.settings import Budget, CacheSettings

UNBOUNDED = {"full"}  # the exact reference keeps every token: no budget applies
BOUNDED = [m for m in compress.available() if m not in UNBOUNDED]


@pytest.fixture(scope="module")
def tiny():
    return engine_for(build_tiny_llama())


def stream(engine, cache, ids, chunk, after=None):
    """Feed `ids` in forward passes of `chunk` tokens (1 = decoding), calling `after()`
    after every pass (the cache has settled by then)."""
    for start in range(0, len(ids), chunk):
        engine.forward(ids[start : start + chunk], cache)
        if after is not None:
            after()


# -- memory bound ----------------------------------------------------------------------
S, W, B, BATCH = 4, 32, 32, 16
# Bookkeeping an entry may carry besides its key and value: its position, the two
# log-weights a and b, one attention score per query head of its GQA group (3 here),
# and a method's per-entry links (bumblebee: nearest-neighbour index and similarity).
# That is at most 8 scalars, each at most 8 bytes (int64/float64).
META_BYTES = 8 * 8
# A layer may also hold one random generator (the state of a CPU torch.Generator).
RNG_BYTES = torch.Generator().get_state().numel()


def kv_bound(cache: CompressedCache) -> int:
    """Per layer and KV head at most S + W + B entries (sinks, window after settling,
    middle: the compressor's contract counts pending entries), each costing 2·d·elem
    bytes of key and value plus META_BYTES; plus one RNG state per layer."""
    spec = cache.specs[0]
    layer = cache.compressed_layers[0]
    elem = layer.sink_keys.element_size()  # the model dtype: keys and values are stored in it
    per_entry = 2 * spec.head_dim * elem + META_BYTES
    per_layer = spec.num_kv_heads * (cache.sinks + cache.window + int(cache.budget.value)) * per_entry
    return len(cache.compressed_layers) * (per_layer + RNG_BYTES)


def test_bound_is_tight_for_the_exact_parts(tiny):
    # Sanity of the yardstick: the KV part alone of S + W + B exact entries is within
    # 12.5% of the bound (fp32, d=64: 512 bytes of key+value per entry, 64 of bookkeeping).
    cache = tiny.new_cache(CacheSettings(method="full", budget=str(B), window=W, sinks=S, batch=BATCH))
    kv_only = 2 * 2 * 3 * (S + W + B) * 64 * 4
    assert kv_only <= kv_bound(cache) <= kv_only * 1.125 + 2 * RNG_BYTES


@pytest.mark.parametrize("method", BOUNDED)
def test_kv_bytes_never_exceed_sinks_window_budget(tiny, method):
    cache = tiny.new_cache(CacheSettings(method=method, budget=str(B), window=W, sinks=S, batch=BATCH))
    bound = kv_bound(cache)
    worst = {"bytes": 0, "entries": 0}

    def check():
        worst["bytes"] = max(worst["bytes"], cache.nbytes())
        worst["entries"] = max(worst["entries"], cache.entries_per_head())
        assert cache.nbytes() <= bound, f"{cache.nbytes()} > {bound} bytes after {cache.tokens_seen} tokens"
        assert cache.entries_per_head() <= S + W + B

    ids = random_ids(16 * B)
    # Up to 4x the budget: prefill chunks, then decoding (one token per pass).
    stream(tiny, cache, ids[: 4 * B - 8], 32, check)
    stream(tiny, cache, ids[4 * B - 8 : 4 * B], 1, check)
    assert cache.tokens_seen == 4 * B
    at_4x = cache.nbytes()
    # Up to 16x the budget, the same way.
    stream(tiny, cache, ids[4 * B : 16 * B - 8], 32, check)
    stream(tiny, cache, ids[16 * B - 8 :], 1, check)
    assert cache.tokens_seen == 16 * B
    at_16x = cache.nbytes()
    assert at_4x <= bound and at_16x <= bound
    # The cache really filled up (the bound is not met by accident of an empty middle).
    if method != "window":
        assert worst["entries"] > S + W
    assert cache.nbytes() < cache.full_cache_bytes() / 4


def test_full_cache_grows_past_that_bound(tiny):
    # The exact reference is the one method the bound does not apply to: proof that the
    # measurement above can fail.
    cache = tiny.new_cache(CacheSettings(method="full", budget=str(B), window=W, sinks=S, batch=BATCH))
    stream(tiny, cache, random_ids(4 * B), 64)
    assert cache.entries_per_head() == 4 * B
    assert cache.nbytes() > kv_bound(cache)
    assert cache.nbytes() >= cache.full_cache_bytes()


# -- what each baseline keeps ------------------------------------------------------------
def test_h2o_keeps_exactly_the_top_accumulated_attention():
    # 2 KV heads, GQA groups of 2 query heads: scores are summed over the group.
    spec = LayerSpec(0, num_kv_heads=2, group_size=2, head_dim=4, device=torch.device("cpu"), dtype=torch.float32)
    h2o = compress.make("h2o", spec, 3)
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 6, 4, generator=gen), torch.randn(2, 6, 4, generator=gen)
    positions = torch.arange(10, 16).expand(2, -1).contiguous()
    # First batch (positions 10..13) with the mass it collected in the window, [H, G, 4]:
    scores = torch.tensor(
        [
            [[0.1, 0.5, 0.2, 0.4], [0.1, 0.1, 0.3, 0.0]],  # head 0: 0.2 0.6 0.5 0.4 -> drop 10
            [[0.9, 0.0, 0.1, 0.1], [0.0, 0.0, 0.0, 0.2]],  # head 1: 0.9 0.0 0.1 0.3 -> drop 11
        ]
    )
    h2o.ingest(keys[:, :4], values[:, :4], positions[:, :4], scores=scores)
    assert h2o.entries().positions.tolist() == [[11, 12, 13], [10, 12, 13]]
    assert torch.allclose(h2o.scores, torch.tensor([[0.6, 0.5, 0.4], [0.9, 0.1, 0.3]]))
    # A forward pass: attention mass on the current entries, in entries() order.
    h2o.observe(
        torch.tensor(
            [
                [[0.0, 0.0, 0.3], [0.0, 0.0, 0.2]],  # head 0 -> 0.6 0.5 0.9
                [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]],  # head 1 -> 0.9 0.6 0.3
            ]
        )
    )
    # Second batch (14, 15): head 0 sums 0.55 0.1, head 1 sums 0.0 0.7.
    h2o.ingest(
        keys[:, 4:],
        values[:, 4:],
        positions[:, 4:],
        scores=torch.tensor(
            [
                [[0.5, 0.1], [0.05, 0.0]],
                [[0.0, 0.3], [0.0, 0.4]],
            ]
        ),
    )
    e = h2o.entries()
    # Head 0 pool: 11:.6 12:.5 13:.9 14:.55 15:.1 ; head 1 pool: 10:.9 12:.6 13:.3 14:0 15:.7
    assert e.positions.tolist() == [[11, 13, 14], [10, 12, 15]]
    assert torch.allclose(h2o.scores, torch.tensor([[0.6, 0.9, 0.55], [0.9, 0.6, 0.7]]))
    expected = e.positions - 10
    assert torch.equal(e.keys, torch.gather(keys, 1, expected[..., None].expand(-1, -1, 4)))
    assert torch.equal(e.values, torch.gather(values, 1, expected[..., None].expand(-1, -1, 4)))
    assert (e.log_num == 0).all() and (e.log_den == 0).all()  # kept tokens are exact


def test_window_keeps_exactly_sinks_and_the_recent_tokens(tiny):
    cache = tiny.new_cache(CacheSettings(method="window", budget="64", window=W, sinks=S, batch=1))
    checked = []

    def check():
        n = cache.next_position
        for layer in cache.compressed_layers:
            assert layer.sink_pos.tolist() == list(range(S))
            assert layer.window.pos.tolist() == list(range(max(S, n - W), n))
            assert layer.middle.length == 0
        checked.append(n)

    ids = random_ids(200, seed=1)
    stream(tiny, cache, ids[:192], 48, check)
    stream(tiny, cache, ids[192:], 1, check)
    assert checked[-1] == 200 and cache.entries_per_head() == S + W


def test_window_overflow_streams_into_the_compressor_in_batches(tiny):
    # With batch g, the window is brought back under W by evicting at least g tokens at
    # once: it holds between W - g + 1 and W tokens, always the most recent ones.
    g = 8
    cache = tiny.new_cache(CacheSettings(method="full", budget="64", window=W, sinks=S, batch=g))
    sizes = []

    def check():
        layer = cache.compressed_layers[0]
        n = cache.next_position
        assert layer.window.pos.tolist() == list(range(n - layer.window.pos.numel(), n))
        sizes.append(layer.window.pos.numel())

    stream(tiny, cache, random_ids(64, seed=2), 32)
    stream(tiny, cache, random_ids(40, seed=3), 1, check)
    assert min(sizes) == W - g + 1 and max(sizes) == W


def test_window_method_drops_overflow_exactly_whatever_the_batch(tiny):
    # Nothing is compressed, so nothing is batched: the window stays full.
    cache = tiny.new_cache(CacheSettings(method="window", budget="64", window=W, sinks=S, batch=8))
    sizes = []
    stream(tiny, cache, random_ids(64, seed=2), 32)
    stream(tiny, cache, random_ids(40, seed=3), 1, lambda: sizes.append(cache.compressed_layers[0].window.pos.numel()))
    assert set(sizes) == {W}


def test_window_method_spends_the_whole_percentage_on_recent_tokens(tiny):
    # 25% of 400 tokens = 100 entries: 4 sinks + the 96 most recent (a method with a middle
    # would get 4 + 46 recent + 50 middle), so window is compared at equal memory.
    assert Budget.parse("25%").split(400, 4, 1024, keeps_middle=False) == (0, 96)
    cache = tiny.new_cache(CacheSettings(method="window", budget="25%", window=1024, sinks=4, batch=8))
    stream(tiny, cache, random_ids(400, seed=4), 50)
    layer = cache.compressed_layers[0]
    assert layer.sink_pos.tolist() == [0, 1, 2, 3]
    assert layer.window.pos.tolist() == list(range(304, 400))
    assert cache.entries_per_head() == 100


# -- percentage budgets ----------------------------------------------------------------
def test_percentage_budget_parses_as_a_share_of_tokens_seen():
    budget = Budget.parse("25%")
    assert budget.percent and budget.value == 0.25 and str(budget) == "25%"
    assert Budget.parse("1024") == Budget(1024, False)
    for bad in ("0%", "150%", "abc", "-3"):
        with pytest.raises(ValueError):
            Budget.parse(bad)


def test_percentage_budget_keeps_the_window_while_there_is_room():
    # 25% of 10,000 tokens = 2,500 kept per head: sinks 4 + window 1024 + middle 1472.
    assert Budget.parse("25%").split(10_000, 4, 1024) == (1472, 1024)


def test_percentage_budget_shrinks_the_window_to_give_the_middle_half():
    # 25% of 2,000 = 500 < sinks + window: the middle gets half, the window the rest.
    assert Budget.parse("25%").split(2_000, 4, 1024) == (250, 246)


def test_percentage_budget_counts_exact_shares():
    # 35% of 100 tokens is 35 entries, not 34 (0.35 * 100 is 34.99999... in floating point).
    for share, seen in (("35%", 100), ("29%", 100), ("70%", 1000), ("12.5%", 80)):
        pct = Fraction(share[:-1])
        middle, window = Budget.parse(share).split(seen, 4, 8)
        assert 4 + window + middle == pct * seen / 100, share


@pytest.mark.parametrize("share", ["5%", "25%", "35%", "50%", "100%"])
@pytest.mark.parametrize("sinks,window", [(4, 1024), (16, 256), (4, 64)])
def test_percentage_budget_rule_over_a_grid(share, sinks, window):
    budget = Budget.parse(share)
    for seen in range(100, 40_000, 97):
        total = math.floor(Fraction(share[:-1]) * seen / 100)
        middle, win = budget.split(seen, sinks, window)
        assert 1 <= win <= window
        assert middle >= total // 2, "at least half of the total goes to the middle"
        if total < 2 * (sinks + 1):
            # Early in a session the share is smaller than the sinks plus a one-token
            # window plus half for the middle: those floors win (the cache cannot drop
            # its sinks or the current token).
            continue
        assert sinks + win + middle == total, "the share is the total kept, sinks and window included"
        if total - sinks - window >= total // 2:
            assert win == window, "the window only shrinks when it must"
        else:
            assert win < window


def test_percentage_budget_bounds_a_live_cache(tiny):
    cache = tiny.new_cache(CacheSettings(method="h2o", budget="25%", window=64, sinks=S, batch=8))

    def check():
        if cache.tokens_seen >= 64:
            total = int(0.25 * cache.tokens_seen)
            for layer in cache.compressed_layers:
                assert layer.entry_count() <= total

    stream(tiny, cache, random_ids(512, seed=4), 32, check)
    # At 512 tokens: 128 kept per head; 4 + 64 would leave the middle 60 < 64, so the
    # window shrinks to 60 and the middle holds 64.
    for layer in cache.compressed_layers:
        assert layer.window.pos.numel() <= 60 and layer.compressor.budget == 64
        assert layer.entry_count() > 100  # the share is used, not just respected


# -- method switch ---------------------------------------------------------------------
def _snapshot(cache):
    return [
        (layer.sink_keys.clone(), layer.window.keys.clone(), layer.window.pos.clone(), layer.middle)
        for layer in cache.compressed_layers
    ]


def test_switch_full_to_h2o_restreams_into_the_budget_without_a_forward(tiny):
    session = tiny.new_session(CacheSettings(method="full", budget="48", window=W, sinks=S, batch=BATCH))
    session.feed(random_ids(256, seed=5), chunk=64)
    before = _snapshot(session.cache)
    calls = tiny.forward_calls
    session.switch_method("h2o")
    assert tiny.forward_calls == calls, "a method switch must not recompute anything"
    assert session.cache.method == "h2o" and session.settings.method == "h2o"
    for layer, (sink_keys, win_keys, win_pos, old) in zip(session.cache.compressed_layers, before):
        assert layer.compressor.name == "h2o"
        assert torch.equal(layer.sink_keys, sink_keys) and torch.equal(layer.window.keys, win_keys)
        assert torch.equal(layer.window.pos, win_pos)
        new = layer.middle
        assert new.length == 48, "the h2o budget holds after the switch"
        # Every kept entry is one of the old entries, key, value and position unchanged.
        for h in range(new.positions.shape[0]):
            index = (new.positions[h][:, None] == old.positions[h][None, :]).int().argmax(1)
            assert torch.equal(old.positions[h][index], new.positions[h])
            assert torch.equal(old.keys[h][index], new.keys[h])
            assert torch.equal(old.values[h][index], new.values[h])
    # The session goes on under the new method's budget.
    stream(tiny, session.cache, random_ids(64, seed=6), 16)
    assert all(len(layer.compressor) <= 48 for layer in session.cache.compressed_layers)


def test_switch_with_room_restreams_every_entry_losslessly(tiny):
    ids = random_ids(200, seed=7)
    settings = lambda: CacheSettings(method="full", budget="1000", window=W, sinks=S, batch=BATCH)  # noqa: E731
    reference = tiny.new_session(settings())
    expected, _ = reference.feed(ids, chunk=50)
    switched = tiny.new_session(settings())
    switched.feed(ids[:150], chunk=50)
    old = [layer.middle for layer in switched.cache.compressed_layers]
    switched.switch_method("h2o")
    for layer, before in zip(switched.cache.compressed_layers, old):
        assert layer.middle.length == before.length > 0
        assert torch.equal(layer.middle.positions, before.positions)
        assert torch.equal(layer.middle.keys, before.keys) and torch.equal(layer.middle.values, before.values)
    # Same entries, so the following tokens see what the exact cache would have shown them.
    logits, _ = switched.feed(ids[150:], chunk=50)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_window_gives_back_the_memory_of_an_exact_prefill_once_compressed(tiny):
    # exact-then-compress holds every token in the window until the flush; afterwards the
    # window's buffers shrink to about the window, not to the prefill's size.
    cache = tiny.new_cache(CacheSettings(method="h2o", budget="32", window=W, sinks=S, batch=BATCH))
    cache.defer_eviction = True
    stream(tiny, cache, random_ids(600, seed=5), 200)
    cache.flush()
    for layer in cache.compressed_layers:
        live = layer.window.keys.shape[1]
        assert live <= W
        assert layer.window.capacity <= 2 * (live + WINDOW_SLACK)  # shared by keys, values, pos, scores


# -- a flush runs the layers side by side ----------------------------------------------------
@pytest.mark.parametrize("method", ["bumblebee", "h2o"])
def test_a_flush_on_two_threads_runs_the_layers_side_by_side_and_keeps_what_one_thread_keeps(tiny, method):
    import threading

    prompt = random_ids(1200, seed=7)  # held exact, then every layer hands 1,100+ tokens over at once

    def flushed(threads: int) -> tuple[list[torch.Tensor], set[str]]:
        cache = tiny.new_cache(CacheSettings(method=method, budget="64", window=32, sinks=4))
        cache.defer_eviction = True  # as an exact-then-compress prefill holds it
        stream(tiny, cache, prompt, 400)  # (the same threads in both runs: only the flush differs)
        names: set[str] = set()
        for layer in cache.compressed_layers:  # a spy: which thread evicts each layer

            def evict(count, run=layer.evict):
                names.add(threading.current_thread().name)
                run(count)

            layer.evict = evict
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cache.flush()
        finally:
            torch.set_num_threads(previous)
        kept = [t for layer in cache.compressed_layers for t in (layer.middle.positions, layer.middle.keys)]
        return kept, names

    alone, one_thread_names = flushed(1)
    side_by_side, two_thread_names = flushed(2)
    assert one_thread_names == {threading.current_thread().name}
    # Every layer was evicted on the pool (one worker may take both when the first is quick).
    assert two_thread_names and all(name.startswith("kvchat-flush") for name in two_thread_names)
    assert all(torch.equal(a, b) for a, b in zip(alone, side_by_side, strict=True))
