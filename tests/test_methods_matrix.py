"""Every registered method against the same specification (kvpress-style matrix).

The matrix is parametrized over `kvchat.compress.available()`, so a method joins it by
being registered. For each method:

- easy budget (>= every token ingested): the middle must be lossless, i.e. attention over
  sinks + middle + recent equals exact attention, on real keys/values of the embedded
  model, whether the middle arrives in one batch (after a prefill) or in batches;
- hard budget (1/8 of the middle): it runs, never holds more than the budget per head
  after any ingest, and returns well-formed entries;
- easy budget in a real chat turn: greedy output equals the `full` method token for token;
- the contract every compressor keeps whatever it computes: registry, a state-dict round
  trip that continues identically, determinism under a seed, `nbytes` = the bytes of its
  state, `reposition` applied to every key and position, weights of incoming entries kept
  while they fit, the budget held as the cache changes it, and `tokens()` (what a method
  switch hands over) being real tokens.

Methods with modes run the contract and the attention matrix in every mode (VARIANTS).

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
from kvchat.calibration.evaluate import attention_outputs, compress_middle
from kvchat.model.engine import Engine
from kvchat.settings import CacheSettings, SamplingSettings

pytestmark = pytest.mark.slow  # real keys/values and the real model

METHODS = compress.available()
DROPS_MIDDLE = {"window"}  # keeps sinks + window only, by definition
UNBOUNDED = {"full"}  # the exact reference: keeps every token, a budget does not apply
SINKS, RECENT = 16, 128
LAYERS = [1, 8, 15]  # the layers `real_qkv` captured
# Non-default modes that get the same specification as the defaults.
OTHER_MODES = [
    ("subgen", {"mode": "stream"}),
    ("balancekv", {"schedule": "prefill"}),
    ("balancekv", {"mode": "paper"}),
    ("balancekv", {"mode": "paper", "schedule": "prefill"}),
]
VARIANTS = [(m, {}) for m in METHODS] + [(m, p) for m, p in OTHER_MODES if m in METHODS]
VARIANT_IDS = [m + "".join(f":{value}" for value in p.values()) for m, p in VARIANTS]


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
@pytest.mark.parametrize(("method", "params"), VARIANTS, ids=VARIANT_IDS)
def test_easy_budget_attention_equals_full_attention(real_qkv, method, params, layer, batch):
    q, k, v = real_qkv[layer]
    n = k.shape[1]
    middle_size = n - SINKS - RECENT
    entries = compress_middle(
        method, q, k, v, budget=n, sinks=SINKS, recent=RECENT, layer=layer, batch=batch, params=params
    )
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
            keys[:, part].contiguous(),
            values[:, part].contiguous(),
            positions[:, part].contiguous(),
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
    from kvchat.calibration.realkv import essays_text

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
        assert min(layer.middle.length for layer in cache.compressed_layers) > 200, "the prompt must reach the middle"
    assert cache.entries_per_head() == cache.tokens_seen, "an easy budget drops nothing"
    assert result.token_ids == full_turn.token_ids, f"{method}: {result.text!r} != full: {full_turn.text!r}"


# -- the compressor contract (synthetic tensors: it holds whatever the data) -------------
HEADS, GROUP, DIM = 3, 3, 16


def make_variant(method, params, budget, seed=0):
    spec = compress.LayerSpec(1, HEADS, GROUP, DIM, torch.device("cpu"), torch.float32, seed)
    return compress.make(method, spec, budget, **params)


def batches(count, size, seed=0, first_position=0, log_weights=False):
    """`count` batches of random tokens (keys, values, positions, log-weights, scores)
    with consecutive positions."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(count):
        start = first_position + i * size
        positions = torch.arange(start, start + size).expand(HEADS, -1).contiguous()
        keys = torch.randn(HEADS, size, DIM, generator=gen)
        values = torch.randn(HEADS, size, DIM, generator=gen)
        weights = torch.rand(HEADS, size, generator=gen) * 2 if log_weights else None
        scores = torch.rand(HEADS, GROUP, size, generator=gen)
        yield keys, values, positions, weights, scores


def ingest_all(comp, stream):
    for keys, values, positions, weights, scores in stream:
        comp.ingest(keys, values, positions, log_weights=weights, scores=scores if comp.needs_attention else None)


def same_entries(a, b) -> bool:
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("keys", "values", "positions", "log_num", "log_den"))


@pytest.mark.parametrize("method", METHODS)
def test_registered_by_its_name_and_refuses_unknown_parameters(method):
    cls = compress.get(method)
    assert cls.name == method and cls.description.strip()
    with pytest.raises(ValueError):
        make_variant(method, {"no_such_parameter": 1}, 16)


@pytest.mark.parametrize(("method", "params"), VARIANTS, ids=VARIANT_IDS)
def test_state_dict_round_trip_continues_identically(method, params):
    stream = list(batches(16, 32))
    original = make_variant(method, params, 96)
    ingest_all(original, stream[:8])
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in original.state_dict().items()}
    ingest_all(original, stream[8:])
    restored = make_variant(method, params, 96)
    restored.load_state_dict(state)
    ingest_all(restored, stream[8:])
    assert same_entries(original.entries(), restored.entries())


