"""Attention error of a compressor on given queries/keys/values (BalanceKV's protocol).

Keep the first `sinks` and last `recent` tokens exact, hand the middle to a compressor
(one batch, as after a prefill, or in batches of `batch` tokens), then compare the
attention output of the last `recent` queries with exact attention:
mean over queries and heads of ||approx - exact||_2 / ||exact||_2.
Used by the tests and by `kvchat bench attention`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kvchat import compress
from kvchat.cache.attention import weighted_attention
from kvchat.compress.base import LayerSpec
from kvchat.kv_types import Entries


def _causal_mass(q: Tensor, k: Tensor, scale: float, upto: int) -> Tensor:
    """Column sums of causal attention probabilities on keys [0, upto), summed over
    all queries and each group's query heads: [H, G, upto] (what h2o's prefill sees)."""
    hq, n, _ = q.shape
    h = k.shape[0]
    g = hq // h
    kk = k.float().repeat_interleave(g, 0)
    total = torch.zeros(hq, upto)
    for start in range(0, n, 256):  # query blocks: never materialise n x n
        qs = q[:, start : start + 256].float()
        s = torch.matmul(qs, kk.transpose(1, 2)) * scale
        rows = torch.arange(start, start + qs.shape[1])[:, None]
        s = s.masked_fill(torch.arange(n)[None, :] > rows, float("-inf"))
        total += torch.softmax(s, -1)[..., :upto].sum(1)
    return total.view(h, g, upto)


def compress_middle(
    method: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    budget: int,
    sinks: int,
    recent: int,
    layer: int = 0,
    seed: int = 0,
    batch: int | None = None,
    params: dict[str, Any] | None = None,
) -> Entries:
    """Run `method` over the middle k/v[:, sinks:n-recent] and return its entries."""
    h, n, d = k.shape
    spec = LayerSpec(layer, h, q.shape[0] // h, d, k.device, k.dtype, seed)
    comp = compress.make(method, spec, budget, **(params or {}))
    mid = slice(sinks, n - recent)
    positions = torch.arange(n)[mid].expand(h, -1).contiguous()
    scores = _causal_mass(q, k, d**-0.5, n)[..., mid] if comp.needs_attention else None
    size = positions.shape[1]
    step = size if batch is None else batch
    for start in range(0, size, step):
        part = slice(start, start + step)
        comp.ingest(
            k[:, mid][:, part].contiguous(),
            v[:, mid][:, part].contiguous(),
            positions[:, part],
            scores=None if scores is None else scores[..., part].contiguous(),
        )
    return comp.entries()


def uniform_middle(k: Tensor, v: Tensor, *, budget: int, sinks: int, recent: int, seed: int) -> Entries:
    """Reference baseline: a uniform random subset of the middle, each kept token
    weighted by (middle size / kept) so the estimate stays count-unbiased."""
    h, n, _ = k.shape
    size = n - sinks - recent
    keep = min(budget, size)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(size, generator=gen)[:keep].sort().values for _ in range(h)]) + sinks
    w = torch.full((h, keep), math.log(size / keep))
    return Entries(
        keys=torch.gather(k, 1, idx[..., None].expand(-1, -1, k.shape[2])),
        values=torch.gather(v, 1, idx[..., None].expand(-1, -1, v.shape[2])),
        positions=idx,
        log_num=w,
        log_den=w.clone(),
    )


def attention_outputs(
    q: Tensor, k: Tensor, v: Tensor, middle: Entries, *, sinks: int, recent: int
) -> tuple[Tensor, Tensor]:
    """(compressed, exact) attention outputs of the last `recent` queries, causal among
    them: over sinks + `middle` + recent tokens, and over every token."""
    h, n, d = k.shape
    scale = d**-0.5
    zeros = lambda m: torch.zeros(h, m)  # noqa: E731
    keys = torch.cat([k[:, :sinks], middle.keys.to(k.dtype), k[:, n - recent :]], 1)
    values = torch.cat([v[:, :sinks], middle.values.to(v.dtype), v[:, n - recent :]], 1)
    a = torch.cat([zeros(sinks), middle.log_num, zeros(recent)], 1)
    b = torch.cat([zeros(sinks), middle.log_den, zeros(recent)], 1)
    queries = q[:, n - recent :]
    approx, _ = weighted_attention(queries, keys, values, a, b, scale, causal_tail=recent)
    exact, _ = weighted_attention(queries, k, v, zeros(n), zeros(n), scale, causal_tail=recent)
    return approx, exact


def attention_error(q: Tensor, k: Tensor, v: Tensor, middle: Entries, *, sinks: int, recent: int) -> float:
    """Relative error of the last `recent` queries' attention over sinks + middle + recent."""
    approx, exact = attention_outputs(q, k, v, middle, sinks=sinks, recent=recent)
    err = (approx.float() - exact.float()).norm(dim=-1) / exact.float().norm(dim=-1).clamp_min(1e-12)
    return float(err.mean())
