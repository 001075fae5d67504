"""One layer of the compressed cache: exact sinks + a compressor's middle + an exact window.

Apart from `kvchat.cache.compressed_cache` because a layer is where attention is computed: it picks the
attention path for each forward pass (the blocked bf16 prefill kernel on a CPU and its
one-query case for score-based decode steps, fused SDPA, the fused decode kernel or the
explicit segment kernel that also measures attention mass), streams window overflow
into its compressor and holds its own state. The cache (`kvchat.cache.compressed_cache`) drives every
layer the same way; it never reads the segments itself.

With a recall tier (`kvchat.recall.tier`, off unless the cache's `recall` is set), every
token leaving the window is also appended to the tier, and each forward pass attends one
more exact segment, the cold rows its queries rank highest, placed *first* so that the
last two segments stay middle and window (what `_observe` hands to the score keepers).
Without one, a pass attends sinks, middle and window alone.
"""

from __future__ import annotations

import contextlib
import time
from typing import cast

import torch
from torch import Tensor

from kvchat.cache.attention import (
    Segment,
    banded_attention,
    blocked_prefill_attention,
    blocked_prefill_available,
    decode_attention,
    fused_segment_attention,
    fused_segments_available,
    sampled_mass,
    segment_attention,
)
from kvchat.cache.window_buffer import WindowBuffer
from kvchat.compress.base import Compressor, LayerSpec
from kvchat.kv_types import Entries, LayerGeometry, StateDict, state_tensor, tensor_bytes
from kvchat.recall.tier import Recalled, RecallTier
from kvchat.runtime import SMALL_INGEST, one_thread

# Score-based methods take a prefill chunk's attention mass from every this-many-th query
# (1 = every query, the exact sum). Where PyTorch's fused SDPA computes the chunk (float32,
# CUDA), the mass needs a second, explicit kernel, which over whole chunks cost 2-3x the
# prefill time of the other methods: every 8th query.
PREFILL_MASS_STRIDE = 8
# Where the blocked bf16 kernel computes the chunk (`attention.blocked_prefill_attention`),
# the mass is a sum over the probabilities it already holds, so every query counts
# (docs/decisions/0005-bf16-attention-paths.md compares strides 1, 2, 4 and 8).
BLOCKED_MASS_STRIDE = 1
# Entries from which a score-based method's bf16 decode step runs as bf16 products
# (`decode_attention`) instead of the explicit float32 kernel. h2o decoded 15% faster
# with products at 2k entries, about as fast at 1k, and 2% slower at 256-384 (a growing
# window pays a new oneDNN matmul every 64 entries; docs/decisions/0005-bf16-attention-paths.md).
SCORED_PRODUCTS_FROM = 1024


