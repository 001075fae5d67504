"""Granite: Llama's layout; its attention multiplier reaches kvchat as the attention call's scaling."""

from kvchat.model.families.base import FamilyAdapter


class GraniteAdapter(FamilyAdapter):
    model_types = ("granite",)
    label = "Granite"
