"""The model families kvchat runs, in one table, and the refusal of the others.

kvchat's cache, recall tier and compaction assume a Llama-like model: decoder layers at
`model.model.layers[i]` with a `self_attn` module, one standard RoPE for every layer
(`model.model.rotary_emb.inv_freq`), no soft-capping and no learned sinks. The families
below load that way through `AutoModelForCausalLM` and were checked end to end (`full`
against transformers' greedy `generate`, every method in float32 and the fast dtype).
Any other `model_type` is refused before a weight loads, in one line.
"""

from __future__ import annotations

from kvchat.errors import ModelError

# `model_type` (a Hugging Face config's) -> what a user would call it.
SUPPORTED = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi-3",
    "olmo2": "OLMo2",
    "granite": "Granite",
    "smollm3": "SmolLM3",
}

# Why a family kvchat knows of does not run yet (shown in the refusal).
WHY_NOT = {
    "gemma2": "it needs attention logit soft-capping",
    "gemma3": "it needs per-layer sliding windows and RoPE bases",
    "gemma3_text": "it needs per-layer sliding windows and RoPE bases",
    "gpt_neox": "it needs partial rotary and its own module layout",
    "gpt_oss": "it needs learned attention sinks",
}

# A GGUF file names its architecture the llama.cpp way; these differ from `model_type`.
GGUF_ARCHITECTURES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "command-r": "cohere",
    "minimax-m2": "minimax_m2",
}


def family_of_gguf(architecture: str) -> str:
    """The `model_type` a GGUF file's `general.architecture` loads as."""
    return GGUF_ARCHITECTURES.get(architecture, architecture)


def check_family(model_type: str, where: object) -> None:
    """Refuse (ModelError) a family kvchat cannot serve; `where` names the folder or file."""
    if model_type in SUPPORTED:
        return
    why = f" ({WHY_NOT[model_type]})" if model_type in WHY_NOT else ""
    raise ModelError(
        f"{where}: model family {model_type!r} is not supported yet{why}; supported: {', '.join(SUPPORTED)}"
    )
