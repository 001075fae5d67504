"""Qwen3: Qwen2's layout with a norm on queries and keys before RoPE (inside the model:
the cached keys are rotated as usual)."""

from kvchat.model.families.base import FamilyAdapter


class Qwen3Adapter(FamilyAdapter):
    model_types = ("qwen3",)
    label = "Qwen3"
