"""Decode-time compressor work runs on one torch thread and hands the engine its count
back (kvchat/runtime.py, `one_thread`); the cache applies it to every method. What the
app's UI thread reads runs no tensor op at all (kvchat/tui/flows/runner.py)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvchat.cache.compressed_cache import CompressedCache
from kvchat.compress.h2o import HeavyHitters
from kvchat.kv_types import LayerGeometry
from kvchat.runtime import SMALL_INGEST, one_thread


class CountingH2O(HeavyHitters):
    """h2o that records the torch thread count its ingest and observe see."""

    seen: list[tuple[str, int]] = []

    def ingest(self, keys, *args, **kwargs):
        CountingH2O.seen.append(("ingest", torch.get_num_threads()))
        return super().ingest(keys, *args, **kwargs)

    def observe(self, mass):
        CountingH2O.seen.append(("observe", torch.get_num_threads()))
        return super().observe(mass)


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def layer_of(cache: CompressedCache):
    layer = cache.compressed_layers[0]
    layer.compressor = CountingH2O(layer.spec, layer.compressor.budget)
    return layer


def make_cache() -> CompressedCache:
    return CompressedCache(
        num_layers=1,
        num_kv_heads=3,
        group_size=3,
        head_dim=8,
        device=torch.device("cpu"),
        dtype=torch.float32,
        geometry=[LayerGeometry(inv_freq=torch.ones(4))],
        max_positions=100_000,
        method="h2o",
        budget="64",
        window=16,
        sinks=4,
        batch=16,
    )


def fill(layer, count: int) -> None:
    layer.append(torch.randn(3, count, 8), torch.randn(3, count, 8), torch.arange(count))


def test_a_decode_batch_is_ingested_on_one_thread_and_the_count_comes_back(two_threads):
    CountingH2O.seen = []
    layer = layer_of(make_cache())
    fill(layer, 100)
    layer.evict(64)
    layer._observe([torch.zeros(3, 3, 4), torch.rand(3, 3, layer.middle.length), torch.zeros(3, 3, len(layer.window))])
    assert CountingH2O.seen == [("ingest", 1), ("observe", 1)]
    assert torch.get_num_threads() == 2


def test_a_flushed_document_is_ingested_on_the_engine_threads(two_threads):
    CountingH2O.seen = []
    layer = layer_of(make_cache())
    fill(layer, SMALL_INGEST + 40)
    layer.evict(SMALL_INGEST + 1)
    assert CountingH2O.seen == [("ingest", 2)]


def test_the_count_comes_back_when_the_work_fails(two_threads):
    with pytest.raises(RuntimeError), one_thread():
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_a_recall_runs_on_one_thread_but_for_a_chunks_scoring(two_threads):
    from recall.test_recall import planted_layer

    layer, (query, _, _) = planted_layer(recall=2)
    index = layer.recall.index
    seen = []
    top = index.top
    index.top = lambda q, k, bias=None: (seen.append((q.shape[1], torch.get_num_threads())), top(q, k, bias))[1]
    layer.recall.recall(query, layer.middle)  # a decode step: one query row per head
    layer.recall.recall(torch.cat([query] * 4, 1), layer.middle)  # a prefill chunk of four
    assert [threads for _, threads in seen] == [1, 2]
    assert torch.get_num_threads() == 2


class TensorOps(TorchFunctionMode):
    """Records the tensor functions called inside it (attribute reads aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_counting_a_layers_entries_runs_no_tensor_op():
    layer = layer_of(make_cache())
    fill(layer, 100)
    layer.evict(64)
    middle = layer.middle
    held = int((torch.isfinite(middle.log_num) | torch.isfinite(middle.log_den)).sum(1).max())
    with TensorOps() as ops:
        count = layer.entry_count()
    assert ops.calls == []
    assert count == layer.sink_keys.shape[1] + held + len(layer.window) and held > 0
