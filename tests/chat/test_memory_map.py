"""The memory map: for every message and document, the share of its
tokens the cache still represents, averaged over layers and KV heads, and per layer.

The cache part runs on synthetic tensors whose values carry the index of the token they
belong to (values are never re-rotated), so where a held entry came from can be checked
exactly, through any number of position compactions. The session part runs the real
embedded model."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from kvchat import compress
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.chat.memory_map import memory_lines, position_cells, shade, strip_cells
from kvchat.kv_types import LayerGeometry
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.turns import MemoryReport, SpanKept, user_message

HEADS, DIM = 3, 8


def synthetic_cache(
    method: str, *, budget: str = "64", window: int = 32, max_positions: int = 300, params: dict | None = None
) -> CompressedCache:
    return CompressedCache(
        num_layers=2,
        num_kv_heads=HEADS,
        group_size=3,
        head_dim=DIM,
        device=torch.device("cpu"),
        dtype=torch.float32,
        geometry=[LayerGeometry(inv_freq=1 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)))] * 2,
        max_positions=max_positions,
        method=method,
        budget=budget,
        window=window,
        sinks=4,
        batch=16,
        seed=0,
        params=params,
    )


def feed_tagged(cache: CompressedCache, count: int, chunk: int = 7) -> None:
    """Feed `count` tokens; each token's values hold its own index in channel 0."""
    gen = torch.Generator().manual_seed(0)
    fed = 0
    while fed < count:
        n = min(chunk, count - fed)
        cache.positions_for(n)
        for layer in range(len(cache)):
            values = torch.zeros(1, HEADS, n, DIM)
            values[..., 0] = torch.arange(cache.tokens_seen, cache.tokens_seen + n).float()
            cache.update(torch.randn(1, HEADS, n, DIM, generator=gen), values, layer)
        for layer in cache.compressed_layers:
            if layer.compressor.needs_attention and layer.middle.length:
                layer.compressor.observe(torch.rand(HEADS, 3, layer.middle.length, generator=gen))
        cache.settle()
        fed += n


def assert_every_entry_maps_to_its_token(cache: CompressedCache) -> None:
    for layer in cache.compressed_layers:
        middle = layer.middle
        if middle.length:
            real = torch.isfinite(middle.log_den)
            tokens = cache.token_index(layer, middle.positions)
            assert torch.equal(tokens[real], middle.values[..., 0][real].long())
        window_tokens = cache.token_index(layer, layer.window.pos.expand(HEADS, -1))
        assert torch.equal(window_tokens, layer.window.values[..., 0].long())
        assert torch.equal(cache.token_index(layer, layer.sink_pos.expand(HEADS, -1)), layer.sink_values[..., 0].long())


@pytest.mark.parametrize("method", ["h2o", "window"])
def test_held_positions_map_back_to_their_tokens_through_compactions(method):
    cache = synthetic_cache(method)
    feed_tagged(cache, 1000)
    assert cache.compactions >= 3  # positions were re-packed several times
    assert_every_entry_maps_to_its_token(cache)


def test_position_origins_survive_a_state_round_trip():
    cache = synthetic_cache("h2o")
    feed_tagged(cache, 700)
    assert cache.compactions >= 2
    twin = cache.copy()  # through meta() + layer_states(), as a snapshot is saved and loaded
    assert_every_entry_maps_to_its_token(twin)
    bounds = [(0, 350), (350, 700)]
    assert twin.memory_map(bounds) == cache.memory_map(bounds)


def test_a_full_cache_holds_every_span_whole():
    cache = synthetic_cache("full", max_positions=10_000)
    feed_tagged(cache, 500)
    shares = cache.memory_map([(0, 4), (4, 300), (300, 500)])
    assert shares == [[1.0, 1.0, 1.0]] * 2


def test_a_window_cache_holds_the_sinks_and_the_recent_tokens_only():
    cache = synthetic_cache("window", max_positions=10_000)  # 25% of tokens seen is not asked: 64 entries mid
    feed_tagged(cache, 600)
    sinks, old, recent = cache.memory_map([(0, 4), (4, 500), (500, 600)])[0]
    assert sinks == 1.0
    assert old == 0.0  # window keeps no middle: the tokens between sinks and window are gone
    window_tokens = len(cache.compressed_layers[0].window)
    assert recent == pytest.approx(min(1.0, window_tokens / 100))


def test_an_entry_that_stands_for_several_tokens_counts_them_all():
    """Merged entries (a subgen cluster, a chelsea merge) are credited with the tokens
    they stand for: the tokens represented add up to the tokens that went in."""
    cache = synthetic_cache("subgen", budget="48", max_positions=10_000, params={"mode": "stream"})
    feed_tagged(cache, 400)
    layer = cache.compressed_layers[0]
    counts = torch.where(torch.isfinite(layer.middle.log_den), layer.middle.log_den.exp(), torch.zeros(()))
    assert int((counts > 1.5).sum()) > 0  # some entries do stand for several tokens
    held = cache.memory_map([(0, 400)])[0][0] * 400
    represented = 4 + counts.sum(1).mean().item() + len(layer.window)
    assert held == pytest.approx(min(400, represented), rel=1e-6)


def test_strip_cells_give_every_span_a_cell_and_the_rest_by_length():
    spans = [SpanKept(0, 10, "user", 1.0), SpanKept(10, 990, "document", 0.2), SpanKept(990, 1000, "user", 1.0)]
    cells = strip_cells(spans, 40)
    assert len(cells) == 40 and set(cells) == {0, 1, 2}
    assert cells.count(1) >= 36  # the long document takes almost the whole strip
    assert position_cells(160, 40) == sorted(position_cells(160, 40)) and len(position_cells(160, 40)) == 40
    assert shade(0.0) == "·" and shade(1.0) == "█" and shade(0.5) == "▒"


