"""The next token from the last position's logits: greedy at temperature 0, else drawn
from the softmax at that temperature, cut to the smallest set of tokens holding `top_p`
of the probability (nucleus sampling), with the session's own generator, so that a
seeded session draws the same tokens again."""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.settings import SamplingSettings


def sample(logits: Tensor, settings: SamplingSettings, generator: torch.Generator) -> int:
    if settings.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / settings.temperature, dim=-1).cpu()
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cut = sorted_probs.cumsum(0) - sorted_probs > settings.top_p
        sorted_probs[cut] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
