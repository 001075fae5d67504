"""GPT-NeoX (Pythia): the layers are at `model.gpt_neox.layers[i].attention`, and RoPE
turns only the first `rotary_pct` of each head's channels (a quarter in Pythia)."""

from typing import Any

from kvchat.model.families.base import FamilyAdapter


class GPTNeoXAdapter(FamilyAdapter):
    model_types = ("gpt_neox",)
    label = "GPT-NeoX"

    def decoder(self) -> Any:
        return self.model.gpt_neox

    def attention(self, layer: int) -> Any:
        return self.layers()[layer].attention
