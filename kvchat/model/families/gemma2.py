"""Gemma 2: local (sliding, 4,096 positions) and global layers alternate, and attention
logits are soft-capped (50 in the released models); its embedding scale and final-logit
cap stay inside the model. Queries are pre-scaled by `query_pre_attn_scalar`, which
reaches kvchat as the attention call's scaling."""

from kvchat.model.families.base import FamilyAdapter


class Gemma2Adapter(FamilyAdapter):
    model_types = ("gemma2",)
    label = "Gemma 2"
