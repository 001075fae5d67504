"""The family matrix: every model family kvchat runs, on a tiny random-weight model of it
(tests/tiny_families.py), loaded through `load_model` from a folder with the embedded
model's tokenizer. A family joins by one adapter (kvchat/model/families/) and one row in
FAMILIES.

For each family:
- `full` gives transformers' own greedy `generate`, token for token;
- every compressing method runs, in float32 and on the fast CPU path (int8 weights, bf16),
  and holds fewer entries than tokens;
- a window that holds every token gives what `full` gives;
- a compaction's re-rotation is the model's own RoPE: keys turned by a shift equal the keys
  of a forward at the shifted positions (per layer: its RoPE base and scaling, partial
  rotary, no RoPE);
- the recall tier's cold keys turn with their layer's RoPE at a compaction;
- a session saved to SQLite and resumed answers as the session held in memory does;
- the calibration's capture of queries, keys and values runs (Gemma 2's soft-capping
  included).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from tiny_families import FAMILIES, SLIDING, build_family
from tiny_llama import random_ids

from kvchat import compress
from kvchat.calibration.realkv import capture_qkv
from kvchat.chat import persist
from kvchat.kv_types import rerotate
from kvchat.model.engine import Engine
from kvchat.model.loading import load_model
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage.db import Store

pytestmark = pytest.mark.slow  # a model per family (seconds each)

FAMILY_IDS = list(FAMILIES)
METHODS = [m for m in compress.available() if m != "full"]
EXACT = CacheSettings(method="full", budget="100000")
PROMPT = 200  # tokens: past every sliding window, across several prefill chunks
CHUNK = 64
DECODE = 12
# Small enough that every method compresses a 600-token prompt, with recall on.
SMALL = {"budget": "25%", "window": 32, "sinks": 4, "batch": 16, "recall": 16}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Each family's tiny model saved as a Hugging Face folder, built on first use."""
    built: dict[str, Path] = {}

    class Folders(dict):
        def __missing__(self, family: str) -> Path:
            folder = tmp_path_factory.mktemp(family)
            build_family(family).save_pretrained(folder)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (tokenizer_dir / name).is_file():
                    shutil.copy(tokenizer_dir / name, folder / name)
            self[family] = folder
            return folder

    return Folders(built)


@pytest.fixture(scope="module")
def engines(family_dirs, tmp_path_factory):
    """(family, dtype) -> an engine on that family's tiny model, loaded once. The int8
    weight cache a load writes goes to a home of this module's own."""
    home = tmp_path_factory.mktemp("home")

    class Engines(dict):
        def __missing__(self, key: tuple[str, str]) -> Engine:
            family, dtype = key
            with pytest.MonkeyPatch.context() as env:
                env.setenv("KVCHAT_HOME", str(home))
                loaded = load_model(str(family_dirs[family]), device="cpu", dtype=dtype)
            engine = Engine(loaded)
            # Random weights have nothing to calibrate: no per-layer method parameters,
            # and every layer recalls (`kvchat.calibration.calibrate.recall_layers`).
            engine.calibrated_params = lambda method, layer: {}  # type: ignore[method-assign]
            engine._measured["recall_layers"] = list(range(engine.loaded.num_layers))
            self[key] = engine
            return engine

    return Engines()


def greedy(engine: Engine, settings: CacheSettings, prompt: list[int], steps: int):
    """Feed `prompt` in CHUNK-token chunks, then decode `steps` greedy tokens; (tokens, session)."""
    session = engine.new_session(settings)
    logits, _ = session.feed(prompt, chunk=CHUNK)
    tokens = []
    for _ in range(steps):
        assert bool(torch.isfinite(logits).all())
        tokens.append(int(logits.argmax()))
        logits = engine.forward([tokens[-1]], session.cache)
    return tokens, session


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_full_gives_transformers_greedy_generate(engines, family):
    engine = engines[family, "float32"]
    prompt = random_ids(PROMPT, seed=1)
    ours, _ = greedy(engine, EXACT, prompt, DECODE)
    model = engine.model
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=DECODE, min_new_tokens=DECODE, do_sample=False)
    finally:
        model.set_attn_implementation("kvchat")
    assert ours == out[0, PROMPT:].tolist()


@pytest.mark.parametrize("dtype", ["float32", "int8"])  # exact, and the CPU's fast path (int8 weights, bf16)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILY_IDS)
def test_every_method_runs_and_compresses(engines, family, method, dtype):
    engine = engines[family, dtype]
    tokens, session = greedy(engine, CacheSettings(method=method, **SMALL), random_ids(600, seed=2), 6)
    assert len(tokens) == 6
    cache = session.cache
    assert cache.entries_per_head() < cache.tokens_seen


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_a_window_holding_every_token_gives_what_full_gives(engines, family):
    engine = engines[family, "float32"]
    prompt = random_ids(PROMPT, seed=3)
    roomy = CacheSettings(method="window", budget="100000", window=PROMPT + DECODE + 8, recall=0)
    assert greedy(engine, roomy, prompt, DECODE)[0] == greedy(engine, EXACT, prompt, DECODE)[0]