@pytest.mark.parametrize(("method", "params"), VARIANTS, ids=VARIANT_IDS)
def test_the_same_seed_gives_the_same_middle(method, params):
    runs = []
    for _ in range(2):
        comp = make_variant(method, params, 48, seed=7)
        ingest_all(comp, batches(10, 32))
        runs.append(comp.entries())
    assert same_entries(*runs)


@pytest.mark.parametrize(("method", "params"), VARIANTS, ids=VARIANT_IDS)
def test_nbytes_is_the_bytes_of_every_state_tensor_but_the_generator(method, params):
    comp = make_variant(method, params, 96)
    ingest_all(comp, batches(8, 32))
    held = [v for k, v in comp.state_dict().items() if torch.is_tensor(v) and k != "rng"]
    assert comp.nbytes() == sum(t.numel() * t.element_size() for t in held)
    if method not in DROPS_MIDDLE:
        assert comp.nbytes() > 0


@pytest.mark.parametrize(("method", "params"), VARIANTS, ids=VARIANT_IDS)
def test_reposition_moves_every_key_and_position_as_told(method, params):
    comp = make_variant(method, params, 96)
    ingest_all(comp, batches(8, 32))
    before = comp.entries()
    comp.reposition(lambda keys, positions: (keys * 2 + 1, positions + 7))
    after = comp.entries()
    real = valid(before)
    assert torch.equal(valid(after), real)
    torch.testing.assert_close(after.keys[real], before.keys[real] * 2 + 1)
    assert torch.equal(after.positions[real], before.positions[real] + 7)
    assert torch.equal(after.log_num, before.log_num) and torch.equal(after.log_den, before.log_den)


@pytest.mark.parametrize(
    ("method", "params"),
    [v for v in VARIANTS if v[0] not in DROPS_MIDDLE],
    ids=[i for i, v in zip(VARIANT_IDS, VARIANTS) if v[0] not in DROPS_MIDDLE],
)
def test_weighted_entries_that_fit_are_kept_as_given(method, params):
    stream = list(batches(4, 30, log_weights=True))
    comp = make_variant(method, params, 1000)
    ingest_all(comp, stream)
    e = comp.entries()
    weights = torch.cat([b[3] for b in stream], 1)
    order = torch.where(valid(e), e.positions, 10**9).argsort(1)[:, : weights.shape[1]]
    assert torch.equal(torch.gather(e.positions, 1, order), torch.cat([b[2] for b in stream], 1))
    torch.testing.assert_close(torch.gather(e.log_num, 1, order), weights)
    torch.testing.assert_close(torch.gather(e.log_den, 1, order), weights)


@pytest.mark.parametrize(
    ("method", "params"),
    [v for v in VARIANTS if v[0] not in UNBOUNDED],
    ids=[i for i, v in zip(VARIANT_IDS, VARIANTS) if v[0] not in UNBOUNDED],
)
def test_budget_holds_when_the_cache_lowers_and_raises_it(method, params):
    comp = make_variant(method, params, 100)
    for step, batch in enumerate(batches(40, 16)):
        comp.budget = {15: 40, 30: 120}.get(step, comp.budget)  # a percentage budget moves
        ingest_all(comp, [batch])
        assert len(comp) <= comp.budget, f"over budget at step {step}"


@pytest.mark.parametrize(
    ("method", "params"),
    [v for v in VARIANTS if v[0] not in UNBOUNDED],
    ids=[i for i, v in zip(VARIANT_IDS, VARIANTS) if v[0] not in UNBOUNDED],
)
def test_an_ingest_of_no_tokens_brings_the_middle_within_a_lowered_budget(method, params):
    # How the cache refits a layer whose byte share was lowered (`refit`).
    comp = make_variant(method, params, 100)
    ingest_all(comp, batches(10, 16))
    comp.budget = 30
    none = torch.zeros(HEADS, 0, DIM)
    comp.ingest(
        none,
        none.clone(),
        torch.zeros(HEADS, 0, dtype=torch.long),
        scores=torch.zeros(HEADS, GROUP, 0) if comp.needs_attention else None,
    )
    assert len(comp) <= 30


@pytest.mark.parametrize(("method", "params"), VARIANTS, ids=VARIANT_IDS)
def test_handed_over_tokens_are_real_tokens_with_one_weight(method, params):
    # What a method switch re-streams: entries of the middle (keys, values, positions as
    # held), each with a = b; or None, when the method holds no such set.
    comp = make_variant(method, params, 64)
    ingest_all(comp, batches(10, 32))
    tokens, e = comp.tokens(), comp.entries()
    if tokens is None:
        assert comp.split_weights, "only split-weight methods may hold no real tokens"
        return
    real = torch.isfinite(tokens.log_den)
    assert torch.equal(tokens.log_num[real], tokens.log_den[real])
    assert real.sum() > 0 or method in DROPS_MIDDLE
    for h in range(HEADS if real.any() else 0):
        index = (tokens.positions[h][real[h]][:, None] == e.positions[h][None, :]).int().argmax(1)
        assert torch.equal(e.keys[h][index], tokens.keys[h][real[h]])
        assert torch.equal(e.values[h][index], tokens.values[h][real[h]])
        assert not (tokens.values[h][real[h]] == 0).all(-1).any(), "no zero-value placeholder"
