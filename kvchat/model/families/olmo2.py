"""OLMo 2: Llama's layout; its norms on queries and keys run before RoPE, inside the model."""

from kvchat.model.families.base import FamilyAdapter


class Olmo2Adapter(FamilyAdapter):
    model_types = ("olmo2",)
    label = "OLMo2"
