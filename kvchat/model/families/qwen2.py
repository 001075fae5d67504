"""Qwen2 (Qwen2, Qwen2.5): Llama's layout; layers past `max_window_layers` slide when
the config turns `use_sliding_window` on (the attention module says which)."""

from kvchat.model.families.base import FamilyAdapter


class Qwen2Adapter(FamilyAdapter):
    model_types = ("qwen2",)
    label = "Qwen2"
