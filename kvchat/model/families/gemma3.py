"""Gemma 3 (the text models: 270M, 1B): five local layers (sliding, 512 positions) to one
global, each kind with its own RoPE (base 10,000 local, 1,000,000 global with linear
scaling): the rotary module keeps one frequency buffer per layer type."""

from kvchat.model.families.base import FamilyAdapter


class Gemma3Adapter(FamilyAdapter):
    model_types = ("gemma3_text",)
    label = "Gemma 3"
