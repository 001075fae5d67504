"""Shared fixtures: the real embedded model, loaded once per test session.

Every test that needs the real model is marked `slow` here, from the fixtures it uses
(directly or through other fixtures): `embedded` or `embedded_fast`, or `model_process` for a `kvchat`
subprocess that loads it. `pytest -m "not slow"` is the quick loop; `make test` runs all.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Like `make test`: data (converted models, calibration caches) under the repository,
# and no user config file changing the defaults the tests expect.
os.environ.setdefault("KVCHAT_HOME", str(REPO))
os.environ["KVCHAT_CONFIG"] = str(REPO / "tests" / "no-such-config.toml")

SLOW_FIXTURES = {"embedded", "embedded_fast", "model_process"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A fresh SQLite file for one test."""
    return tmp_path / "kvchat.db"


@pytest.fixture
def store(db_path: Path):
    """A real Store on `db_path` (tests/tui has its own, for the app)."""
    from kvchat.storage.db import Store

    s = Store(db_path)
    yield s
    s.close()


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (real weights, CPU, float32: the exact path,
    so tests can compare token for token with transformers)."""
    from kvchat.model.loading import load_model

    return load_model(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def embedded_fast():
    """The same model on the CPU fast path (int8 weights, bf16 compute)."""
    from kvchat.model.loading import load_model

    return load_model(device="cpu", dtype="int8")


@pytest.fixture(scope="session")
def real_qkv(embedded):
    """Real post-RoPE queries/keys/values of the embedded model on ~1,400 tokens of the
    Paul Graham essays: {layer: (q [9, n, 64], k [3, n, 64], v [3, n, 64])} for layers 1, 8 and 15."""
    from kvchat.calibration.realkv import capture_qkv, essays_text

    ids = embedded.tokenizer(essays_text()[:6000], return_tensors="pt").input_ids
    return capture_qkv(embedded.model, ids, [1, 8, 15])


@pytest.fixture(scope="session")
def engine(embedded):
    """An Engine over the embedded model (kvchat attention registered)."""
    from kvchat.model.engine import Engine

    return Engine(embedded)


@pytest.fixture(scope="session")
def engine_fast(embedded_fast):
    """An Engine over the default CPU path (int8 weights, bf16 cache), for tests where
    exactness against transformers is not the point: it reads a document about twice as
    fast as the float32 engine."""
    from kvchat.model.engine import Engine

    return Engine(embedded_fast)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A folder holding the embedded model's tokenizer files (its converted copy), for the
    small models the tests build."""
    from kvchat.model.loading import converted_copy, embedded_model_path

    copy = converted_copy(embedded_model_path())
    assert copy is not None
    return copy[0]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A 2-layer random-weight Llama saved as a HF folder with the embedded tokenizer."""
    import torch
    from tiny_llama import VOCAB
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(embedded, tiny_llama_dir) -> Path:
    """A different, small, random-weight model beside the embedded one (the tests that
    use it also load the embedded model, so they are marked slow by it): the tiny Llama
    folder, built here, nothing downloaded."""
    return tiny_llama_dir
