"""The model families kvchat runs: one adapter per family, chosen by the config's
`model_type`, and the refusal of the others.

Each adapter (`kvchat.model.families.<family>`, built on `base.FamilyAdapter`) knows where its
model keeps the layers and attention modules and what each layer does: RoPE (base,
scaling, partial rotary or none), sliding window, soft-capping. The engine asks it once
per load (`geometry`) and hands the answer to the cache. Every family here passes the
family matrix (tests/model/test_families.py: `full` against transformers' greedy
`generate`, every method in float32 and bf16, re-rotation exact, save and resume). Any
other `model_type` is refused before a weight loads, in one line.
"""

from __future__ import annotations

from typing import Any

from kvchat.errors import ModelError
from kvchat.model.families.base import FamilyAdapter
from kvchat.model.families.gemma2 import Gemma2Adapter
from kvchat.model.families.gemma3 import Gemma3Adapter
from kvchat.model.families.gpt_neox import GPTNeoXAdapter
from kvchat.model.families.granite import GraniteAdapter
from kvchat.model.families.llama import LlamaAdapter
from kvchat.model.families.mistral import MistralAdapter
from kvchat.model.families.olmo2 import Olmo2Adapter
from kvchat.model.families.phi3 import Phi3Adapter
from kvchat.model.families.qwen2 import Qwen2Adapter
from kvchat.model.families.qwen3 import Qwen3Adapter
from kvchat.model.families.smollm3 import SmolLM3Adapter

ADAPTERS: dict[str, type[FamilyAdapter]] = {
    model_type: adapter
    for adapter in (
        LlamaAdapter,
        MistralAdapter,
        Qwen2Adapter,
        Qwen3Adapter,
        Phi3Adapter,
        Olmo2Adapter,
        GraniteAdapter,
        SmolLM3Adapter,
        Gemma2Adapter,
        Gemma3Adapter,
        GPTNeoXAdapter,
    )
    for model_type in adapter.model_types
}

# `model_type` (a Hugging Face config's) -> what a user would call it.
SUPPORTED = {model_type: adapter.label for model_type, adapter in ADAPTERS.items()}

# Why a family kvchat knows of does not run yet (shown in the refusal).
WHY_NOT = {
    "gemma3": "the multimodal Gemma 3 checkpoints (4B and up) are not supported yet; the text ones (270M, 1B) are",
    "gpt_oss": "it needs learned attention sinks",
}

# A GGUF file names its architecture the llama.cpp way; these differ from `model_type`.
GGUF_ARCHITECTURES = {
    "gemma3": "gemma3_text",  # transformers loads a Gemma 3 GGUF as the text model
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "gptneox": "gpt_neox",
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


def adapter_for(model: Any) -> FamilyAdapter:
    """The adapter of a loaded transformers model's family (ModelError for another)."""
    model_type = model.config.get_text_config().model_type
    check_family(model_type, type(model).__name__)
    return ADAPTERS[model_type](model)
