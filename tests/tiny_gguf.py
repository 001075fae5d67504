"""Tiny GGUF model files written by gguf-py from random-weight transformers models, under
the tensor names transformers maps back (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

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


def assert_same_tensors(got: Path, expected: Path) -> None:
    """Two safetensors files hold the same names, metadata, dtypes, shapes and bits."""
    from safetensors import safe_open

    with safe_open(str(got), framework="pt") as a, safe_open(str(expected), framework="pt") as b:
        assert a.metadata() == b.metadata()
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():  # noqa: SIM118  (a safe_open handle is not a dict)
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
