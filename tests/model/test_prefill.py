"""Prefill of long input (ARCHITECTURE.md section 4): streaming vs exact-then-compress,
the automatic choice between them, and cancelling between chunks.

Runs a small random-weight Llama with the embedded model's attention shape (9 query
heads, 3 KV heads, head_dim 64) and 2 layers: prefill memory is a property of the cache,
not of the weights, and no weights are downloaded.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_llama import build_tiny_llama, engine_for, random_ids

from kvchat import compress
from kvchat.errors import Cancelled
from kvchat.settings import CacheSettings, SamplingSettings

BOUNDED = [m for m in compress.available() if m != "full"]  # full keeps everything by design
S, W, B, CHUNK = 4, 32, 32, 64
INPUT = 16 * (S + W + B)  # 1,088 tokens: 16x what the cache may keep
# Per entry, besides key and value: position, a, b, per-query-head scores, a method's
# per-entry links: at most 8 scalars of at most 8 bytes (see test_cache.py). Per layer,
# at most one random generator state.
META_BYTES = 8 * 8
RNG_BYTES = torch.Generator().get_state().numel()


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_llama()


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return engine_for(tiny_model)


def bound(cache, entries_per_head: int) -> int:
    """Bytes of `entries_per_head` entries per KV head in every layer (key + value in the
    cache's dtype + META_BYTES), plus one RNG state per layer."""
    spec = cache.specs[0]
    per_entry = 2 * spec.head_dim * cache.compressed_layers[0].sink_keys.element_size() + META_BYTES
    return len(cache.compressed_layers) * (spec.num_kv_heads * entries_per_head * per_entry + RNG_BYTES)


def watch(session):
    """Record the cache's bytes at its peak of every forward pass (just before `settle`
    streams the window's overflow out: the window then also holds the new chunk)."""
    cache = session.cache
    peaks: list[int] = []
    settle = cache.settle

    def recording_settle():
        peaks.append(cache.nbytes())
        settle()

    cache.settle = recording_settle
    return peaks


def settings(method: str, mode: str, **kw) -> CacheSettings:
    return CacheSettings(method=method, budget=str(B), window=W, sinks=S, batch=16, prefill_mode=mode, **kw)


@pytest.mark.parametrize("method", BOUNDED)
def test_streaming_prefill_peak_is_bounded_by_budget_window_and_chunk(tiny, method):
    session = tiny.new_session(settings(method, "streaming"))
    cache = session.cache
    peaks = watch(session)
    after_chunk = []
    logits, mode = session.feed(
        random_ids(INPUT), on_progress=lambda done, total: after_chunk.append(cache.nbytes()), chunk=CHUNK
    )
    assert mode == "streaming" and cache.tokens_seen == INPUT and torch.isfinite(logits).all()
    assert len(peaks) == len(after_chunk) == INPUT // CHUNK + (INPUT % CHUNK > 0)
    assert max(peaks) <= bound(cache, S + W + B + CHUNK), "peak over budget + window + chunk"
    assert max(after_chunk) <= bound(cache, S + W + B), "between chunks, over budget + window"
    # 16x the bound went in: an exact cache of it would be several times the peak.
    assert bound(cache, S + W + B + CHUNK) < cache.full_cache_bytes() / 4


@pytest.mark.parametrize("method", ["h2o", "chelsea", "subgen"])
def test_exact_then_compress_holds_the_whole_input_until_flush(tiny, method):
    session = tiny.new_session(settings(method, "exact-then-compress"))
    cache = session.cache
    held = []

    def progress(done, total):
        held.append((done, cache.entries_per_head(), max(layer.middle.length for layer in cache.compressed_layers)))

    peaks = watch(session)
    ids = random_ids(INPUT, seed=1)
    logits, mode = session.feed(ids, on_progress=progress, chunk=CHUNK)
    assert mode == "exact-then-compress"
    # During the prefill every token is held exactly and nothing reaches the compressor...
    assert all(entries == done and middle == 0 for done, entries, middle in held)
    assert max(peaks) > bound(cache, S + W + B + CHUNK), "the exact prefill's memory grows with the input"
    assert max(peaks) >= cache.full_cache_bytes()
    # ... so its last logits are those of exact attention over the whole input ...
    exact = tiny.new_session(settings("full", "streaming"))
    expected, _ = exact.feed(ids, chunk=CHUNK)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # ... and once flushed the cache is compressed into the bound.
    assert not cache.defer_eviction
    assert cache.entries_per_head() <= S + W + B and cache.nbytes() <= bound(cache, S + W + B)
    assert all(layer.middle.length > 0 for layer in cache.compressed_layers)


def test_auto_mode_streams_when_the_exact_prefill_would_not_fit_the_memory_limit(tiny):
    per_token = tiny.loaded.bytes_per_token()
    ids = random_ids(INPUT, seed=2)
    small = tiny.new_session(settings("h2o", "auto", prefill_memory=100 * per_token))
    entries = []
    _, mode = small.feed(ids, on_progress=lambda d, t: entries.append(small.cache.entries_per_head()), chunk=CHUNK)
    assert mode == "streaming"
    assert max(entries) <= S + W + B, "auto's streaming must really stream"
    roomy = tiny.new_session(settings("h2o", "auto"))  # default limit: 1 GiB
    _, mode = roomy.feed(ids[:200], chunk=CHUNK)
    assert mode == "exact-then-compress"


def test_auto_mode_limit_is_the_exact_kv_bytes_of_cache_plus_input(tiny):
    per_token = tiny.loaded.bytes_per_token()
    ids = random_ids(300, seed=3)
    session = tiny.new_session(settings("h2o", "streaming"))
    session.feed(ids[:100], chunk=CHUNK)
    held = session.cache.entries_per_head()  # S + W + B after a streamed 100 tokens
    session.settings.prefill_mode = "auto"
    session.settings.prefill_memory = (held + 100) * per_token
    assert session.feed(ids[100:200], chunk=CHUNK)[1] == "exact-then-compress"
    held = session.cache.entries_per_head()
    session.settings.prefill_memory = (held + 100) * per_token - 1
    assert session.feed(ids[200:300], chunk=CHUNK)[1] == "streaming"


# -- cancel ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat(tiny_model, embedded):
    """The tiny model with the real tokenizer (same vocabulary): sends render text."""
    return engine_for(tiny_model, embedded.tokenizer)


def cancel_after(chunks: int):
    event = threading.Event()
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == chunks:
            event.set()

    return event, progress, calls


def check_usable(session, held_before):
    result = session.send("Thanks. Now say hi.", SamplingSettings(max_new_tokens=4))
    assert not result.cancelled and result.stop_reason in ("end", "length")
    assert result.metrics.prompt_tokens > 0
    assert session.cache.tokens_seen == len(session.token_ids) > held_before
    assert session.messages[-1]["role"] == "assistant"
    assert session.cache.entries_per_head() <= S + W + B


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["streaming", "exact-then-compress"])
def test_cancel_between_chunks_raises_and_keeps_the_session(chat, mode):
    session = chat.new_session(settings("h2o", mode))
    event, progress, calls = cancel_after(2)
    with pytest.raises(Cancelled):
        session.feed(random_ids(INPUT, seed=4), on_progress=progress, cancel=event, chunk=CHUNK)
    assert calls == [CHUNK, 2 * CHUNK], "stopped at the first chunk boundary after the event"
    # What was fed before the cancel stays, consistently, in the cache and the transcript.
    assert len(session.token_ids) == session.cache.tokens_seen == 2 * CHUNK
    assert not session.cache.defer_eviction
    assert session.cache.entries_per_head() <= S + W + B
    check_usable(session, 2 * CHUNK)


