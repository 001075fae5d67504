"""Every registered method against the same specification (kvpress-style matrix).

The matrix is parametrized over `kvchat.compress.available()`, so a method joins it by
being registered. For each method:

- easy budget (>= every token ingested): the middle must be lossless, i.e. attention over
  sinks + middle + recent equals exact attention, on real keys/values of the embedded
  model, whether the middle arrives in one batch (after a prefill) or in batches;
- hard budget (1/8 of the middle): it runs, never holds more than the budget per head
  after any ingest, and returns well-formed entries;
- easy budget in a real chat turn: greedy output equals the `full` method token for token.

`window` (StreamingLLM) is the one method whose memory is the window itself: its middle
is empty by definition whatever the budget, so its "easy budget" is a window covering
every token (used in the chat-turn test); in the attention matrix it is held to having
an empty middle.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvchat import compress
from kvchat.engine import CacheSettings, Engine, SamplingSettings
from kvchat.evaluate import attention_outputs, compress_middle

pytestmark = pytest.mark.slow  # real keys/values and the real model

METHODS = compress.available()
DROPS_MIDDLE = {"window"}  # keeps sinks + window only, by definition
UNBOUNDED = {"full"}  # the exact reference: keeps every token, a budget does not apply
SINKS, RECENT = 16, 128
LAYERS = [1, 8, 15]  # the layers `real_qkv` captured


def valid(entries) -> torch.Tensor:
    """[H, n] mask of real (non-padding) entries: padding has a = b = -inf."""
    return torch.isfinite(entries.log_num) | torch.isfinite(entries.log_den)


def outputs(q, k, v, middle):
    """(compressed, exact) attention outputs of the last RECENT queries, causal among them."""
    return attention_outputs(q, k, v, middle, sinks=SINKS, recent=RECENT)


def test_the_matrix_covers_the_baselines():
    assert {"full", "window", "h2o"} <= set(METHODS)


@pytest.mark.parametrize("batch", [None, 64], ids=["one-batch", "batches-of-64"])
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("method", METHODS)
def test_easy_budget_attention_equals_full_attention(real_qkv, method, layer, batch):
    q, k, v = real_qkv[layer]
    n = k.shape[1]
    middle_size = n - SINKS - RECENT
    entries = compress_middle(method, q, k, v, budget=n, sinks=SINKS, recent=RECENT, layer=layer, batch=batch)
    if method in DROPS_MIDDLE:
        assert int(valid(entries).sum()) == 0
        return
    # Nothing is dropped or merged: every head keeps each middle token once...
    kept = [sorted(entries.positions[i][valid(entries)[i]].tolist()) for i in range(k.shape[0])]
    assert all(p == list(range(SINKS, SINKS + middle_size)) for p in kept)
    approx, exact = outputs(q, k, v, entries)
    # ... and attention is exact up to float32 rounding.
    torch.testing.assert_close(approx, exact, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in UNBOUNDED])
def test_hard_budget_is_respected_after_every_ingest(real_qkv, method):
    q, k, v = real_qkv[8]
    h, n, d = k.shape
    mid = slice(SINKS, n - RECENT)
    middle_size = mid.stop - mid.start
    budget = middle_size // 8
    spec = compress.LayerSpec(8, h, q.shape[0] // h, d, k.device, k.dtype, 0)
    comp = compress.make(method, spec, budget)
    positions = torch.arange(n)[mid].expand(h, -1).contiguous()
    scores = torch.rand(h, q.shape[0] // h, middle_size, generator=torch.Generator().manual_seed(0))
    keys, values = k[:, mid].contiguous(), v[:, mid].contiguous()
    for start in range(0, middle_size, 64):
        part = slice(start, start + 64)
        comp.ingest(
            keys[:, part].contiguous(), values[:, part].contiguous(), positions[:, part].contiguous(),
            scores=scores[..., part].contiguous() if comp.needs_attention else None,
        )
        e = comp.entries()
        assert int(valid(e).sum(1).max()) <= budget, f"over budget after {start + 64} tokens"
        assert len(comp) <= budget

    e = comp.entries()
    m = e.length
    assert e.keys.shape == (h, m, d) and e.values.shape == (h, m, d)
    assert e.positions.shape == (h, m) and e.log_num.shape == (h, m) and e.log_den.shape == (h, m)
    assert e.keys.dtype == k.dtype and e.positions.dtype == torch.long and e.log_num.dtype == torch.float32
    assert torch.isfinite(e.keys).all() and torch.isfinite(e.values).all()
    assert not e.log_num.isnan().any() and not e.log_den.isnan().any()
    assert not (e.log_num == math.inf).any() and not (e.log_den == math.inf).any()
    ok = valid(e)
    # Every real entry stands at a position inside the middle it summarises.
    assert ((e.positions >= mid.start) & (e.positions < mid.stop))[ok].all()
    if method not in DROPS_MIDDLE:
        assert int(ok.sum(1).min()) > 0, "a compressing method must keep something"
    # Attention over the compressed middle is well defined for every query.
    approx, _ = outputs(q, k, v, e)
    assert torch.isfinite(approx).all()


@pytest.mark.parametrize("method", sorted(UNBOUNDED))
def test_unbounded_reference_ignores_the_budget(real_qkv, method):
    q, k, v = real_qkv[8]
    n = k.shape[1]
    entries = compress_middle(method, q, k, v, budget=8, sinks=SINKS, recent=RECENT, batch=64)
    assert entries.length == n - SINKS - RECENT


PROMPT_CHARS = 1100  # about 300 tokens of essay + the question
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def chat_engine(embedded):
    return Engine(embedded)


@pytest.fixture(scope="module")
def chat_prompt():
    from kvchat.realkv import essays_text

    text = essays_text()[:PROMPT_CHARS]
    return f"{text}\n\nIn one sentence, what is this passage about?"


def greedy_turn(engine, prompt, method, window):
    session = engine.new_session(CacheSettings(method=method, budget="100000", window=window, sinks=4, batch=16))
    result = session.send(prompt, SamplingSettings(max_new_tokens=NEW_TOKENS, temperature=0.0))
    return session, result


@pytest.fixture(scope="module")
def full_turn(chat_engine, chat_prompt):
    session, result = greedy_turn(chat_engine, chat_prompt, "full", 32)
    assert 250 <= result.metrics.prompt_tokens <= 400
    assert len(result.token_ids) == NEW_TOKENS, "the reference answer should run to the token limit"
    return result


@pytest.mark.parametrize("method", METHODS)
def test_easy_budget_chat_turn_matches_full_greedy(chat_engine, chat_prompt, full_turn, method):
    # A 32-token window makes ~90% of the prompt stream through the compressor; `window`
    # gets a window covering the whole turn instead (its only lossless setting).
    window = 4096 if method in DROPS_MIDDLE else 32
    session, result = greedy_turn(chat_engine, chat_prompt, method, window)
    cache = session.cache
    if method not in DROPS_MIDDLE:
        assert min(layer.middle.length for layer in cache._layers) > 200, "the prompt must reach the middle"
    assert cache.entries_per_head() == cache.tokens_seen, "an easy budget drops nothing"
    assert result.token_ids == full_turn.token_ids, (
        f"{method}: {result.text!r} != full: {full_turn.text!r}"
    )
