"""Tiny random-weight models of every family kvchat runs, built from transformers' own
configs (4 layers, 4 query heads, 2 KV heads, head_dim 32; nothing downloaded), each with
what makes its family different switched on at a size the tests reach: llama3 RoPE
scaling, sliding windows of 48 positions, Gemma 2's soft-capping (at 5, where it bites),
Gemma 3's per-layer-type RoPE, partial rotary (Phi-3, GPT-NeoX), SmolLM3's layers
without RoPE, Granite's multipliers."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 49152  # the embedded model's tokenizer
SLIDING = 48  # positions a sliding-window layer sees
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# test id -> (model_type, what differs from COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": SLIDING, "max_window_layers": 2}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": SLIDING}),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": SLIDING,
            "layer_types": LOCAL_GLOBAL,
            "attn_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": SLIDING,
            "layer_types": LOCAL_GLOBAL,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        },
    ),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5}),
    "gpt_neox": ("gpt_neox", {"rotary_pct": 0.25, "num_key_value_heads": None}),  # no GQA in GPT-NeoX
    "olmo2": ("olmo2", {}),
    "granite": (
        "granite",
        {"attention_multiplier": 0.05, "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    ),
    "smollm3": ("smollm3", {}),  # every 4th layer without RoPE, as released
}


def build_family(family: str) -> Any:
    """The tiny random-weight model of `family` (a FAMILIES key), seeded."""
    model_type, extra = FAMILIES[family]
    settings = {key: value for key, value in {**COMMON, **extra}.items() if value is not None}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()
