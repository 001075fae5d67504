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

import threading
from typing import cast

import torch
from torch import Tensor

from kvchat.runtime import cpu_has_fast_bf16

ATTN_NAME = "kvchat"
# Largest log-ratio of numerator to denominator mass a split-weight estimate may reach
# (exact attention: 0). e^30 ~ 1e13 keeps the next layer's norm finite in fp32.
SPLIT_RATIO_CAP = 30.0


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
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Reference (explicit) weighted attention for one sequence (with `softcap` c, each
    logit s is first capped to c * tanh(s / c)).

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
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal_tail:
        n = keys.shape[1]
        blocked = torch.ones(length, causal_tail, dtype=torch.bool, device=query.device).triu(1 + causal_tail - length)
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


Segment = tuple[Tensor, Tensor, Tensor | None, Tensor | None]  # keys, values, a, b


def segment_attention(
    query: Tensor,
    segments: list[Segment],
    scale: float,
    causal_last: bool,
    split: bool,
    want_mass: bool,
    softcap: float | None = None,
) -> tuple[Tensor, list[Tensor] | None]:
    """Weighted attention over cache segments without concatenating keys/values.

    query: [Hq, L, d]. Each segment: keys/values [H, n, d] and log-weights a/b [H, n]
    (None = exact tokens, a = b = 0). With `causal_last`, the last segment holds the L
    query tokens themselves (causal among them). `split` selects the two-sum form
    (a != b somewhere); otherwise one softmax with bias a. Query heads of a GQA group
    are folded into rows ([H, G*L, d]) so no key/value is repeated per query head.
    With `softcap` c, each logit s becomes c * tanh(s / c) before the weights are added
    (Gemma 2's attention soft-capping).
    Returns out [Hq, L, d] and, if `want_mass`, per segment the probability mass summed
    over the L queries, [H, G, n] float32.
    """
    hq, length, d = query.shape
    h = segments[0][0].shape[0]
    group = hq // h
    q = query.reshape(h, group * length, d).float() * scale
    # Per segment: logits with the numerator weights (s + a) and, only where a segment has
    # split weights, with the denominator weights (s + b). Exact segments (sinks, window)
    # share one exponential for both sums, and no score matrix is concatenated.
    num_logits: list[Tensor] = []
    den_logits: list[Tensor | None] = []
    for i, (k, _v, a, b) in enumerate(segments):
        s = torch.matmul(q, k.float().transpose(1, 2))  # [H, G*L, n]
        if softcap is not None:
            s = s.div_(softcap).tanh_().mul_(softcap)
        if causal_last and i == len(segments) - 1 and length > 1:
            # The segment's last `length` entries are the queries themselves.
            n = k.shape[1]
            blocked = torch.zeros(length, n, dtype=torch.bool, device=q.device)
            blocked[:, n - length :] = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
            s.masked_fill_(blocked.repeat(group, 1), float("-inf"))
        den = s + b.float()[:, None, :] if split and b is not None else None
        num_logits.append(s if a is None else s.add_(a.float()[:, None, :]))
        den_logits.append(den)
    # Each sum gets its own shift: when a split estimate fails (a numerator sample far
    # heavier than any denominator sample), one shared shift would underflow the
    # denominator to zero. Exact segments have one set of logits for both sums.
    peak_num = _row_max(num_logits)
    peak_den = _row_max([num if den is None else den for num, den in zip(num_logits, den_logits)])
    shift = (peak_den - peak_num).exp() if split else None  # exact terms: den scale -> num scale
    out = num_total = den_total = None
    den_probs = []
    for (_k, v, _a, _b), num, den in zip(segments, num_logits, den_logits):
        if den is None:
            p_den = num.sub_(peak_den).exp_()
            p_num = p_den * cast(Tensor, shift) if split else p_den  # shift is set when split
        else:
            p_den = den.sub_(peak_den).exp_()
            p_num = num.sub_(peak_num).exp_()
        part = torch.matmul(p_num, v.float())
        out = part if out is None else out.add_(part)
        num_total = _accumulate(num_total, p_num.sum(-1, keepdim=True))
        den_total = _accumulate(den_total, p_den.sum(-1, keepdim=True))
        den_probs.append(p_den)
    # `segments` is not empty (its first is read above), so the loop set all three
    assert out is not None and num_total is not None and den_total is not None
    if split:
        # out = (sum e^(s+a) v / sum e^(s+a)) * (sum e^(s+a) / sum e^(s+b)). The second
        # factor is 1 for exact attention; it is capped at e^SPLIT_RATIO_CAP, where an
        # estimate has long failed and fp32 would overflow in the next layer's norm.
        log_ratio = num_total.log() - den_total.log() + peak_num - peak_den
        out = out.mul_(log_ratio.clamp_(max=SPLIT_RATIO_CAP).exp_().div_(num_total))
    else:
        out = out.div_(den_total)
    out = out.view(hq, length, d).to(query.dtype)
    if not want_mass:
        return out, None
    return out, [(p / den_total).view(h, group, length, -1).sum(2) for p in den_probs]


