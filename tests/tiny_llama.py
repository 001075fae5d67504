"""A random-weight, 2-layer Llama with the embedded model's attention shape (9 query
heads, 3 KV heads, head_dim 64, 8,192 positions): cache and prefill tests run through a
real transformers model in seconds. Built here, nothing downloaded."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvchat.model.engine import Engine
from kvchat.model.loading import LoadedModel

VOCAB = 49152


class NoTextTokenizer:
    """These tests feed token ids directly; the engine only asks the tokenizer for stop ids."""

    eos_token_id = 2
    unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return self.unk_token_id


def build_tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def engine_for(model, tokenizer=None) -> Engine:
    engine = Engine(
        LoadedModel(model, tokenizer or NoTextTokenizer(), "tiny", "tiny", torch.device("cpu"), torch.float32, None)
    )
    # Random weights have nothing to calibrate (chelsea's outlier heads): no per-layer
    # parameters, and no calibration run or file under models/ for this throwaway model.
    engine.calibrated_params = lambda method, layer: {}
    # Nor which layers copy from far back (`kvchat.calibration.calibrate.recall_layers`): all recall.
    engine._measured["recall_layers"] = list(range(model.config.num_hidden_layers))
    return engine


def random_ids(count: int, seed: int = 0) -> list[int]:
    return torch.randint(3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()
