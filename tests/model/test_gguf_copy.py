"""The float32 copy of a GGUF model, written tensor by tensor (`kvchat.model.gguf_copy`),
holds what transformers' own GGUF conversion holds, bit for bit; a file the stream cannot
reproduce is converted the old way. Every GGUF here is written by gguf-py from a tiny
random-weight model, except the embedded one; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 64, 128, 2, 4, 2
# The 2-D weights cycle through these storage types; vectors (norms, biases) stay F32.
STORED = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F16]


def tiny_model(model_type: str, **extra):
    """A random-weight model of the family, small enough to write in milliseconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=256,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)  # norms too: an offset llama.cpp adds must show
    return model


def write_tiny_gguf(path: Path, architecture: str, model, leave_out: str = "") -> Path:
    """`model` as a GGUF file of `architecture`, under the tensor names transformers maps
    back, its 2-D weights in Q8_0, Q4_0, Q4_1 and F16 by turns, with a byte-level BPE
    vocabulary (printable ASCII and fillers); `leave_out` names a tensor not written."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={})
    gguf_name = {hf: name for name, hf in get_gguf_hf_weights_map(model, processor).items()}
    config = model.config
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HIDDEN // HEADS)
    writer.add_value_length(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(c) for c in range(33, 127)] + [f"t{i}" for i in range(VOCAB - 94)])
    writer.add_token_merges(["t 0"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    turn = 0
    for name, tensor in model.state_dict().items():
        if name not in gguf_name or gguf_name[name] == leave_out:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if data.ndim == 2:
            kind = STORED[turn % len(STORED)]
            turn += 1
            writer.add_tensor(gguf_name[name], quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name[name], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def converted_by_transformers(gguf: Path, out: Path) -> Path:
    """The weights as kvchat converted a GGUF before the stream: transformers loads the
    whole file, safetensors' `save_model` writes it."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    save_model(model, str(out))
    return out


def assert_same_tensors(got: Path, expected: Path) -> None:
    """The same names, metadata, dtypes, shapes and bits."""
    from safetensors import safe_open

    with safe_open(str(got), framework="pt") as a, safe_open(str(expected), framework="pt") as b:
        assert a.metadata() == b.metadata()
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():  # noqa: SIM118  (a safe_open handle is not a dict)
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


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
