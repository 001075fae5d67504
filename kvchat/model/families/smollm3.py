"""SmolLM3: Llama's layout, but layers whose `no_rope_layers` entry is 0 (every 4th in
the released model) apply no RoPE: their keys carry no position, and a compaction
leaves them as they are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.model.families.base import FamilyAdapter

if TYPE_CHECKING:
    from torch import Tensor


class SmolLM3Adapter(FamilyAdapter):
    model_types = ("smollm3",)
    label = "SmolLM3"

    def inv_freq(self, layer: int) -> Tensor | None:
        if not getattr(self.attention(layer), "use_rope", True):
            return None
        return super().inv_freq(layer)
