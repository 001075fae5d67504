"""Llama (Llama 2, 3.x, SmolLM2, TinyLlama): the layout `FamilyAdapter` assumes, with
RoPE scaling (llama3, linear, yarn) already in the rotary module's frequencies."""

from kvchat.model.families.base import FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    model_types = ("llama",)
    label = "Llama"
