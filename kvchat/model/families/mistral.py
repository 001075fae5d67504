"""Mistral: Llama's layout; where its config sets a sliding window (Mistral 7B v0.1,
4,096 positions), every layer attends through it (the attention module passes the
config's window, it keeps no attribute of its own)."""

from kvchat.model.families.base import FamilyAdapter


class MistralAdapter(FamilyAdapter):
    model_types = ("mistral",)
    label = "Mistral"

    def sliding_window(self, layer: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None
