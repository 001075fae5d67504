"""The model adapter's interface, and what most families share.

A family's adapter is the one place that knows how its transformers model is laid out:
where the decoder layers and their attention modules are, each layer's RoPE (base,
scaling, partial rotary or none), its sliding window and its logit soft-capping. It reads
them from the loaded model itself (the rotary module's frequencies, the attention
modules' attributes), so what kvchat re-rotates is exactly what the model rotated. The
engine hands the result to the cache as one `LayerGeometry` per layer; nothing below the
engine touches the model.

Query pre-scaling (Gemma's `query_pre_attn_scalar`, Granite's attention multiplier) needs
nothing here: transformers passes each attention call its `scaling`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # (at run time torch loads with the model: `kvchat models` never needs it)
    from torch import Tensor, nn

    from kvchat.kv_types import LayerGeometry

# RoPE types whose frequencies change with the sequence length: transformers recomputes
# them past the original context, which would leave the keys already cached turned by
# the old ones. kvchat keeps positions below the original context instead.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class FamilyAdapter:
    """A decoder-only transformers model laid out as Llama is: `model.model.layers[i].self_attn`,
    one rotary module at `model.model.rotary_emb`. Subclasses name their `model_types`
    and override what their family does differently."""

    model_types: ClassVar[tuple[str, ...]] = ()
    label: ClassVar[str] = ""  # what a user calls the family

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config.get_text_config()

    # -- where things are -----------------------------------------------------------
    def decoder(self) -> Any:
        """The module holding the layers and the rotary embedding (a transformers model)."""
        return self.model.model

    def layers(self) -> nn.ModuleList:
        return self.decoder().layers

    def attention(self, layer: int) -> Any:
        """The layer's attention module (it has the attributes transformers gave it)."""
        return self.layers()[layer].self_attn

    def layer_type(self, layer: int) -> str | None:
        types = getattr(self.config, "layer_types", None)
        return types[layer] if types else None

    # -- what each layer does -------------------------------------------------------
    def inv_freq(self, layer: int) -> Tensor | None:
        """The layer's RoPE frequencies (None: the layer has no RoPE). A model whose layer
        types have their own RoPE (Gemma 3) keeps one buffer per type."""
        rotary = self.decoder().rotary_emb
        kind = self.layer_type(layer)
        freq = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
        if freq is None:
            freq = rotary.inv_freq
        return freq.detach().float().cpu()

    def sliding_window(self, layer: int) -> int | None:
        """The layer's attention window in positions, as its attention module passes it to
        the attention function (None: it sees every earlier token)."""
        window = getattr(self.attention(layer), "sliding_window", None)
        return int(window) if window else None

    def softcap(self, layer: int) -> float | None:
        cap = getattr(self.attention(layer), "attn_logit_softcapping", None)
        return float(cap) if cap else None

    def max_positions(self) -> int:
        """The positions kvchat may use before it compacts: the model's context, or the
        original one where RoPE frequencies would change past it (`LENGTH_DEPENDENT_ROPE`)."""
        longest = int(getattr(self.config, "max_position_embeddings", 2048))
        rope = getattr(self.config, "rope_parameters", None) or {}
        kinds = [
            p.get("rope_type") for p in (rope.values() if "rope_type" not in rope else [rope]) if isinstance(p, dict)
        ]
        original = getattr(self.config, "original_max_position_embeddings", None) or rope.get(
            "original_max_position_embeddings"
        )
        if original and any(kind in LENGTH_DEPENDENT_ROPE for kind in kinds):
            return min(longest, int(original))
        return longest

    def geometry(self) -> list[LayerGeometry]:
        """One `LayerGeometry` per decoder layer, in order."""
        from kvchat.kv_types import LayerGeometry

        return [
            LayerGeometry(inv_freq=self.inv_freq(i), sliding_window=self.sliding_window(i), softcap=self.softcap(i))
            for i in range(len(self.layers()))
        ]
