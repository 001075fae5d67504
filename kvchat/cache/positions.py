"""Positions of cached entries: re-rotation, compaction, and which token a position stands for.

The session's position counter runs past the model's trained context in a long
conversation, so the cache re-packs positions (`compact`): every cached key is re-rotated
(`rerotate`; RoPE rotations compose) so entries take contiguous positions again
(docs/design.md, "Positions and compaction"). After that a held position no longer says
which token it came from, so each compaction records, per layer and head, the token each
new middle position stands for (`record_origins`), and `token_index` reads positions
back as tokens; the memory map (`memory_map`) is built on it.

The recall tier (`kvchat.recall.tier`) moves with the hot cache: its rows are numbered by token,
never by position, and at a compaction every cold key is re-rotated to a position between
those of the held entries around its token (`cold_positions`: sinks, each head's packed
middle and the window's first token are the anchors; a cold token between two of them is
placed by linear interpolation, a fractional position), so a recalled key sits where its
token would among the packed ones, in order.

Apart from `kvchat.cache.compressed_cache` because none of this is the transformers `Cache` protocol or
the byte budget: the functions take the layers and the counters as arguments and return
the new counters; the cache keeps the counters (they are part of its snapshot) and
delegates its `compact_positions`, `token_index` and `memory_map` here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from kvchat.cache.layer import CompressedLayer
from kvchat.cache.window_buffer import WindowBuffer
from kvchat.kv_types import rerotate

# Sorts after every real position: pads each head's sorted middle positions.
_PAD = torch.iinfo(torch.long).max


def reference_layer(layers: list[CompressedLayer]) -> CompressedLayer:
    """The layer whose sinks and window the position counters follow: the last one that
    sees every earlier token (a sliding-window layer holds no sinks, and its window may be
    longer or shorter than the others'); the last layer when all of them slide."""
    full = [layer for layer in layers if layer.sliding_window is None]
    return full[-1] if full else layers[-1]


def sinks_used(layers: list[CompressedLayer]) -> int:
    """Sink positions taken (every layer that sees every earlier token holds the same sinks)."""
    return int(reference_layer(layers).sink_pos.numel())


def token_index(layer: CompressedLayer, positions: Tensor, *, sinks: int, boundary: int, shift: int) -> Tensor:
    """The token (index into everything the session fed) that each held position
    [H, n] stands for: positions are token indices until the first compaction, after
    which the layer's origin table (below `boundary`) and the running `shift` (at or past
    it) say where they came from; the first `sinks` positions never move. A position that
    is no entry (a cluster representative) reads as the entry at or before it."""
    positions = positions.cpu()
    tokens = positions + shift
    if layer.sliding_window is not None:
        return tokens  # a sliding layer holds no sinks, and a compaction moves it as one block
    is_sink = positions < sinks
    tokens = torch.where(is_sink, positions, tokens)
    below = ~is_sink & (positions < boundary)
    if layer.origin_pos is not None and bool(below.any()):
        table = layer.origin_pos.contiguous()
        at = torch.searchsorted(table, positions.contiguous(), right=True) - 1
        # origin_tok is set together with origin_pos
        looked = torch.gather(cast(Tensor, layer.origin_tok), 1, at.clamp(0, table.shape[1] - 1))
        tokens = torch.where(below, looked, tokens)
    return tokens


TokenIndex = Callable[[CompressedLayer, Tensor], Tensor]


def record_origins(layer: CompressedLayer, sorted_pos: Tensor, base: Tensor, index: TokenIndex) -> None:
    """Before a compaction moves this layer's middle: remember, for each new middle
    position (base + rank, per head), the token the old position stood for (`index`
    reads old positions as tokens, with the counters from before this compaction)."""
    real = sorted_pos != _PAD
    old = torch.where(real, sorted_pos, torch.zeros_like(sorted_pos)).cpu()
    tokens = index(layer, old)
    rank = torch.arange(sorted_pos.shape[1])[None]
    new = torch.where(real.cpu(), base.cpu()[:, None] + rank, torch.full_like(old, _PAD))
    layer.origin_pos, layer.origin_tok = new, torch.where(real.cpu(), tokens, torch.full_like(tokens, -1))


Reposition = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def _repositioner(
    sinks: int, win_old: int, widest: int, sorted_pos: Tensor, base: Tensor, inv_freq: Tensor | None
) -> Reposition:
    """One layer's move for `Compressor.reposition`: (keys, positions [H, n]) -> (keys
    re-rotated, new positions). Sinks keep their positions; window tokens (from `win_old`
    on) shift as a block to follow the `widest` middle; a middle entry takes its rank
    among this head's `sorted_pos`, from `base` (works for positions that are not
    entries too, e.g. cluster representatives)."""

    def reposition(keys: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        new = positions.clone()
        in_window = positions >= win_old
        new[in_window] = positions[in_window] - win_old + sinks + widest
        in_middle = (positions >= sinks) & ~in_window
        if in_middle.any():
            rank = torch.searchsorted(sorted_pos.contiguous(), positions.contiguous())
            new = torch.where(in_middle, base[:, None] + rank, new)
        return rerotate(keys, (new - positions).to(keys.device), inv_freq), new

    return reposition


def compact(
    layers: list[CompressedLayer], *, next_position: int, sinks: int, boundary: int, shift: int
) -> tuple[int, int, int]:
    """Re-rotate every cached key so entries occupy contiguous positions in order: sinks
    keep theirs, each head's middle is packed and right-aligned against the window, the
    window follows. A sliding-window layer (no sinks, no middle) moves as one block with
    the window, so its distances stay those the model computed. Each layer turns its keys
    by its own RoPE (`CompressedLayer.geometry`). `next_position`, `boundary` and `shift`
    are the cache's counters before; returns them after, as (next_position, boundary,
    shift). `sinks` is the configured sink count (the next position when no layer holds
    a window)."""
    # One line of positions for all layers: the next token gets one position in every
    # layer, so every layer's window must start at the same place (middles may differ
    # in size between layers).
    widest = max(layer.entry_count() - layer.sink_pos.numel() - layer.window.pos.numel() for layer in layers)
    window_start = reference_layer(layers).window.pos
    win_old_all = int(window_start[0]) if window_start.numel() else next_position
    used = sinks_used(layers)

    def old_index(layer: CompressedLayer, positions: Tensor) -> Tensor:
        # The counters from before this compaction: every layer's origins are recorded
        # from the positions they had, before any counter moves.
        return token_index(layer, positions, sinks=used, boundary=boundary, shift=shift)

    for layer in layers:
        inv_freq = layer.geometry.inv_freq
        if layer.sliding_window is not None:
            _shift_block(layer, used + widest - win_old_all)
            continue
        m = layer.middle
        h = layers[0].spec.num_kv_heads
        s = layer.sink_pos.numel()
        finite = torch.isfinite(m.log_num) | torch.isfinite(m.log_den)
        counts = finite.sum(1) if m.length else torch.zeros(h, dtype=torch.long)
        # Sorted finite positions per head (padding pushed to the end).
        sorted_pos = torch.where(finite, m.positions, torch.full_like(m.positions, _PAD)).sort(1).values
        win_old = int(layer.window.pos[0]) if layer.window.pos.numel() else next_position
        base = s + (widest - counts)  # per head: right-align the middle
        reposition = _repositioner(s, win_old, widest, sorted_pos, base, inv_freq)
        record_origins(layer, sorted_pos, base, old_index)
        layer.compressor.reposition(reposition)
        layer.middle = layer.compressor.entries()
        if len(layer.window):
            window = layer.window
            keys, new = reposition(window.keys, window.pos.expand(h, -1))
            # New tensors, not writes into the old ones (those may be a caller's state dict).
            layer.window = WindowBuffer(keys, window.values, new[0].clone(), window.scores)
    last = reference_layer(layers)
    new_next = (
        int(last.window.pos[-1]) + 1
        if last.window.pos.numel()
        else sinks + int(max(layer.entry_count() for layer in layers))
    )
    new_shift = shift + win_old_all - (used + widest)
    for layer in layers:
        tier = layer.recall
        if tier is not None and tier.rows:
            # The window's first token (its old position + the old shift) now sits at
            # used + widest: the last anchor of every cold token.
            moved = cold_positions(layer, tier.tokens(), win_old_all + shift, used + widest)
            tier.reposition(moved, new_shift)
    return new_next, used + widest, new_shift


def _shift_block(layer: CompressedLayer, delta: int) -> None:
    """Move a sliding-window layer's tokens (all in its window) by `delta` positions."""
    window = layer.window
    if not len(window):
        return
    by = torch.full_like(window.pos, delta)
    keys = rerotate(
        window.keys, by.to(window.keys.device)[None].expand(window.keys.shape[0], -1), layer.geometry.inv_freq
    )
    layer.window = WindowBuffer(keys, window.values, window.pos + delta, window.scores)


def cold_positions(layer: CompressedLayer, tokens: Tensor, window_token: int, window_pos: int) -> Tensor:
    """Where cold `tokens` [n] (all before the window) go after a compaction, per head
    [H, n] float32: by linear interpolation, on tokens, between the anchors of the packed
    cache, the sinks (which keep their positions), the head's middle entries (the origin
    table this compaction just recorded) and the window's first token (`window_token`,
    now at `window_pos`). A cold token the middle holds exactly lands on its entry's
    position; with no sink, token -1 at position -1 anchors the start."""
    h = layer.spec.num_kv_heads
    sinks = layer.sink_pos.cpu().double()
    t = tokens.cpu().double()
    out = torch.empty(h, t.numel(), dtype=torch.float32)
    for head in range(h):
        at, to = [sinks], [sinks]
        if not sinks.numel():
            at, to = [torch.tensor([-1.0], dtype=torch.float64)], [torch.tensor([-1.0], dtype=torch.float64)]
        if layer.origin_tok is not None and layer.origin_tok.numel():
            real = layer.origin_tok[head] >= 0
            at.append(layer.origin_tok[head][real].double())
            to.append(cast(Tensor, layer.origin_pos)[head][real].double())  # set together with origin_tok
        at.append(torch.tensor([float(window_token)], dtype=torch.float64))
        to.append(torch.tensor([float(window_pos)], dtype=torch.float64))
        anchor_tok, anchor_pos = torch.cat(at), torch.cat(to)
        order = anchor_tok.argsort(stable=True)
        anchor_tok, anchor_pos = anchor_tok[order], anchor_pos[order]
        lo = (torch.searchsorted(anchor_tok, t, right=True) - 1).clamp(0, anchor_tok.numel() - 2)
        hi = lo + 1
        span = anchor_tok[hi] - anchor_tok[lo]
        frac = torch.where(span > 0, (t - anchor_tok[lo]) / span.clamp(min=1e-9), torch.zeros_like(t)).clamp(0, 1)
        out[head] = (anchor_pos[lo] + frac * (anchor_pos[hi] - anchor_pos[lo])).float()
    return out


@torch.inference_mode()
def memory_map(layers: list[CompressedLayer], bounds: list[tuple[int, int]], index: TokenIndex) -> list[list[float]]:
    """For each layer, the share of each token range [start, end) that the cache
    still represents, averaged over KV heads. An entry counts for the tokens it
    stands for (exp of its denominator log-weight: a merged entry its degree, a
    cluster sample its count; numerator-only entries count nothing), credited to
    the range its own token lies in (`index` reads positions as tokens), and a range's
    share is capped at 1."""
    if not bounds:
        return [[] for _ in layers]
    starts = torch.tensor([b[0] for b in bounds], dtype=torch.long)
    lengths = torch.tensor([max(1, b[1] - b[0]) for b in bounds], dtype=torch.float64)
    shares = []
    for layer in layers:
        h = layer.spec.num_kv_heads
        parts = [(layer.sink_pos.cpu().expand(h, -1), torch.ones(h, layer.sink_pos.numel(), dtype=torch.float64))]
        m = layer.middle
        if m.length:
            counts = torch.where(
                torch.isfinite(m.log_den), m.log_den.double().exp(), torch.zeros((), dtype=torch.float64)
            )
            parts.append((m.positions.cpu(), counts.cpu()))
        win = layer.window.pos.cpu()
        parts.append((win.expand(h, -1), torch.ones(h, win.numel(), dtype=torch.float64)))
        held = torch.zeros(h, len(bounds), dtype=torch.float64)
        for positions, counts in parts:
            if positions.numel() == 0:
                continue
            tokens = index(layer, positions)
            span = torch.searchsorted(starts, tokens.contiguous(), right=True) - 1
            inside = (span >= 0) & (tokens < torch.tensor([b[1] for b in bounds])[span.clamp(min=0)])
            held.scatter_add_(1, span.clamp(min=0), torch.where(inside, counts, torch.zeros_like(counts)))
        shares.append((held / lengths).clamp(max=1.0).mean(0).tolist())
    return shares
