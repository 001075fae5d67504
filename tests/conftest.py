"""Shared fixtures: the real embedded model, loaded once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (real weights, CPU, float32)."""
    from kvchat.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def real_qkv(embedded):
    """Real post-RoPE queries/keys/values of the embedded model on ~1,400 tokens of the
    Paul Graham essays: {layer: (q [9, n, 64], k [3, n, 64], v [3, n, 64])} for layers 1, 8 and 15."""
    from kvchat.realkv import capture_qkv, essays_text

    ids = embedded.tokenizer(essays_text()[:6000], return_tensors="pt").input_ids
    return capture_qkv(embedded.model, ids, [1, 8, 15])