def held_keys(engine: Engine, ids: list[int], start: int) -> list[torch.Tensor]:
    """Every layer's cached keys [H, n, d] after feeding `ids` at positions start, start+1, ..."""
    session = engine.new_session(EXACT)
    session.cache.next_position = start
    session.feed(ids, chunk=CHUNK)
    return [torch.cat([layer.sink_keys, layer.window.keys], 1) for layer in session.cache.compressed_layers]


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_a_compaction_turns_keys_as_the_model_rotates_them(engines, family):
    engine = engines[family, "float32"]
    ids = random_ids(SLIDING - 8, seed=4)  # every layer still holds all of them
    shift = 1000
    at_start, shifted = held_keys(engine, ids, 0), held_keys(engine, ids, shift)
    for layer, (before, after, geometry) in enumerate(zip(at_start, shifted, engine.loaded.geometry)):
        scale = float(after.abs().max())
        if geometry.inv_freq is not None:
            assert float((before - after).abs().max()) > 0.1 * scale, f"layer {layer}: the shift must turn keys"
        by = torch.full(before.shape[:2], float(shift))
        error = float((rerotate(before, by, geometry.inv_freq) - after).abs().max()) / scale
        assert error < 1e-3, f"layer {layer}: relative error {error:.1e}"


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_recalled_keys_turn_with_their_layers_rope_at_a_compaction(engines, family):
    engine = engines[family, "float32"]
    if all(geometry.sliding_window is not None for geometry in engine.loaded.geometry):
        pytest.skip("every layer slides: none keeps a recall tier")
    settings = CacheSettings(method="window", budget="100000", window=32, sinks=4, recall=8)
    _, session = greedy(engine, settings, random_ids(PROMPT, seed=5), 1)
    cache = session.cache
    tiers = [(layer, layer.recall) for layer in cache.compressed_layers if layer.recall is not None]
    assert tiers, "some layer keeps a recall tier"
    before = []
    for _, tier in tiers:
        every = torch.arange(tier.rows).expand(tier.heads, -1)
        before.append((every, tier.read(every)[0], tier.positions().float()))
    cache.compact_positions()
    for (layer, tier), (every, keys, old) in zip(tiers, before):
        # (the stored keys, before RoPE, turned to the new positions: to float32 rounding)
        moved = rerotate(keys, tier.cold_pos - old, layer.geometry.inv_freq)
        scale = float(keys.abs().max())
        torch.testing.assert_close(tier.read(every)[0], moved, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_sliding_window_layers_hold_only_their_window(engines, family):
    engine = engines[family, "float32"]
    _, session = greedy(engine, EXACT, random_ids(PROMPT, seed=6), 2)
    for layer, geometry in zip(session.cache.compressed_layers, engine.loaded.geometry):
        if geometry.sliding_window is None:
            assert layer.entry_count() == PROMPT + 2
        else:
            assert layer.entry_count() == geometry.sliding_window - 1 and layer.recall is None


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_a_resumed_session_answers_as_the_held_one(engines, family, tmp_path):
    engine = engines[family, "float32"]
    store = Store(tmp_path / "kvchat.db")
    settings = CacheSettings(method="h2o", budget="48", window=32, sinks=4, batch=16, recall=16)
    turn = SamplingSettings(max_new_tokens=8)
    held = engine.new_session(settings)
    sid = persist.new_session_row(store, held, family)
    for question in ("Tell me about cats.", "What do they eat?"):
        persist.save_turn(store, sid, held, question, held.send(question, turn))
    resumed, info = persist.resume(store, engine, sid)
    assert not info.rebuilt
    after = "And how long do they sleep?"
    assert resumed.send(after, turn).token_ids == held.send(after, turn).token_ids


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_the_calibration_captures_every_layer(engines, family):
    engine = engines[family, "float32"]
    captured = capture_qkv(engine.model, torch.tensor([random_ids(64, seed=7)]))
    loaded = engine.loaded
    assert sorted(captured) == list(range(loaded.num_layers))
    q, k, v = captured[0]
    assert q.shape == (loaded.num_heads, 64, loaded.head_dim)
    assert k.shape == v.shape == (loaded.num_kv_heads, 64, loaded.head_dim)
    assert math.isfinite(float(q.abs().sum()))


def test_soft_capped_layers_give_the_same_logits_through_the_bf16_kernels(engines):
    """Where bf16 runs natively a capped layer takes the blocked prefill kernel and its
    one-query case; elsewhere the explicit one. Both are run here on the same bf16 model
    (the kernels run, slowly, on any CPU): the logits agree to bf16's rounding."""
    engine = engines["gemma2", "int8"]
    prompt = random_ids(PROMPT, seed=8)
    logits = []
    for blocked in (False, True):
        session = engine.new_session(CacheSettings(method="h2o", **SMALL))
        for layer in session.cache.compressed_layers:
            layer.blocked_prefill = blocked
        out, _ = session.feed(prompt, chunk=CHUNK)
        logits.append(engine.forward([int(out.argmax())], session.cache))
    explicit, kernels = logits
    assert not torch.equal(kernels, explicit)  # two different kernels ran
    assert int(kernels.argmax()) == int(explicit.argmax())
    assert float((kernels - explicit).norm() / explicit.norm()) < 2e-2
