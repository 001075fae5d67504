"""The float32 copy of a GGUF model, written tensor by tensor (`kvchat.model.gguf_copy`),
holds what transformers' own GGUF conversion holds, bit for bit; a file the stream cannot
reproduce is converted the old way. Every GGUF here is written by gguf-py from a tiny
random-weight model, except the embedded one; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from tiny_gguf import HIDDEN, LAYERS, VOCAB, assert_same_tensors, tiny_model, write_tiny_gguf


def converted_by_transformers(gguf: Path, out: Path) -> Path:
    """The weights as kvchat converted a GGUF before the stream: transformers loads the
    whole file, safetensors' `save_model` writes it."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    save_model(model, str(out))
    return out


FAMILIES = {
    # Llama's q/k rows are permuted by llama.cpp and put back by transformers; its own
    # output layer (untied) comes from output.weight.
    "llama": ("llama", {"tie_word_embeddings": False}),
    # biases on q, k and v; a tied output layer
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    # llama.cpp stores Gemma's norms as 1 + w, transformers takes the 1 off
    "gemma2": ("gemma2", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_streamed_weights_are_transformers_conversion_bit_for_bit(family, tmp_path):
    from kvchat.model.gguf_copy import plan, write_weights

    model_type, extra = FAMILIES[family]
    gguf = write_tiny_gguf(tmp_path / f"{family}.gguf", family, tiny_model(model_type, **extra))
    write_weights(plan(gguf), tmp_path / "streamed.safetensors")
    assert_same_tensors(
        tmp_path / "streamed.safetensors", converted_by_transformers(gguf, tmp_path / "old.safetensors")
    )


def test_a_tied_output_layer_is_stored_once_under_the_name_safetensors_keeps(tmp_path):
    from safetensors import safe_open

    from kvchat.model.gguf_copy import plan, write_weights

    gguf = write_tiny_gguf(tmp_path / "tied.gguf", "llama", tiny_model("llama", tie_word_embeddings=True))
    write_weights(plan(gguf), tmp_path / "streamed.safetensors")
    with safe_open(str(tmp_path / "streamed.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys() and "model.embed_tokens.weight" not in f.keys()  # noqa: SIM118
        assert f.metadata() == {"model.embed_tokens.weight": "lm_head.weight"}


def test_the_data_starts_aligned_and_holds_nothing_but_the_tensors(tmp_path):
    import json

    from kvchat.model.gguf_copy import ALIGN, plan, write_weights

    gguf = write_tiny_gguf(tmp_path / "llama.gguf", "llama", tiny_model("llama"))
    out = tmp_path / "streamed.safetensors"
    write_weights(plan(gguf), out)
    raw = out.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    assert (8 + length) % ALIGN == 0
    ends = sorted(entry["data_offsets"] for name, entry in header.items() if name != "__metadata__")
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[0][0] == 0
    assert 8 + length + ends[-1][1] == len(raw)


def test_an_architecture_whose_processing_is_not_one_tensor_to_one_is_not_streamed(tmp_path):
    """GPT-2's processor moves its output layer aside instead of mapping it: the stream
    refuses (before writing anything) rather than guess."""
    from kvchat.model.gguf_copy import NotStreamable, plan

    gguf = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(gguf), "gpt2")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotStreamable, match="GPT2TensorProcessor"):
        plan(gguf)


def test_a_file_that_leaves_a_weight_to_the_initialiser_is_not_streamed(tmp_path):
    """Without a tensor for some weight, transformers' conversion fills it in itself; the
    stream does not guess."""
    from kvchat.model.gguf_copy import NotStreamable, plan

    gguf = write_tiny_gguf(tmp_path / "llama.gguf", "llama", tiny_model("llama"), leave_out="blk.1.ffn_norm.weight")
    with pytest.raises(NotStreamable, match="no tensor for model.layers.1.post_attention_layernorm.weight"):
        plan(gguf)


def test_a_file_the_stream_refuses_is_copied_through_transformers(tmp_path, monkeypatch):
    from kvchat.model.loading import converted_copy

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    gguf = write_tiny_gguf(tmp_path / "llama.gguf", "llama", tiny_model("llama"), leave_out="blk.1.ffn_norm.weight")
    copy = converted_copy(gguf)
    assert copy is not None and copy[0].parent == tmp_path / "home" / "models"
    expected = converted_by_transformers(gguf, tmp_path / "old.safetensors")
    assert_same_tensors(copy[0] / "model.safetensors", expected)


@pytest.mark.slow  # converts the embedded model twice (20-40 s each)
def test_the_embedded_models_copy_is_transformers_conversion_file_for_file(tmp_path):
    from kvchat.model.gguf_copy import write_copy
    from kvchat.model.loading import convert_with_transformers, embedded_model_path

    gguf = embedded_model_path()
    (tmp_path / "streamed").mkdir()
    (tmp_path / "old").mkdir()
    write_copy(gguf, tmp_path / "streamed")
    convert_with_transformers(gguf, tmp_path / "old")
    names = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert sorted(p.name for p in (tmp_path / "streamed").iterdir()) == names
    for name in names:
        if name != "model.safetensors":
            assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
    assert_same_tensors(tmp_path / "streamed" / "model.safetensors", tmp_path / "old" / "model.safetensors")