class CompressedLayer:
    """One layer: sinks [H, s, d] + compressor middle + window [H, w, d] (all exact but
    the middle). The window tensor may grow past `window` during a forward pass (the new
    tokens); `settle` brings it back."""

    def __init__(
        self,
        spec: LayerSpec,
        compressor: Compressor,
        sinks: int,
        recall: RecallTier | None = None,
        geometry: LayerGeometry | None = None,
    ) -> None:
        """`recall`: this layer's recall tier (None: off). `geometry`: the layer's RoPE,
        sliding window and soft-capping (None: a layer with none of them, which a
        compaction never turns). A sliding-window layer holds no sinks, no middle and no
        recall tier: only the tokens its window still sees, exact (`evict` drops the rest)."""
        self.spec = spec
        self.geometry = geometry or LayerGeometry()
        self.sliding_window = self.geometry.sliding_window
        self.softcap = self.geometry.softcap
        self.recall = None if self.sliding_window is not None else recall
        self.compressor = compressor
        self.sink_limit = 0 if self.sliding_window is not None else sinks
        h, d = spec.num_kv_heads, spec.head_dim
        empty = lambda: torch.zeros(h, 0, d, device=spec.device, dtype=spec.dtype)  # noqa: E731
        self.sink_keys, self.sink_values = empty(), empty()
        self.sink_pos = torch.zeros(0, dtype=torch.long, device=spec.device)
        self.window = WindowBuffer(empty(), empty(), torch.zeros(0, dtype=torch.long, device=spec.device))
        self.middle: Entries = compressor.entries()
        # (PyTorch's fused kernels cannot soft-cap logits: a capped layer never takes them,
        # `_attend_capped`.)
        self.fused_decode = fused_segments_available(spec.device)
        self.blocked_prefill = blocked_prefill_available(spec.device, spec.dtype)
        self.mass_stride = BLOCKED_MASS_STRIDE if self.blocked_prefill else PREFILL_MASS_STRIDE
        self.observe_seconds = 0.0  # time in `observe` and score bookkeeping (bench)
        # Where compacted middle positions came from (see `kvchat.cache.positions.token_index`):
        # per head, the sorted positions below the cache's origin boundary [H, m] and the
        # token each stands for [H, m]. None until the first compaction.
        self.origin_pos: Tensor | None = None
        self.origin_tok: Tensor | None = None
        self._reset_scores()

    def _reset_scores(self) -> None:
        if self.compressor.needs_attention:
            h, g = self.spec.num_kv_heads, self.spec.group_size
            self.window.set_scores(torch.zeros(h, g, len(self.window), device=self.spec.device))
        else:
            self.window.set_scores(None)

    # -- writes -------------------------------------------------------------------
    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """New tokens [H, L, d]: the first ones fill the sinks, the rest join the window."""
        room = self.sink_limit - self.sink_keys.shape[1]
        if room > 0:
            take = min(room, keys.shape[1])
            self.sink_keys = torch.cat([self.sink_keys, keys[:, :take]], 1)
            self.sink_values = torch.cat([self.sink_values, values[:, :take]], 1)
            self.sink_pos = torch.cat([self.sink_pos, positions[:take]])
            keys, values, positions = keys[:, take:], values[:, take:], positions[take:]
        if keys.shape[1] == 0:
            return
        self.window.append(keys, values, positions)

    @property
    def recalls(self) -> bool:
        """Whether this layer recalls at each pass. A tier that does not rank (the layer is
        not one of the model's retrieval layers, `kvchat.calibration.calibrate.recall_layers`) keeps
        nothing, and the layer attends as it would without recall."""
        return self.recall is not None and self.recall.ranks

    def evict(self, count: int) -> None:
        """Stream the `count` oldest window tokens into the compressor (a sliding-window
        layer drops them: no later query of the model would see them)."""
        if count <= 0:
            return
        if self.sliding_window is not None:
            self.window.drop(count)
            return
        h = self.spec.num_kv_heads
        scores = None if self.window.scores is None else self.window.scores[..., :count].contiguous()
        # A decode batch runs on one thread (kvchat/runtime.py, SMALL_INGEST); a flush on all.
        with one_thread() if count <= SMALL_INGEST else contextlib.nullcontext():
            # Every token leaving the window goes cold, exact, whatever the compressor keeps;
            # but one that keeps every token (full) holds them all exactly already: a tier
            # it has not written to stays empty until a switch hands its middle over
            # (`CompressedCache.switch_method`; a 6k document's rows take about 64 MB on disk).
            if self.recall is not None and (self.compressor.bounded or self.recall.rows):
                self.recall.append(
                    self.window.keys[:, :count],
                    self.window.values[:, :count],
                    self.window.pos[:count],
                    stage=not self.compressor.keeps_middle,
                )
            self.compressor.ingest(
                self.window.keys[:, :count].contiguous(),
                self.window.values[:, :count].contiguous(),
                self.window.pos[:count].expand(h, -1).contiguous(),
                scores=scores,
            )
        self.window.drop(count)
        self.middle = self.compressor.entries()

    def sliding_keep(self, allowance: int) -> int:
        """Window tokens a sliding-window layer keeps after a pass: those the next query
        still sees (its window less itself), at most `allowance` (what the budget gives
        every other layer)."""
        return max(1, min(cast(int, self.sliding_window) - 1, allowance))

    # -- reads --------------------------------------------------------------------
    def attend(self, query: Tensor, scale: float, new_tokens: int) -> Tensor:
        if self.sliding_window is not None and (new_tokens > 1 or len(self.window) > self.sliding_window):
            return self._attend_band(query, scale)
        if self.softcap is not None:
            return self._attend_capped(query, scale, new_tokens)
        m = self.middle
        # The sinks may hold this step's tokens too (the first tokens of a session);
        # the causal mask only covers the window, so those cases use the reference path.
        causal_ok = self.window.keys.shape[1] >= new_tokens
        rec = None
        if self.recalls and causal_ok:
            rec = cast(RecallTier, self.recall).recall(query, m, self._layout_end())  # `recalls`: a tier is set
        middle = self._middle_segment(rec)
        want_mass = self.compressor.needs_attention
        split = self.compressor.split_weights and m.length > 0
        fused_decode = new_tokens == 1 and not want_mass and not split and self.fused_decode
        if fused_decode and (rec is None or rec.weights is None):
            return self._attend_decode(query, scale, rec, middle)
        segments = self._segments(rec, middle)
        if new_tokens == 1 and want_mass and not split and causal_ok and self.blocked_prefill:
            entries = self.sink_keys.shape[1] + m.length + len(self.window)
            if entries >= SCORED_PRODUCTS_FROM:
                return self._attend_decode_scored(query, scale, segments)
        if new_tokens > 1 and not split and self.blocked_prefill:
            # bf16 on a CPU: outputs and (score-based methods) attention mass from one
            # blocked kernel; it also covers the start of a session (`_attend_concat`'s case:
            # the chunk's tokens are still the last entries of sinks + window).
            out, mass = self._attend_blocked(query, scale, new_tokens, rec, want_mass)
            if mass is not None:
                self._observe(mass)
            return out
        if new_tokens > 1 and not split and (not want_mass or (causal_ok and self.mass_stride > 1)):
            out = self._attend_fused(query, scale, new_tokens, rec)
            if want_mass:
                # Score-based methods: outputs from the fused kernel, attention mass from
                # every `mass_stride`-th query of the chunk (docs/methods.md, "Departures
                # shared by every method").
                self._observe(sampled_mass(query, segments, scale, self.mass_stride))
            return out
        if fused_decode:  # recalled rows of which some are masked: a segment of their own
            return fused_segment_attention(query, segments, scale)
        if not causal_ok:
            return self._attend_concat(query, scale, new_tokens)
        out, mass = segment_attention(query, segments, scale, causal_last=True, split=split, want_mass=want_mass)
        if mass is not None:
            self._observe(mass)
        return out

    def _layout_end(self) -> int | None:
        """Where the recalled rows' layout ends (`RecallTier.recall`): the position of the
        window's first token (this pass's tokens are its last ones); None where the tier
        leaves its rows in place (a session inside the trained context), which reads no
        position (on a GPU, one read fewer from the device per layer and pass)."""
        if self.recall is None or not self.recall.lay_out:
            return None
        return int(self.window.pos[0])

    def _segments(self, rec: Recalled | None, middle: Segment | None) -> list[Segment]:
        """The pass's segments in the order `_observe` reads them: [recalled rows +] sinks,
        the middle (if any), the window."""
        segments: list[Segment] = []
        if rec is not None:
            segments.append(self._lead_segment(rec))
        elif self.sink_keys.shape[1]:
            segments.append((self.sink_keys, self.sink_values, None, None))
        if middle is not None:
            segments.append(middle)
        segments.append((self.window.keys, self.window.values, None, None))
        return segments

    def _middle_segment(self, rec: Recalled | None) -> Segment | None:
        """The middle as a segment (None: empty): exact weights dropped, a recall's
        weights where it has them."""
        m = self.middle
        if not m.length:
            return None
        if not self.compressor.split_weights and not bool(m.log_num.any()):
            return m.keys, m.values, None, None
        if rec is not None:
            return m.keys, m.values, rec.middle_num, rec.middle_den
        return m.keys, m.values, m.log_num, m.log_den

    def _attend_band(self, query: Tensor, scale: float) -> Tensor:
        """A sliding-window layer's pass over more than one query, or over a window longer
        than the model's (an exact-then-compress prefill holds every token until its
        flush): each query sees the keys of its own last `sliding_window` positions."""
        return banded_attention(
            query,
            self.window.keys,
            self.window.values,
            self.window.pos,
            scale,
            cast(int, self.sliding_window),
            self.softcap,
        )

    def _attend_capped(self, query: Tensor, scale: float, new_tokens: int) -> Tensor:
        """A soft-capped layer's pass (Gemma 2): logits are capped before the entries'
        weights are added. Where bf16 runs natively, the blocked prefill kernel and its
        one-query case cap them; elsewhere the explicit segment kernel does. Recall and
        attention mass as on the other paths."""
        m = self.middle
        causal_ok = self.window.keys.shape[1] >= new_tokens
        if not causal_ok:
            return self._attend_concat(query, scale, new_tokens)
        rec = cast(RecallTier, self.recall).recall(query, m, self._layout_end()) if self.recalls else None
        segments = self._segments(rec, self._middle_segment(rec))
        split = self.compressor.split_weights and m.length > 0
        want_mass = self.compressor.needs_attention
        if self.blocked_prefill and not split:
            if new_tokens == 1:
                out, mass = decode_attention(query, segments, scale, want_mass=want_mass, softcap=self.softcap)
            else:
                out, mass = self._attend_blocked(query, scale, new_tokens, rec, want_mass)
            if mass is not None:
                self._observe(mass)
            return out
        out, mass = segment_attention(
            query, segments, scale, causal_last=True, split=split, want_mass=want_mass, softcap=self.softcap
        )
        if mass is not None:
            self._observe(mass)
        return out

    def _attend_decode(self, query: Tensor, scale: float, rec: Recalled | None, middle: Segment | None) -> Tensor:
        """A decode step in the fused kernel. The window, then the recalled rows and the
        sinks (copied after it in its own storage by `WindowBuffer.with_tail`), are one
        segment, so one kernel call, and the middle, if any, another: each segment costs
        a call, and at 1k entries one call fewer per layer saves 70 µs of a 195 µs attention
        (2 threads)."""
        keys = [self.sink_keys] if rec is None else [rec.keys, self.sink_keys]
        values = [self.sink_values] if rec is None else [rec.values, self.sink_values]
        joined_keys, joined_values = self.window.with_tail(keys, values)
        segments = [] if middle is None else [middle]
        return fused_segment_attention(query, [*segments, (joined_keys, joined_values, None, None)], scale)

    def _attend_decode_scored(self, query: Tensor, scale: float, segments: list[Segment]) -> Tensor:
        """A decode step of a score-based method (h2o, bumblebee) where prefill chunks run
        in the blocked bf16 kernel: its one-query case (`decode_attention`), whose
        probabilities are also the mass the scores keep (per segment, as `_observe` takes
        them). The explicit kernel would convert every cached key and value to float32 at
        every step."""
        out, mass = decode_attention(query, segments, scale, want_mass=True)
        assert mass is not None
        self._observe(mass)
        return out

    def _lead_segment(self, rec: Recalled) -> Segment:
        """The recalled rows and the sinks as one segment (exact, a = b; blocked rows -inf):
        one kernel call fewer per step than two segments."""
        s = self.sink_keys.shape[1]
        weights = rec.weights
        if not s:
            return rec.keys, rec.values, weights, weights
        if weights is not None:
            weights = torch.cat([weights, weights.new_zeros(weights.shape[0], s)], 1)
        return (
            torch.cat([rec.keys, self.sink_keys], 1),
            torch.cat([rec.values, self.sink_values], 1),
            weights,
            weights,
        )

    def _observe(self, mass: list[Tensor]) -> None:
        """Hand attention mass per segment ([recalled rows + sinks], [middle], window) to
        the score keepers (recalled rows are cold: their mass goes to no one)."""
        start = time.perf_counter()
        with one_thread():
            if self.middle.length:
                self.compressor.observe(mass[-2])
            cast(Tensor, self.window.scores).add_(mass[-1])  # mass is observed only where the window keeps scores
        self.observe_seconds += time.perf_counter() - start

    def _joined(self, rec: Recalled | None) -> tuple[Tensor, Tensor, Tensor | None, int]:
        """Every part as one sequence for a prefill chunk: keys and values [H, n, d]
        ([recalled rows,] sinks, middle, window: the chunk's tokens last), the log-weights
        as a bias [H, n] (None when all are 0) and where the middle starts."""
        m = self.middle
        lead = [] if rec is None else [rec.keys]
        keys = torch.cat([*lead, self.sink_keys, m.keys, self.window.keys], 1)
        lead = [] if rec is None else [rec.values]
        values = torch.cat([*lead, self.sink_values, m.values, self.window.values], 1)
        r = 0 if rec is None else rec.keys.shape[1]
        s = r + self.sink_keys.shape[1]
        middle_bias = m.log_num if rec is None else rec.middle_num
        rec_bias = None if rec is None else rec.weights
        bias = None
        if rec_bias is not None or (m.length and bool(middle_bias.any())):
            bias = torch.zeros(self.spec.num_kv_heads, keys.shape[1], device=keys.device)
            if rec_bias is not None:
                bias[:, :r] = rec_bias
            bias[:, s : s + m.length] = middle_bias
        return keys, values, bias, s

    def _attend_blocked(
        self, query: Tensor, scale: float, new_tokens: int, rec: Recalled | None, want_mass: bool
    ) -> tuple[Tensor, list[Tensor] | None]:
        """A prefill chunk in the blocked bf16 kernel; with `want_mass`, the mass per part
        as `_observe` takes it: [[recalled rows +] sinks, middle, window]."""
        keys, values, bias, s = self._joined(rec)
        stride = self.mass_stride if want_mass else 0
        out, mass = blocked_prefill_attention(query, keys, values, bias, scale, stride, softcap=self.softcap)
        if mass is None:
            return out, None
        mid = s + self.middle.length
        return out, [mass[..., :s], mass[..., s:mid], mass[..., mid:]]

    def _attend_fused(self, query: Tensor, scale: float, new_tokens: int, rec: Recalled | None = None) -> Tensor:
        """Prefill chunks with one weight per entry (a == b): PyTorch's fused SDPA over
        the concatenated parts; the chunk's tokens are the last entries (causal among
        them), middle log-weights (and the recalled rows' weights) become an additive bias."""
        keys, values, bias, _ = self._joined(rec)
        keys, values = keys[None], values[None]
        n, length = keys.shape[2], new_tokens
        visible = torch.ones(length, n, dtype=torch.bool, device=keys.device)
        visible[:, n - length :] = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
        mask: Tensor = visible
        if bias is not None:
            bias = bias.repeat_interleave(self.spec.group_size, 0)[:, None, :]  # per query head
            mask = bias.masked_fill(~visible, float("-inf")).to(query.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            query[None], keys, values, attn_mask=mask, scale=scale, enable_gqa=self.spec.group_size > 1
        )
        return out[0]

    def _attend_concat(self, query: Tensor, scale: float, new_tokens: int) -> Tensor:
        """Start of a session: new tokens span sinks and window; one concatenated segment."""
        m = self.middle
        keys = torch.cat([self.sink_keys, m.keys, self.window.keys], 1)
        values = torch.cat([self.sink_values, m.values, self.window.values], 1)
        segment: list[Segment] = [(keys, values, None, None)]
        if new_tokens > 1 and self.mass_stride > 1 and not self.compressor.split_weights and self.softcap is None:
            # As for every later chunk: outputs from the fused kernel (the same numbers
            # every method computes here, so a shared prefill forks to any method
            # unchanged), mass from every `mass_stride`-th query; the chunk's tokens are
            # the last entries of the one segment, as `sampled_mass` needs.
            out = self._attend_fused(query, scale, new_tokens)
            mass = sampled_mass(query, segment, scale, self.mass_stride) if self.compressor.needs_attention else None
        else:
            out, mass = segment_attention(
                query,
                segment,
                scale,
                causal_last=True,
                split=False,
                want_mass=self.compressor.needs_attention,
                softcap=self.softcap,
            )
        if mass is not None:
            start = time.perf_counter()
            s, n_mid = self.sink_keys.shape[1], m.length
            if n_mid:
                self.compressor.observe(mass[0][..., s : s + n_mid])
            cast(Tensor, self.window.scores).add_(mass[0][..., s + n_mid :])  # as in `_observe`
            self.observe_seconds += time.perf_counter() - start
        return out

    def refit(self) -> None:
        """Bring the middle within a lowered `compressor.budget` now: an ingest of no
        tokens (the interface's promise, at most `budget` entries per head after any
        ingest, holds for a batch of any size)."""
        h, d, dev = self.spec.num_kv_heads, self.spec.head_dim, self.spec.device
        none = torch.zeros(h, 0, d, device=dev, dtype=self.spec.dtype)
        scores = torch.zeros(h, self.spec.group_size, 0, device=dev) if self.compressor.needs_attention else None
        self.compressor.ingest(none, none.clone(), torch.zeros(h, 0, dtype=torch.long, device=dev), scores=scores)
        self.middle = self.compressor.entries()

    @property
    def middle(self) -> Entries:
        return self._middle

    @middle.setter
    def middle(self, entries: Entries) -> None:
        # Its entries are counted here, on the thread that changes the cache: the app's
        # status bar reads `entry_count` from the UI thread, which must run no tensor
        # work (a large one starts PyTorch's parallel work there, and a second OpenMP
        # team slows the model's thread: kvchat/tui/flows/runner.py).
        self._middle = entries
        if entries.length:
            finite = torch.isfinite(entries.log_num) | torch.isfinite(entries.log_den)
            self._middle_entries = int(finite.sum(1).max())
        else:
            self._middle_entries = 0

    def entry_count(self) -> int:
        """Entries per KV head (largest head), padding excluded. No tensor work."""
        return self.sink_keys.shape[1] + self._middle_entries + len(self.window)

    def nbytes(self) -> int:
        """Bytes held in memory: sinks, window, the middle and the recall tier's index."""
        return (
            tensor_bytes(
                self.sink_keys,
                self.sink_values,
                self.sink_pos,
                self.window.keys,
                self.window.values,
                self.window.pos,
                self.window.scores,
            )
            + self.compressor.nbytes()
            + (0 if self.recall is None else self.recall.nbytes())
        )

    # -- state --------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        state: StateDict = {
            "sink_keys": self.sink_keys,
            "sink_values": self.sink_values,
            "sink_pos": self.sink_pos,
            # Copies: the window buffers keep changing in place.
            "win_keys": self.window.keys.clone(),
            "win_values": self.window.values.clone(),
            "win_pos": self.window.pos.clone(),
        }
        if self.window.scores is not None:
            state["win_scores"] = self.window.scores.clone()
        if self.origin_pos is not None:
            # origin_tok is set together with origin_pos
            state["origin_pos"], state["origin_tok"] = self.origin_pos, cast(Tensor, self.origin_tok)
        for key, value in self.compressor.state_dict().items():
            state[f"compressor.{key}"] = value
        if self.recall is not None:
            # The tier's own scalars (its rows are saved apart: `CompressedCache.cold_rows`).
            state.update(self.recall.state_dict())
        return state

    def load_state_dict(self, state: StateDict) -> None:
        dev = self.spec.device
        self.sink_keys = state_tensor(state, "sink_keys").to(dev)
        self.sink_values = state_tensor(state, "sink_values").to(dev)
        self.sink_pos = state_tensor(state, "sink_pos").to(dev)
        self.window = WindowBuffer(
            state_tensor(state, "win_keys").to(dev),
            state_tensor(state, "win_values").to(dev),
            state_tensor(state, "win_pos").to(dev),
        )
        self._reset_scores()
        if self.window.scores is not None and "win_scores" in state:
            self.window.set_scores(state_tensor(state, "win_scores").to(dev))
        # Snapshots from before origin tracking hold none: positions then read as tokens.
        self.origin_pos = state_tensor(state, "origin_pos").cpu() if "origin_pos" in state else None
        self.origin_tok = state_tensor(state, "origin_tok").cpu() if "origin_tok" in state else None
        inner = {
            k.removeprefix("compressor."): (v.to(dev) if isinstance(v, Tensor) and v.dtype != torch.uint8 else v)
            for k, v in state.items()
            if k.startswith("compressor.")
        }
        self.compressor.load_state_dict(inner)
        self.middle = self.compressor.entries()
        if self.recall is not None:
            # Empty until the saved rows come (`CompressedCache.load_cold`); a state
            # without a tier leaves it empty.
            self.recall.load_state(state)
