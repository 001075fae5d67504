"""Phi-3: Llama's layout with partial rotary where `partial_rotary_factor` < 1 (the
rotary module's frequencies then cover only the first channels) and, in the 4k models, a
sliding window over every layer, passed from the config as Mistral does. Its longrope
(128k models) changes frequencies past the original context: kvchat stays below it
(`FamilyAdapter.max_positions`)."""

from kvchat.model.families.base import FamilyAdapter


class Phi3Adapter(FamilyAdapter):
    model_types = ("phi3",)
    label = "Phi-3"

    def sliding_window(self, layer: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None
