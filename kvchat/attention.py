"""The one attention formula over weighted entries, and its registration in transformers.

    s_j = scale * <q, k_j>
    out = sum_j exp(s_j + a_j) v_j / sum_j exp(s_j + b_j)

`a` (numerator) and `b` (denominator) are per-entry log-weights; exact tokens have
a = b = 0. When a == b everywhere this is ordinary attention with an additive bias and
runs through PyTorch's fused SDPA; split weights (subgen, balancekv) use the explicit
two-sum form in fp32. The cache hands this module its entries; this module never
decides what is kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ATTN_NAME = "kvchat"


def expand_heads(x: Tensor, group: int) -> Tensor:
    """[H, ...] per KV head -> [H*G, ...] per query head (heads of a group are adjacent)."""
    return x if group == 1 else x.repeat_interleave(group, dim=0)


def weighted_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    log_num: Tensor,
    log_den: Tensor,
    scale: float,
    causal_tail: int = 0,
    return_mass: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Reference (explicit) weighted attention for one sequence.

    query: [Hq, L, d]; keys/values: [H, n, d]; log_num/log_den: [H, n] (float32).
    The last `causal_tail` entries are the query tokens themselves: query i sees tail
    entries up to and including its own position (the rest of the cache is fully
    visible). Returns out [Hq, L, d] in the query dtype and, when `return_mass`, the
    attention probabilities summed over the L queries and over each KV head's group,
    [H, G, n] (float32), where the probability is exp(s+b)/sum exp(s+b).
    """
    hq, length, _ = query.shape
    h = keys.shape[0]
    group = hq // h
    k = expand_heads(keys, group).float()
    v = expand_heads(values, group).float()
    a = expand_heads(log_num, group)[:, None, :]
    b = expand_heads(log_den, group)[:, None, :]
    s = torch.matmul(query.float(), k.transpose(1, 2)) * scale  # [Hq, L, n]
    if causal_tail:
        n = keys.shape[1]
        blocked = torch.ones(length, causal_tail, dtype=torch.bool, device=query.device).triu(
            1 + causal_tail - length
        )
        mask = torch.zeros(length, n, dtype=torch.bool, device=query.device)
        mask[:, n - causal_tail :] = blocked
        s = s.masked_fill(mask, float("-inf"))
    sa = s + a
    sb = s + b
    m = torch.maximum(sa.amax(-1, keepdim=True), sb.amax(-1, keepdim=True))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    pa = torch.exp(sa - m)
    pb = torch.exp(sb - m)
    den = pb.sum(-1, keepdim=True)
    out = torch.matmul(pa, v) / den
    mass = None
    if return_mass:
        probs = pb / den  # [Hq, L, n]
        mass = probs.sum(1).view(h, group, -1)
    return out.to(query.dtype), mass