# Bytes of one block of scores in `banded_attention` (float32): bounds a long chunk's memory.
BAND_TILE_BYTES = 32 << 20


def banded_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    key_positions: Tensor,
    scale: float,
    window: int,
    softcap: float | None = None,
) -> Tensor:
    """Sliding-window attention: each query sees the keys of its last `window` positions
    (itself included), as the model was trained (transformers' sliding-window mask keeps
    key k for query q when q - window < k <= q).

    query: [Hq, L, d], the last L tokens of `keys`/`values` [H, n, d] (exact entries of
    one layer, in position order), whose positions are `key_positions` [n]. With
    `softcap`, logits are capped as in `segment_attention`. Query rows are taken in blocks
    whose float32 scores fit BAND_TILE_BYTES; without a cap each block runs in PyTorch's
    SDPA with a boolean mask. Returns [Hq, L, d] in the query dtype."""
    hq, length, d = query.shape
    h, n, _ = keys.shape
    group = hq // h
    positions = key_positions.to(query.device)
    rows = max(1, min(length, BAND_TILE_BYTES // max(1, 4 * hq * n)))
    out = torch.empty_like(query)
    for first in range(0, length, rows):
        last = min(length, first + rows)
        q_pos = positions[n - length + first : n - length + last, None]
        visible = (positions[None, :] <= q_pos) & (positions[None, :] > q_pos - window)  # [r, n]
        if softcap is None:
            out[:, first:last] = torch.nn.functional.scaled_dot_product_attention(
                query[None, :, first:last],
                keys[None],
                values[None],
                attn_mask=visible,
                scale=scale,
                enable_gqa=group > 1,
            )[0]
            continue
        q = query[:, first:last].reshape(h, group * (last - first), d).float() * scale
        s = torch.matmul(q, keys.float().transpose(1, 2)).div_(softcap).tanh_().mul_(softcap)
        s.masked_fill_(~visible.repeat(group, 1), float("-inf"))
        probs = torch.softmax(s, dim=-1)
        out[:, first:last] = torch.matmul(probs, values.float()).view(hq, last - first, d).to(query.dtype)
    return out


def _flash_cpu_op():
    """PyTorch's fused CPU attention kernel that also returns each row's log-sum-exp
    (None where this build lacks it)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_segments_available(device: torch.device) -> bool:
    return device.type == "cpu" and _flash_cpu_op() is not None


def fused_segment_attention(query: Tensor, segments: list[Segment], scale: float) -> Tensor:
    """Decode attention (one new token, whose key is already the last window entry) over
    segments with one weight per entry (a == b), in PyTorch's fused CPU kernel: each
    segment is attended on its own (fp32 accumulation, no score matrix materialised in
    Python, no fp32 copy of bf16 keys), and the per-segment results are merged exactly
    through their log-sum-exps: out = sum_i exp(lse_i - lse) out_i. A GQA group's query
    heads are folded into rows, so no key/value is repeated.

    query: [Hq, 1, d]; segments: keys/values [H, n, d], a [H, n] or None (b ignored).
    Returns [Hq, 1, d] in the query dtype."""
    op = _flash_cpu_op()
    hq, length, d = query.shape
    h = segments[0][0].shape[0]
    group = hq // h
    q = query.reshape(1, h, group * length, d)
    outs, lses = [], []
    for k, v, a, _b in segments:
        if k.shape[1] == 0:
            continue
        mask = None if a is None else a.to(query.dtype)[None, :, None, :].expand(1, h, group * length, -1)
        out, lse = op(q, k[None], v[None], 0.0, False, attn_mask=mask, scale=scale)
        if a is not None:
            # The kernel reports lse = 0 (not -inf) for a head whose entries are all
            # masked (padding): mark those heads empty so their weight is 0.
            empty = ~torch.isfinite(a).any(-1)
            if bool(empty.any()):
                lse = lse.masked_fill(empty[None, :, None], float("-inf"))
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0].reshape(hq, length, d)
    weights = torch.softmax(torch.stack(lses), dim=0)  # [segments, 1, H, rows]
    # A head's empty segment has weight 0; zero any NaN its output may hold so 0 * NaN
    # cannot leak.
    merged = sum(w[..., None] * o.float().nan_to_num_(0.0) for w, o in zip(weights, outs))
    return merged.reshape(hq, length, d).to(query.dtype)


def sampled_mass(query: Tensor, segments: list[Segment], scale: float, stride: int) -> list[Tensor]:
    """Attention mass of a prefill chunk from every `stride`-th query row, scaled to stand
    for all rows: what score-based methods (h2o, bumblebee) accumulate, at 1/stride of
    the explicit kernel's cost (the chunk's outputs come from the fused kernel).

    query: [Hq, L, d] (the chunk; its tokens are the last L entries of the last segment,
    causal among them); segments as in `segment_attention`, one weight per entry (a == b).
    Rows L-1, L-1-stride, ... are taken, so the chunk's last query always counts. Returns
    per segment [H, G, n] float32: the sampled rows' probabilities summed, times
    L / (rows taken).
    """
    hq, length, d = query.shape
    h = segments[0][0].shape[0]
    group = hq // h
    rows = torch.arange(length - 1, -1, -stride, device=query.device).flip(0)
    taken = rows.numel()
    q = query[:, rows].reshape(h, group * taken, d).float() * scale
    logits = []
    for i, (k, _v, a, _b) in enumerate(segments):
        s = torch.matmul(q, k.float().transpose(1, 2))  # [H, G*R, n]
        if a is not None:
            s.add_(a.float()[:, None, :])
        if i == len(segments) - 1:
            # Row r (chunk index rows[r]) sees the last segment up to its own entry.
            n = k.shape[1]
            own = n - length + rows  # index of each taken row's own entry
            blocked = torch.arange(n, device=q.device)[None, :] > own[:, None]  # [R, n]
            s.masked_fill_(blocked.repeat(group, 1), float("-inf"))
        logits.append(s)
    peak = _row_max(logits)
    probs = [x.sub_(peak).exp_() for x in logits]
    total = sum(p.sum(-1, keepdim=True) for p in probs)
    factor = length / taken
    return [(p / total).view(h, group, taken, -1).sum(2).mul_(factor) for p in probs]


# Bytes of one score tile of the blocked prefill kernel ([H, G*rows, n] bf16; the
# probabilities take as much again). On a 2-core EPYC (1 MiB L2 per core, 32 MiB L3)
# tiles of 16 MiB run a 6k chunk fastest: smaller ones pay per-call overhead and re-read
# the keys, larger ones fall out of L3.
PREFILL_TILE_BYTES = 16 << 20


def blocked_prefill_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefill chunks of this device and compute dtype run in
    `blocked_prefill_attention`: bf16 on a CPU with native bf16 dot products (AVX512-BF16
    or AMX; elsewhere bf16 is emulated). float32 keeps PyTorch's fused SDPA (the exact
    path) and CUDA its fused kernels."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_fast_bf16()


def blocked_prefill_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor | None,
    scale: float,
    mass_stride: int = 0,
    tile_bytes: int = PREFILL_TILE_BYTES,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A prefill chunk's attention as bf16 matrix products, and the attention mass each
    entry receives from the same probabilities.

    query: [Hq, L, d] bf16, the chunk; keys/values: [H, n, d] bf16, the whole cache with
    the chunk's own L tokens last (causal among them, everything before fully visible);
    bias: [H, n] float log-weights (a == b; -inf hides an entry) or None. With
    `mass_stride` s >= 1, also returns the probabilities of every s-th query row (the
    chunk's last always taken) summed per query head and scaled by L / rows taken,
    [H, G, n] float32 (s = 1: the exact mass of the chunk); 0: no mass.

    Why not PyTorch's fused CPU kernel: on a CPU with AVX512-BF16 it is no faster in bf16
    than in fp32 (about 60 GFLOP/s per core), while bf16 GEMMs run at about 160
    (docs/decisions/0005-bf16-attention-paths.md).
    Query rows are taken in blocks whose scores fit `tile_bytes`, each against all
    keys at once, so every row's softmax is exact in one pass (no running max needed).
    Per block: S = (scale*Q)·Kᵀ as one bf16 GEMM with fp32 accumulation (the output is
    rounded to bf16, as in transformers' bf16 eager attention), the bias and the causal
    mask (a `softcap` caps the scores first, as in `segment_attention`), softmax (computed
    in fp32 by PyTorch, P stored in bf16), then P·V. A GQA group's
    query heads are folded into rows, so no key or value is repeated per query head.
    """
    hq, length, d = query.shape
    h, n, _ = keys.shape
    group = hq // h
    # Scale folded into the queries (one rounding of q; exact when scale is a power of two,
    # as for head_dim 64).
    q = query.float().mul_(scale).to(query.dtype).view(h, group, length, d)
    keys_t = keys.transpose(1, 2)
    row_bias = None if bias is None else bias.to(query.dtype)[:, None, :]
    # Entry j of the chunk is hidden from chunk row i when j > i.
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu_(1)
    rows = max(1, min(length, tile_bytes // max(1, h * group * n * keys.element_size())))
    out = torch.empty(h, group, length, d, dtype=query.dtype, device=query.device)
    mass = torch.zeros(h, group, n, device=query.device) if mass_stride else None
    tile = _score_tile(query, h * group * rows * n)
    for first in range(0, length, rows):
        last = min(length, first + rows)
        r = last - first
        scores = tile[: h * group * r * n].view(h, group * r, n)
        torch.bmm(q[:, :, first:last].reshape(h, group * r, d), keys_t, out=scores)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        if row_bias is not None:
            scores.add_(row_bias)
        scores.view(h, group, r, n)[..., n - length :].masked_fill_(future[first:last], float("-inf"))
        probs = torch._softmax(scores, -1, False, out=scores)  # in place: the tile holds P now
        out[:, :, first:last] = torch.bmm(probs, values).view(h, group, r, d)
        if mass is not None:
            # Chunk rows L-1, L-1-s, ... that fall in this block.
            start = first + (length - 1 - first) % mass_stride
            if start < last:
                taken = probs.view(h * group, r, n)[:, start - first :: mass_stride]
                # Summed over rows as a product with a ones row: fp32 accumulation inside
                # the GEMM, one bf16 rounding per block (a sum with dtype=float32 over
                # this axis is 8x slower), then accumulated in fp32.
                ones = torch.ones(h * group, 1, taken.shape[1], dtype=probs.dtype, device=probs.device)
                mass.view(h * group, 1, n).add_(torch.bmm(ones, taken))
    if mass is not None and mass_stride > 1:
        mass.mul_(length / len(range(length - 1, -1, -mass_stride)))
    return out.view(hq, length, d), mass


# Entries a decode step's bf16 products are padded to a multiple of. oneDNN builds (and
# caches) a matmul for each new shape, 1.3-1.4 ms each on a 2-core EPYC; a cache that
# grows by a token a step would build one per step.
DECODE_SHAPE_STEP = 64


def decode_attention(
    query: Tensor, segments: list[Segment], scale: float, want_mass: bool = False, softcap: float | None = None
) -> tuple[Tensor, list[Tensor] | None]:
    """A decode step's attention as bf16 matrix products: the one-query case of
    `blocked_prefill_attention`.

    query: [Hq, 1, d] bf16 (its own key is already cached); segments: keys/values
    [H, n, d] bf16 and a log-weight a [H, n] or None (one weight per entry: b is
    ignored; -inf hides an entry). Returns out [Hq, 1, d] and, with `want_mass`, per
    segment the query's probabilities [H, G, n] float32 (what score keepers observe).

    The segments are copied, one after another, into one contiguous buffer of a whole
    number of DECODE_SHAPE_STEP entries (the rest hidden): CPU products take their fast
    path only on contiguous operands (QKᵀ over a strided 1k-entry view takes 104 µs, a copy
    and the product 36), and a shape that changes every step would build a new oneDNN
    matmul every step. Then QKᵀ is one bf16 product (the scale folded into the query, as
    in the prefill kernel), weights are added in float32 (a log-weight is not rounded to
    bf16), the softmax runs in float32 inside PyTorch, and P·V is one product
    accumulating in float32. A `softcap` caps the scores (in float32) before the weights.
    """
    hq, length, d = query.shape
    h = segments[0][0].shape[0]
    sizes = [k.shape[1] for k, _v, _a, _b in segments]
    n = sum(sizes)
    room = -(-n // DECODE_SHAPE_STEP) * DECODE_SHAPE_STEP
    keys, values = _decode_buffers(query, h, room, d)
    at = 0
    for (k, v, _a, _b), size in zip(segments, sizes):
        keys[:, at : at + size] = k
        values[:, at : at + size] = v
        at += size
    keys[:, n:] = 0
    values[:, n:] = 0
    q = query.mul(scale).reshape(h, hq // h * length, d)  # float32 inside, one rounding
    scores = torch.bmm(q, keys.transpose(1, 2))  # [H, G*L, room]
    if softcap is not None:
        scores = scores.float().div_(softcap).tanh_().mul_(softcap)
    if any(a is not None for _k, _v, a, _b in segments):
        scores = scores.float()
        at = 0
        for (_k, _v, a, _b), size in zip(segments, sizes):
            if a is not None:
                scores[..., at : at + size].add_(a[:, None, :])
            at += size
    scores[..., n:] = float("-inf")
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.bmm(probs, values).reshape(hq, length, d)
    if not want_mass:
        return out, None
    mass = probs[..., :n].float().view(h, hq // h, length, n).sum(2)
    return out, list(mass.split(sizes, dim=-1))


_scratch = threading.local()


def _decode_buffers(like: Tensor, h: int, room: int, d: int) -> tuple[Tensor, Tensor]:
    """Keys and values buffers [h, room, d] for one decode step, reused from step to step
    and layer to layer (one storage per thread: the layers of a step run one after
    another, and nothing keeps a view past the step). Fresh buffers each step would come
    from fresh pages more often than not: copying 4k entries into them costs 700 µs of page
    faults instead of 45 µs."""
    need = h * room * d
    storage = _thread_buffer("storage", like, 2 * need, spare=2 * need // 4)  # a quarter spare: the window grows
    return storage[:need].view(h, room, d), storage[need : 2 * need].view(h, room, d)


def _score_tile(like: Tensor, numel: int) -> Tensor:
    """A prefill block's scores, then its probabilities in place (`blocked_prefill_attention`):
    one buffer per thread, reused from block to block and layer to layer. A fresh 16 MiB
    tile per block would come from fresh pages, and a softmax writing a second one costs
    28% of a 6k prefill; with one reused tile a 6k prefill takes 0.69-0.97x as long, with
    the same logits (docs/decisions/0005-bf16-attention-paths.md)."""
    return _thread_buffer("tile", like, numel)


def _thread_buffer(name: str, like: Tensor, numel: int, spare: int = 0) -> Tensor:
    """The calling thread's flat buffer `name` of at least `numel` elements of `like`'s
    dtype and device, grown (with `spare` more) only when too small: its first `numel`."""
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = like.new_empty(numel + spare)
        setattr(_scratch, name, buffer)
    return buffer[:numel]


def _row_max(logits: list[Tensor]) -> Tensor:
    """Row-wise max over segments, [H, rows, 1]; a row with every entry masked gets 0."""
    peak = None
    for x in logits:
        top = x.amax(-1, keepdim=True)
        peak = top if peak is None else torch.maximum(peak, top)
    return cast(Tensor, peak).nan_to_num_(neginf=0.0)  # `logits` is never empty


def _accumulate(total: Tensor | None, part: Tensor) -> Tensor:
    return part if total is None else total.add_(part)


def kvchat_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: attention over the kvchat cache of this layer.

    The cache has already stored this step's keys/values (its `update` ran); it is passed
    through the model's forward kwargs as `kvchat_cache`.
    """
    cache = kwargs["kvchat_cache"]
    out = cache.attend(module.layer_idx, query[0], scaling if scaling is not None else module.scaling)
    return out.transpose(0, 1).unsqueeze(0), None  # [1, L, Hq, d]


def register() -> None:
    """Register kvchat's attention under ATTN_NAME (idempotent). No mask function is
    registered on purpose: transformers then skips building masks, and the cache
    applies its own (cached entries fully visible, causal among new tokens)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, kvchat_attention)