# -- the real model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def document(embedded):
    from kvchat.calibration.realkv import essays_text

    return essays_text()[:9000]  # about 2,000 tokens


@pytest.fixture(scope="module")
def two_turns(engine, document):
    """A document and a question, answered, then a follow-up, under h2o at 25%."""
    session = engine.new_session(CacheSettings(method="h2o", budget="25%", window=64, batch=16))
    sampling = SamplingSettings(max_new_tokens=8)
    session.send(user_message("What is the essay about?", document), sampling, document=document)
    session.send("Say more.", sampling)
    return session


def test_spans_cover_every_token_fed_in_order(two_turns):
    spans = two_turns.spans
    assert spans[0].start == 0 and spans[-1].end == len(two_turns.token_ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))


def test_spans_tell_the_document_from_the_question_and_the_answers(two_turns, document):
    roles = [s.role for s in two_turns.spans]
    assert roles == ["system", "document", "user", "assistant", "user", "assistant"]
    doc = two_turns.spans[1]
    fed_text = two_turns.engine.tokenizer.decode(two_turns.token_ids[doc.start : doc.end])
    assert fed_text.strip()[:200] == document.strip()[:200]
    assert [s.message for s in two_turns.spans] == [0, 0, 0, 1, 2, 3]


def test_the_recent_turn_is_held_whole_and_the_old_document_only_partly(two_turns):
    memory = two_turns.memory_map()
    document, newest = memory[1], memory[-1]
    assert newest.kept == 1.0
    assert 0.05 < document.kept < 0.6  # 25% of everything seen, most of it the document
    assert len(document.layers) == two_turns.engine.loaded.num_layers
    assert all(0.0 <= share <= 1.0 for span in memory for share in span.layers)


def test_the_report_is_plain_data_with_a_per_position_view(two_turns):
    report = two_turns.memory_report()
    json.dumps(report.as_dict())  # no tensors
    assert report.cell_bounds[0][0] == 0 and report.cell_bounds[-1][1] == len(two_turns.token_ids)
    assert len(report.cell_layers) == two_turns.engine.loaded.num_layers
    assert report.cell_kept[-1] == 1.0 and min(report.cell_kept) < 0.5


def test_a_saved_report_reads_back_as_it_was_saved(two_turns):
    report = two_turns.memory_report(cell_layers=False)
    saved = json.loads(json.dumps(report.as_dict()))
    assert MemoryReport.from_dict(saved) == report


def test_a_prefill_stopped_midway_records_the_part_that_was_fed(engine, document):
    session = engine.new_session(CacheSettings(method="window", budget="256", window=64, prefill_mode="streaming"))
    cancel = threading.Event()
    session.send(
        user_message("Why?", document),
        SamplingSettings(max_new_tokens=4),
        on_progress=lambda done, total: cancel.set(),
        cancel=cancel,
        document=document,
    )
    assert session.spans[-1].end == len(session.token_ids) < 1500


@pytest.mark.parametrize("method", compress.available())
def test_every_method_has_a_memory_map_within_bounds(engine, document, method):
    document = document[:3000]  # about 650 tokens: at 25% with a window of 64, every method compresses
    session = engine.new_session(CacheSettings(method=method, budget="25%", window=64, batch=16))
    session.send(user_message("Summarise.", document), SamplingSettings(max_new_tokens=4), document=document)
    memory = session.memory_map()
    assert memory[-1].end == session.cache.tokens_seen
    assert all(0.0 <= span.kept <= 1.0 for span in memory)
    assert memory[-1].kept == 1.0  # the answer sits in the exact window
    assert memory[1].role == "document" and memory[1].kept > 0.0
    # Methods whose entries stand for several tokens (balancekv's survivors, chelsea's
    # merges) may represent the whole document with far fewer entries; a method that
    # keeps plain tokens represents only what it holds.
    if method != "full":
        assert session.cache.entries_per_head() < session.cache.tokens_seen


def test_a_resumed_session_shows_the_same_map(engine, two_turns, store):
    from kvchat.chat import persist

    session_id = persist.new_session_row(store, two_turns, "memory")
    persist.save_snapshot(store, session_id, two_turns)
    resumed, _ = persist.resume(store, engine, session_id)
    assert resumed.spans == two_turns.spans
    assert [s.kept for s in resumed.memory_map()] == [s.kept for s in two_turns.memory_map()]


def test_the_saved_map_prints_as_a_table_without_loading_the_model(two_turns, store, capsys, monkeypatch, tmp_path):
    from kvchat import cli
    from kvchat.chat import persist

    session_id = persist.new_session_row(store, two_turns, "memory table")
    persist.save_snapshot(store, session_id, two_turns)
    monkeypatch.setattr(cli.options, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    code = cli.main(["sessions", "show", str(session_id), "--memory", "--layers", "--db", str(store.path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "document" in out and "100.0%" in out and "L29" in out
    assert memory_lines(two_turns.memory_report())[0].startswith("method h2o")


def test_a_session_without_a_saved_map_says_how_to_get_one(store, capsys):
    from kvchat import cli

    session_id = store.create_session("old", "fp", "window", {})
    code = cli.main(["sessions", "show", str(session_id), "--memory", "--db", str(store.path)])
    err = capsys.readouterr().err
    assert code != 0 and "no saved memory map" in err and "--resume" in err
    assert "Traceback" not in err
