"""Which layers recall: only the layers that fetch a detail from far back.

- the choice is the fewest layers holding `RETRIEVAL_COVER` of the copying attention,
  in layer order; a model with no such attention recalls everywhere;
- a layer outside the choice keeps no cold tokens and no key index, and attends as
  without recall; no layer recalling is recall off;
- the embedded model's choice is measured once, cached beside it, and given to every
  session with recall on.
"""

from __future__ import annotations

import json

import pytest
from tiny_llama import build_tiny_llama, engine_for, random_ids

from kvchat.calibration import calibrate
from kvchat.calibration.calibrate import choose_recall_layers, recall_layers, retrieval_path
from kvchat.settings import CacheSettings, SamplingSettings


def test_the_fewest_layers_that_hold_the_cover_are_chosen_in_layer_order():
    masses = [0.0, 0.5, 0.1, 0.3, 0.1]
    assert choose_recall_layers(masses, cover=0.8) == [1, 3]
    assert choose_recall_layers(masses, cover=0.85) == [1, 2, 3]
    assert choose_recall_layers(masses, cover=1.0) == [1, 2, 3, 4]


def test_every_layer_recalls_when_no_layer_copies():
    assert choose_recall_layers([0.0, 0.0, 0.0]) == [0, 1, 2]


@pytest.fixture(scope="module")
def tiny():
    return engine_for(build_tiny_llama())


def decode(engine, settings: CacheSettings, prompt: list[int], steps: int = 6):
    session = engine.new_session(settings)
    logits, _ = session.feed(prompt)
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.flatten()[-logits.shape[-1] :].argmax()))
        logits, _ = session.feed([tokens[-1]])
    return session, tokens


def test_a_layer_outside_the_choice_keeps_no_cold_tokens_and_recalls_none(tiny):
    settings = CacheSettings(method="window", budget="8", window=16, sinks=2, recall=4)
    tiny._measured["recall_layers"] = [1]
    try:
        session, _ = decode(tiny, settings, random_ids(80))
    finally:
        tiny._measured["recall_layers"] = [0, 1]
    first, second = session.cache.compressed_layers
    assert not first.recalls and second.recalls
    assert first.recall.rows == 0 < second.recall.rows  # only a layer that recalls keeps them
    assert first.recall.cold_bytes() == 0 < second.recall.cold_bytes()
    assert first.recall.total == 0 and second.recall.total > 0
    # Only a layer that recalls holds a key index to rank by, and staging room.
    assert first.recall.nbytes() == 0 < second.recall.nbytes()
    assert first.recall.bytes_per_row() == 0 < second.recall.bytes_per_row()


def test_no_layer_recalling_decodes_as_recall_off(tiny):
    prompt = random_ids(80, seed=3)
    off = CacheSettings(method="h2o", budget="8", window=16, sinks=2)
    _, expected = decode(tiny, off, prompt)
    tiny._measured["recall_layers"] = []
    try:
        _, tokens = decode(tiny, CacheSettings(method="h2o", budget="8", window=16, sinks=2, recall=4), prompt)
    finally:
        tiny._measured["recall_layers"] = [0, 1]
    assert tokens == expected


def test_the_embedded_model_recalls_in_the_layers_that_copy(engine):
    chosen = engine.measured("recall_layers")
    saved = json.loads(calibrate.saved(retrieval_path(engine.loaded.fingerprint)).read_text())
    masses = saved["masses"]
    assert len(masses) == engine.loaded.num_layers
    assert 0 < len(chosen) < engine.loaded.num_layers
    assert min(masses[i] for i in chosen) >= max(m for i, m in enumerate(masses) if i not in chosen)
    session = engine.new_session(CacheSettings(recall=8))
    assert [i for i, layer in enumerate(session.cache.compressed_layers) if layer.recalls] == chosen
    answer = session.send("Say hi.", SamplingSettings(max_new_tokens=2))
    assert answer.text


def test_a_saved_measurement_is_read_not_measured_again(engine, monkeypatch, tmp_path):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    path = retrieval_path(engine.loaded.fingerprint)
    path.parent.mkdir(parents=True)
    masses = [0.0] * engine.loaded.num_layers
    masses[3], masses[11] = 0.6, 0.4
    path.write_text(json.dumps({"version": calibrate.RETRIEVAL_VERSION, "masses": masses}))
    assert recall_layers(engine.loaded) == [3, 11]


def test_a_damaged_or_stale_measurement_is_measured_again(tmp_path):
    path = tmp_path / "measured.json"
    runs = []

    def measure():
        runs.append(1)
        return [0.5, 0.25]

    def cached():
        return calibrate._per_layer_cache(path, 2, "masses", 2, float, measure, {"model": "m"})

    assert cached() == [0.5, 0.25] and len(runs) == 1  # nothing on disk: measured, written
    assert cached() == [0.5, 0.25] and len(runs) == 1  # read back
    path.write_text("{not json")
    assert cached() == [0.5, 0.25] and len(runs) == 2  # damaged
    path.write_text(json.dumps({"version": 1, "masses": [0.1, 0.2]}))
    assert cached() == [0.5, 0.25] and len(runs) == 3  # another version
    path.write_text(json.dumps({"version": 2, "masses": [0.1]}))
    assert cached() == [0.5, 0.25] and len(runs) == 4  # another model's layer count
    assert json.loads(path.read_text()) == {"model": "m", "version": 2, "masses": [0.5, 0.25]}