@pytest.mark.slow
def test_cancel_during_a_turns_prefill_returns_a_cancelled_turn(chat):
    session = chat.new_session(settings("h2o", "streaming"))
    document = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(120))
    event, progress, calls = cancel_after(1)
    result = session.send(document, SamplingSettings(max_new_tokens=4), on_progress=progress, cancel=event)
    assert result.cancelled and result.stop_reason == "cancelled" and result.token_ids == []
    assert len(calls) == 1 and calls[0] < result.metrics.prompt_tokens
    assert session.cache.tokens_seen == len(session.token_ids) == calls[0]
    check_usable(session, calls[0])


@pytest.mark.skipif(
    not __import__("kvchat.runtime", fromlist=["cpu_has_fast_bf16"]).cpu_has_fast_bf16(),
    reason="the blocked prefill kernel runs only on a CPU with native bf16",
)
@pytest.mark.parametrize("method", ["window", "h2o", "chelsea"])
def test_a_bf16_prefill_in_the_blocked_kernel_agrees_with_the_fused_one(tiny_model, method):
    # The same bf16 model and document, once with every chunk in the blocked bf16 kernel
    # and once in PyTorch's fused SDPA (score-based methods then take the exact mass from
    # the explicit kernel): next-token distributions within bf16 rounding of each other.
    import copy

    from tiny_llama import LoadedModel, NoTextTokenizer

    from kvchat.model.engine import Engine

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    engine = Engine(LoadedModel(model, NoTextTokenizer(), "tiny", "tiny", torch.device("cpu"), torch.bfloat16, None))
    engine.calibrated_params = lambda method, layer: {}
    ids = random_ids(600, seed=5)
    logits = []
    for blocked in (True, False):
        session = engine.new_session(settings(method, "exact-then-compress"))
        for layer in session.cache.compressed_layers:
            layer.blocked_prefill = blocked
            layer.mass_stride = 1
        out, _ = session.feed(ids, chunk=CHUNK)
        logits.append(torch.log_softmax(out, -1))
    kl = (logits[1].exp() * (logits[1] - logits[0])).sum()
    assert kl < 1e-3
