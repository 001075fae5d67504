"""The compressed KV cache: per layer, exact sinks + a compressed middle + an exact window.

A transformers `Cache` subclass. The model's attention layers call `update` with the new
keys/values of a forward pass, then kvchat's registered attention function calls
`attend`, which reads the three parts as segments (nothing is concatenated per step).
After each forward pass the engine calls `settle`: tokens beyond the window stream into
the layer's compressor in batches of at least `batch` tokens, so compression cost is
amortised. Positions come from the session's own counter (never the cache length); when
the next position would pass the model's trained context, `compact_positions` re-rotates
every cached key so entries take contiguous positions again.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from . import allocate, compress
from .attention import fused_segment_attention, fused_segments_available, sampled_mass, segment_attention
from .compress.base import Compressor, Entries, LayerSpec, StateDict, tensor_bytes
from .threads import SMALL_INGEST, one_thread

DEFAULT_METHOD = "window"
DEFAULT_BUDGET = "1024"
DEFAULT_WINDOW = 1024
DEFAULT_SINKS = 4
DEFAULT_BATCH = 64
# Score-based methods take a prefill chunk's attention mass from every this-many-th query
# (1 = every query, the exact sum): the explicit kernel over whole chunks cost them 2-3x
# the prefill time of the other methods.
PREFILL_MASS_STRIDE = 8


# Sizes a byte budget may be given in (case-insensitive): KB/MB/GB are powers of 10,
# KiB/MiB/GiB powers of 2, as everywhere else.
BYTE_UNITS = {"KB": 10**3, "KIB": 2**10, "MB": 10**6, "MIB": 2**20, "GB": 10**9, "GIB": 2**30}
_UNIT_SPELLING = {"KB": "KB", "KIB": "KiB", "MB": "MB", "MIB": "MiB", "GB": "GB", "GIB": "GiB"}
BUDGET_FORMS = "entries per KV head (1024), a share of the tokens seen (25%) or a size (64MB, 64MiB, 1GB)"


@dataclass(frozen=True)
class Budget:
    """`1024` = middle entries per KV head; `25%` = total kept per KV head (sinks + window
    + middle) as a share of the tokens seen; `64MB` = the total KV bytes of the session,
    every layer, sinks and window included (docs/design.md, "Budgets").

    A byte budget has `unit` set ("MB", "MiB", ...) and `value` in bytes."""

    value: float
    percent: bool
    unit: str = ""

    @property
    def in_bytes(self) -> bool:
        return bool(self.unit)

    @staticmethod
    def parse(text: str | int) -> Budget:
        raw = str(text).strip()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", raw)
        if match:
            pct = float(match.group(1))
            if not 0 < pct <= 100:
                raise ValueError(f"budget {raw!r}: a percentage must be in (0, 100]")
            return Budget(pct / 100, True)
        if raw.isdigit():
            return Budget(int(raw), False)
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)", raw)
        if match:
            unit = match.group(2).upper()
            if unit not in BYTE_UNITS:
                raise ValueError(f"budget {raw!r}: unknown unit {match.group(2)!r}; use KB, KiB, MB, MiB, GB or GiB")
            size = float(match.group(1)) * BYTE_UNITS[unit]
            if size < 1:
                raise ValueError(f"budget {raw!r}: a size must be more than 0")
            return Budget(math.floor(size), False, _UNIT_SPELLING[unit])
        raise ValueError(f"budget {raw!r}: give {BUDGET_FORMS}")

    def split(self, tokens_seen: int, sinks: int, window: int, keeps_middle: bool = True) -> tuple[int, int]:
        """(middle budget, effective window) for the tokens seen so far. A method that
        keeps no middle gets the whole share as its window (equal memory). A byte budget
        is split by the cache, which knows what an entry costs (`CompressedCache.targets`)."""
        if self.in_bytes:
            raise ValueError("a budget in bytes is split by the cache (CompressedCache.targets)")
        if not self.percent:
            return int(self.value), window
        # The relative nudge undoes float error: 0.35 * 100 is 34.999..., not 35.
        total = max(1, math.floor(self.value * tokens_seen * (1 + 1e-12)))
        if not keeps_middle:
            return 0, max(1, total - sinks)
        middle = max(total - sinks - window, total // 2)
        return middle, max(1, total - sinks - middle)

    def __str__(self) -> str:
        if self.in_bytes:
            return f"{self.value / BYTE_UNITS[self.unit.upper()]:.12g}{self.unit}"
        return f"{self.value * 100:g}%" if self.percent else str(int(self.value))


def _megabytes(nbytes: float) -> str:
    """Bytes as MB (10^6), rounded up to 0.1 so that the figure is enough."""
    return f"{math.ceil(nbytes / 1e5) / 10:.1f} MB"


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(keys: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate post-RoPE keys by `delta` more positions (RoPE rotations compose)."""
    angle = delta.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)
    angle = torch.cat((angle, angle), dim=-1)
    k = keys.float()
    return (k * angle.cos() + rotate_half(k) * angle.sin()).to(keys.dtype)


# Spare slots a window buffer gets when it must grow: its live part is copied about once
# per this many appended tokens instead of on every decode step.
WINDOW_SLACK = 128


class WindowBuffer:
    """The window of one layer: its exact keys [H, w, d], values [H, w, d], positions [w]
    and, for score-based methods, attention mass [H, G, w], all w tokens long.

    The four tensors grow and shrink together, so they share one live range
    [start, stop) of their storage: appends fill spare room at the end, drops move
    `start`, and the live parts are copied only when the room runs out (or, after a
    large drop, to give memory back). `keys`, `values`, `pos` and `scores` are views of
    the live part; the layer never holds the storage itself."""

    # Each part's token axis in its storage tensor.
    _AXES = {"keys": 1, "values": 1, "pos": 0, "scores": 2}

    def __init__(self, keys: Tensor, values: Tensor, pos: Tensor, scores: Tensor | None = None) -> None:
        self._storage: dict[str, Tensor | None] = {"keys": keys, "values": values, "pos": pos, "scores": scores}
        self.start, self.stop = 0, pos.shape[0]

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def capacity(self) -> int:
        """Tokens the storage holds before it must grow."""
        return self._storage["pos"].shape[0]

    def _live(self, part: str) -> Tensor | None:
        tensor = self._storage[part]
        return None if tensor is None else tensor.narrow(self._AXES[part], self.start, len(self))

    @property
    def keys(self) -> Tensor:
        return self._live("keys")

    @property
    def values(self) -> Tensor:
        return self._live("values")

    @property
    def pos(self) -> Tensor:
        return self._live("pos")

    @property
    def scores(self) -> Tensor | None:
        return self._live("scores")

    def set_scores(self, scores: Tensor | None) -> None:
        """Start (or stop) keeping attention mass: `scores` [H, G, w] covers the live tokens."""
        if scores is None:
            self._storage["scores"] = None
            return
        shape = list(scores.shape)
        shape[2] = self.capacity
        storage = scores.new_zeros(shape)
        storage.narrow(2, self.start, len(self)).copy_(scores)
        self._storage["scores"] = storage

    def append(self, keys: Tensor, values: Tensor, pos: Tensor) -> None:
        """New tokens at the end (their attention mass starts at zero)."""
        n = pos.shape[0]
        if self.stop + n > self.capacity:
            self._move_to(len(self) + n + WINDOW_SLACK)
        for part, new in (("keys", keys), ("values", values), ("pos", pos)):
            self._storage[part].narrow(self._AXES[part], self.stop, n).copy_(new)  # type: ignore[union-attr]
        scores = self._storage["scores"]
        if scores is not None:
            scores.narrow(2, self.stop, n).zero_()
        self.stop += n

    def drop(self, count: int) -> None:
        """Forget the `count` oldest tokens."""
        self.start += count
        # After a large eviction (the end of an exact prefill) give the memory back now
        # instead of when the room next runs out.
        if self.capacity > 2 * (len(self) + WINDOW_SLACK):
            self._move_to(len(self) + WINDOW_SLACK)

    def _move_to(self, capacity: int) -> None:
        """Copy the live parts to the front of new storage of `capacity` tokens."""
        kept = len(self)
        for part, tensor in self._storage.items():
            if tensor is None:
                continue
            axis = self._AXES[part]
            shape = list(tensor.shape)
            shape[axis] = capacity
            moved = tensor.new_empty(shape)
            moved.narrow(axis, 0, kept).copy_(tensor.narrow(axis, self.start, kept))
            self._storage[part] = moved
        self.start, self.stop = 0, kept


class CompressedLayer:
    """One layer: sinks [H, s, d] + compressor middle + window [H, w, d] (all exact but
    the middle). The window tensor may grow past `window` during a forward pass (the new
    tokens); `settle` brings it back."""

    def __init__(self, spec: LayerSpec, compressor: Compressor, sinks: int) -> None:
        self.spec = spec
        self.compressor = compressor
        self.sink_limit = sinks
        h, d = spec.num_kv_heads, spec.head_dim
        empty = lambda: torch.zeros(h, 0, d, device=spec.device, dtype=spec.dtype)  # noqa: E731
        self.sink_keys, self.sink_values = empty(), empty()
        self.sink_pos = torch.zeros(0, dtype=torch.long, device=spec.device)
        self.window = WindowBuffer(empty(), empty(), torch.zeros(0, dtype=torch.long, device=spec.device))
        self.middle: Entries = compressor.entries()
        self.fused_decode = fused_segments_available(spec.device)
        self.mass_stride = PREFILL_MASS_STRIDE
        self.observe_seconds = 0.0  # time in `observe` and score bookkeeping (bench)
        # Where compacted middle positions came from (see `CompressedCache.token_index`):
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

    def evict(self, count: int) -> None:
        """Stream the `count` oldest window tokens into the compressor."""
        if count <= 0:
            return
        h = self.spec.num_kv_heads
        scores = None if self.window.scores is None else self.window.scores[..., :count].contiguous()
        # A decode batch runs on one thread (kvchat/threads.py, SMALL_INGEST); a flush on all.
        with one_thread() if count <= SMALL_INGEST else contextlib.nullcontext():
            self.compressor.ingest(
                self.window.keys[:, :count].contiguous(),
                self.window.values[:, :count].contiguous(),
                self.window.pos[:count].expand(h, -1).contiguous(),
                scores=scores,
            )
        self.window.drop(count)
        self.middle = self.compressor.entries()

    # -- reads --------------------------------------------------------------------
    def attend(self, query: Tensor, scale: float, new_tokens: int) -> Tensor:
        m = self.middle
        segments = []
        if self.sink_keys.shape[1]:
            segments.append((self.sink_keys, self.sink_values, None, None))
        exact_middle = False
        if m.length:
            exact_middle = not self.compressor.split_weights and not bool(m.log_num.any())
            if exact_middle:
                segments.append((m.keys, m.values, None, None))
            else:
                segments.append((m.keys, m.values, m.log_num, m.log_den))
        segments.append((self.window.keys, self.window.values, None, None))
        # The sinks may hold this step's tokens too (the first tokens of a session);
        # the causal mask only covers the window, so those cases use the reference path.
        causal_ok = self.window.keys.shape[1] >= new_tokens
        want_mass = self.compressor.needs_attention
        split = self.compressor.split_weights and m.length > 0
        if new_tokens > 1 and not split and (not want_mass or (causal_ok and self.mass_stride > 1)):
            out = self._attend_fused(query, scale, new_tokens)
            if want_mass:
                # Score-based methods: outputs from the fused kernel, attention mass from
                # every `mass_stride`-th query of the chunk (docs/BENCHMARKS.md measures how
                # much that changes what they keep).
                self._observe(sampled_mass(query, segments, scale, self.mass_stride))
            return out
        if new_tokens == 1 and not want_mass and not split and self.fused_decode:
            return fused_segment_attention(query, segments, scale)
        if not causal_ok:
            return self._attend_concat(query, scale, new_tokens)
        out, mass = segment_attention(query, segments, scale, causal_last=True, split=split, want_mass=want_mass)
        if mass is not None:
            self._observe(mass)
        return out

    def _observe(self, mass: list[Tensor]) -> None:
        """Hand attention mass per segment ([sinks], [middle], window) to the score keepers."""
        start = time.perf_counter()
        with one_thread():
            if self.middle.length:
                self.compressor.observe(mass[-2])
            self.window.scores.add_(mass[-1])
        self.observe_seconds += time.perf_counter() - start

    def _attend_fused(self, query: Tensor, scale: float, new_tokens: int) -> Tensor:
        """Prefill chunks with one weight per entry (a == b): PyTorch's fused SDPA over
        the concatenated parts; the chunk's tokens are the last entries (causal among
        them), middle log-weights become an additive bias."""
        m = self.middle
        keys = torch.cat([self.sink_keys, m.keys, self.window.keys], 1)[None]
        values = torch.cat([self.sink_values, m.values, self.window.values], 1)[None]
        n, length = keys.shape[2], new_tokens
        visible = torch.ones(length, n, dtype=torch.bool, device=keys.device)
        visible[:, n - length :] = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
        mask: Tensor = visible
        if m.length and bool(m.log_num.any()):
            s = self.sink_keys.shape[1]
            bias = torch.zeros(self.spec.num_kv_heads, n, device=keys.device)
            bias[:, s : s + m.length] = m.log_num
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
        segment = [(keys, values, None, None)]
        if new_tokens > 1 and self.mass_stride > 1 and not self.compressor.split_weights:
            # As for every later chunk: outputs from the fused kernel (the same numbers
            # every method computes here, so a shared prefill forks to any method
            # unchanged), mass from every `mass_stride`-th query; the chunk's tokens are
            # the last entries of the one segment, as `sampled_mass` needs.
            out = self._attend_fused(query, scale, new_tokens)
            mass = sampled_mass(query, segment, scale, self.mass_stride) if self.compressor.needs_attention else None
        else:
            out, mass = segment_attention(
                query, segment, scale, causal_last=True, split=False, want_mass=self.compressor.needs_attention,
            )
        if mass is not None:
            start = time.perf_counter()
            s, n_mid = self.sink_keys.shape[1], m.length
            if n_mid:
                self.compressor.observe(mass[0][..., s : s + n_mid])
            self.window.scores.add_(mass[0][..., s + n_mid :])
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

    def entry_count(self) -> int:
        """Entries per KV head (largest head), padding excluded."""
        m = self.middle
        finite = torch.isfinite(m.log_num) | torch.isfinite(m.log_den)
        mid = int(finite.sum(1).max()) if m.length else 0
        return self.sink_keys.shape[1] + mid + self.window.keys.shape[1]

    def nbytes(self) -> int:
        return tensor_bytes(
            self.sink_keys, self.sink_values, self.sink_pos, self.window.keys, self.window.values,
            self.window.pos, self.window.scores,
        ) + self.compressor.nbytes()

    # -- state --------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        state: StateDict = {
            "sink_keys": self.sink_keys, "sink_values": self.sink_values, "sink_pos": self.sink_pos,
            # Copies: the window buffers keep changing in place.
            "win_keys": self.window.keys.clone(), "win_values": self.window.values.clone(), "win_pos": self.window.pos.clone(),
        }
        if self.window.scores is not None:
            state["win_scores"] = self.window.scores.clone()
        if self.origin_pos is not None:
            state["origin_pos"], state["origin_tok"] = self.origin_pos, self.origin_tok
        for key, value in self.compressor.state_dict().items():
            state[f"compressor.{key}"] = value
        return state

    def load_state_dict(self, state: StateDict) -> None:
        dev = self.spec.device
        self.sink_keys = state["sink_keys"].to(dev)
        self.sink_values = state["sink_values"].to(dev)
        self.sink_pos = state["sink_pos"].to(dev)
        self.window = WindowBuffer(state["win_keys"].to(dev), state["win_values"].to(dev), state["win_pos"].to(dev))
        self._reset_scores()
        if self.window.scores is not None and "win_scores" in state:
            self.window.set_scores(state["win_scores"].to(dev))
        # Snapshots from before origin tracking hold none: positions then read as tokens.
        self.origin_pos = state["origin_pos"].cpu() if "origin_pos" in state else None
        self.origin_tok = state["origin_tok"].cpu() if "origin_tok" in state else None
        inner = {
            k.removeprefix("compressor."): (v.to(dev) if isinstance(v, Tensor) and v.dtype != torch.uint8 else v)
            for k, v in state.items()
            if k.startswith("compressor.")
        }
        self.compressor.load_state_dict(inner)
        self.middle = self.compressor.entries()


class CompressedCache(Cache):
    """All layers of one session's cache, plus the session's position counter."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        group_size: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        inv_freq: Tensor,
        max_positions: int,
        method: str = DEFAULT_METHOD,
        budget: Budget | str | int = DEFAULT_BUDGET,
        window: int = DEFAULT_WINDOW,
        sinks: int = DEFAULT_SINKS,
        batch: int = DEFAULT_BATCH,
        params: dict[str, Any] | None = None,
        seed: int = 0,
        layer_params: Callable[[str, int], dict[str, Any]] | None = None,
        layer_weights: list[float] | None = None,
    ) -> None:
        """`layer_weights`: how much middle each layer needs (`kvchat.allocate`), used to
        share a byte budget across layers; None shares it evenly."""
        self.budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        self.window = int(window)
        self.sinks = int(sinks)
        self.batch = max(1, int(batch))
        self.method = method
        self.params = dict(params or {})
        self.seed = seed
        self.inv_freq = inv_freq
        self.max_positions = int(max_positions)
        self.layer_params = layer_params
        self.layer_weights = None if layer_weights is None else [float(w) for w in layer_weights]
        self._exact_bytes: dict[str, tuple[float, float]] = {}
        self.specs = [
            LayerSpec(i, num_kv_heads, group_size, head_dim, device, dtype, seed) for i in range(num_layers)
        ]
        self._allocate()
        self.tokens_seen = 0  # tokens ever absorbed (never decreases)
        self.next_position = 0  # position of the next token (compaction lowers it)
        self.compactions = 0
        # Position -> token index (the memory map): positions at or past the boundary
        # stand for token `position + shift`; sinks keep theirs; compacted middle
        # positions below the boundary are looked up in each layer's origin table.
        self.origin_boundary = 0
        self.origin_shift = 0
        self.defer_eviction = False  # exact-then-compress prefill holds tokens in the window
        self._settle_seconds = 0.0
        self._new_tokens = 0
        self._layers = [CompressedLayer(spec, self._make_compressor(spec), self.sinks) for spec in self.specs]
        super().__init__(layers=[])  # the parent's layer list is unused: we keep our own

    @classmethod
    def for_model(cls, loaded, **kwargs: Any) -> CompressedCache:
        """A cache shaped for a `kvchat.models.LoadedModel`."""
        return cls(
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            group_size=loaded.num_heads // loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            device=loaded.device,
            dtype=loaded.dtype,
            inv_freq=loaded.model.model.rotary_emb.inv_freq.detach().float().cpu(),
            max_positions=loaded.max_positions,
            **kwargs,
        )

    def _params_for(self, spec: LayerSpec) -> dict[str, Any]:
        # Per-layer calibrated parameters first; what the user gave explicitly wins.
        params = {} if self.layer_params is None else dict(self.layer_params(self.method, spec.layer))
        params.update(self.params)
        return params

    def _make_compressor(self, spec: LayerSpec) -> Compressor:
        middles, _ = self.targets(max(self.tokens_seen, 1))
        return compress.make(self.method, spec, middles[spec.layer], **self._params_for(spec))

    # -- budgets in bytes -------------------------------------------------------------
    def _allocate(self) -> None:
        """For a byte budget: each layer's middle entries, the window and each layer's
        share of the bytes (docs/design.md, "Budgets"). Sinks and window cost what the
        layer layout measures; a middle entry costs what the method's compressor
        measures (`allocate.middle_cost`); the bytes left after every layer's sinks,
        window and fixed state go to the middles, evenly or by `layer_weights`."""
        self._layer_budgets: list[int] | None = None
        self._layer_allowance: list[int] = []
        self._byte_window = self.window
        if not self.budget.in_bytes:
            return
        cls = compress.get(self.method)
        if not cls.bounded:
            # `full` keeps every token whatever its budget: the budget is a cap that
            # `ChatSession.check_fits` holds it to, turn by turn.
            self._layer_budgets = [0] * len(self.specs)
            return
        sink_bytes, window_bytes = self._exact_token_bytes()
        costs = [allocate.middle_cost(self.method, self._params_for(spec), spec) for spec in self.specs]
        total, layers = int(self.budget.value), len(self.specs)
        if not cls.keeps_middle:
            # The whole budget is window, the same length in every layer.
            fixed = max(self.sinks * sink_bytes + cost.base for cost in costs)
            self._byte_window = math.floor((total / layers - fixed) / window_bytes)
            if self._byte_window < 1:
                minimum = layers * (fixed + window_bytes)
                raise ValueError(
                    f"budget {self.budget} is below the {_megabytes(minimum)} that {self.sinks} sinks and a window of "
                    f"one token take in the {layers} layers of this model; raise --budget or lower --sinks"
                )
            self._layer_budgets = [0] * layers
            self._layer_allowance = [math.floor(fixed + self._byte_window * window_bytes)] * layers
            return
        fixed = [math.ceil(self.sinks * sink_bytes + self.window * window_bytes) + cost.base for cost in costs]
        available = total - sum(fixed)
        if available < 0:
            raise ValueError(
                f"budget {self.budget} is below the {_megabytes(sum(fixed))} that {self.sinks} sinks and a window of "
                f"{self.window} take in the {layers} layers of this model; raise --budget or lower --window"
            )
        self._layer_budgets = allocate.split_middle(available, costs, self.layer_weights)
        self._layer_allowance = [f + cost.bytes_at(b) for f, cost, b in zip(fixed, costs, self._layer_budgets)]

    def _exact_token_bytes(self) -> tuple[float, float]:
        """Bytes one sink token and one window token cost a layer (keys, values,
        positions and, for score-based methods, the window's attention mass), measured
        on a scratch layer of this method."""
        if self.method in self._exact_bytes:
            return self._exact_bytes[self.method]
        spec, count = self.specs[0], 4
        layer = CompressedLayer(spec, compress.make(self.method, spec, 0, **self._params_for(spec)), count)
        h, d = spec.num_kv_heads, spec.head_dim
        tokens = torch.zeros(h, count, d, device=spec.device, dtype=spec.dtype)
        sizes = [layer.nbytes()]
        for first in (0, count):  # the first `count` tokens fill the sinks, the next the window
            layer.append(tokens, tokens, torch.arange(first, first + count, device=spec.device))
            sizes.append(layer.nbytes())
        self._exact_bytes[self.method] = (sizes[1] - sizes[0]) / count, (sizes[2] - sizes[1]) / count
        return self._exact_bytes[self.method]

    def targets(self, tokens_seen: int) -> tuple[list[int], int]:
        """(middle entries per layer, window) for the tokens seen so far."""
        if self._layer_budgets is not None:
            return list(self._layer_budgets), self._byte_window
        keeps_middle = compress.get(self.method).keeps_middle
        middle, window = self.budget.split(tokens_seen, self.sinks, self.window, keeps_middle)
        return [middle] * len(self.specs), window

    def layer_budgets(self) -> list[int]:
        """Middle entries each layer's compressor may keep now (for `full`, which has no
        limit, the entries it holds)."""
        if not compress.get(self.method).bounded:
            return [len(layer.compressor) for layer in self._layers]
        return [layer.compressor.budget for layer in self._layers]

    def layer_nbytes(self) -> list[int]:
        """Bytes each layer holds now (sinks, window and middle, as `nbytes` counts)."""
        return [layer.nbytes() for layer in self._layers]

    def budget_bytes(self) -> int | None:
        """The byte budget, or None when the budget is not in bytes."""
        return int(self.budget.value) if self.budget.in_bytes else None

    def token_bytes(self) -> int:
        """Bytes one more exact token costs all layers at most (in the window, or in a
        middle that keeps every token): what an exact prefill or `full` adds per token."""
        spec = self.specs[0]
        _, window_bytes = self._exact_token_bytes()
        cost = allocate.middle_cost(self.method, self._params_for(spec), spec)
        per_entry = cost.per_entry if not cost.bounded else 0.0
        return math.ceil(len(self.specs) * max(window_bytes, per_entry))

    def _hold_to_budget(self) -> None:
        """After a settle under a byte budget: if the cache holds more than the budget
        (a compressor's state grew past what the probe measured), lower the budget of
        each layer over its share and refit it now. Lowered budgets stay lowered (they
        are part of the snapshot)."""
        limit = int(self.budget.value)
        for _ in range(8):
            if self.nbytes() <= limit:
                return
            for i, layer in enumerate(self._layers):
                over = layer.nbytes() - self._layer_allowance[i]
                budget = self._layer_budgets[i]
                if over <= 0 or budget == 0:
                    continue
                held = max(layer.compressor.nbytes(), 1)
                self._layer_budgets[i] = max(0, min(budget - 1, math.floor(budget * (held - over) / held)))
                layer.compressor.budget = self._layer_budgets[i]
                layer.refit()

    @property
    def mass_stride(self) -> int:
        """Score-based methods' prefill mass: every n-th query of a chunk (1 = exact)."""
        return self._layers[0].mass_stride

    @mass_stride.setter
    def mass_stride(self, stride: int) -> None:
        for layer in self._layers:
            layer.mass_stride = max(1, int(stride))

    @property
    def compress_seconds(self) -> float:
        """Time spent inside compressors: ingesting window overflow, and observing
        attention for score-based methods (bench)."""
        return self._settle_seconds + sum(layer.observe_seconds for layer in self._layers)

    # -- transformers Cache API ---------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        layer = self._layers[layer_idx]
        length = key_states.shape[2]
        positions = torch.arange(self.next_position, self.next_position + length, device=key_states.device)
        layer.append(key_states[0], value_states[0], positions)
        if layer_idx == len(self._layers) - 1:
            self.next_position += length
            self.tokens_seen += length
        self._new_tokens = length
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layers[layer_idx].entry_count()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self._layers)

    # -- kvchat ---------------------------------------------------------------------
    def attend(self, layer_idx: int, query: Tensor, scale: float) -> Tensor:
        return self._layers[layer_idx].attend(query, scale, self._new_tokens)

    def positions_for(self, length: int) -> Tensor:
        """Position ids for the next `length` tokens; compacts first if they would pass
        the model's trained context."""
        if self.next_position + length > self.max_positions:
            self.compact_positions()
            if self.next_position + length > self.max_positions:
                raise ValueError(
                    f"{length} new tokens do not fit the model's {self.max_positions} positions "
                    f"after compaction; feed them in smaller chunks"
                )
        return torch.arange(self.next_position, self.next_position + length)[None]

    def settle(self) -> None:
        """After a forward pass: stream window overflow into the compressors."""
        if self.defer_eviction:
            return

        cls = type(self._layers[0].compressor)
        middles, window = self.targets(self.tokens_seen)
        batch = self.batch if cls.keeps_middle else 1
        start = time.perf_counter()
        for layer, middle in zip(self._layers, middles):
            layer.compressor.budget = middle
            over = layer.window.keys.shape[1] - window
            if over > 0:
                layer.evict(max(over, min(batch, layer.window.keys.shape[1])))
        if self.budget.in_bytes and cls.bounded:
            self._hold_to_budget()
        self._settle_seconds += time.perf_counter() - start

    def compact_positions(self) -> None:
        """Re-rotate every cached key so entries occupy contiguous positions in order
        (docs/design.md, "Positions"): sinks keep theirs, each head's middle is packed and
        right-aligned against the window, the window follows, the counter continues."""
        # One line of positions for all layers: the next token gets one position in every
        # layer, so every layer's window must start at the same place (middles may differ
        # in size between layers).
        widest = max(layer.entry_count() - layer.sink_pos.numel() - layer.window.pos.numel() for layer in self._layers)
        window_start = self._layers[-1].window.pos
        win_old_all = int(window_start[0]) if window_start.numel() else self.next_position
        for layer in self._layers:
            m = layer.middle
            h = self.specs[0].num_kv_heads
            s = layer.sink_pos.numel()
            finite = torch.isfinite(m.log_num) | torch.isfinite(m.log_den)
            counts = finite.sum(1) if m.length else torch.zeros(h, dtype=torch.long)
            # Sorted finite positions per head (padding pushed to the end with +inf-like).
            big = torch.iinfo(torch.long).max
            sorted_pos = torch.where(finite, m.positions, torch.full_like(m.positions, big)).sort(1).values
            win_old = int(layer.window.pos[0]) if layer.window.pos.numel() else self.next_position
            base = s + (widest - counts)  # per head: right-align the middle

            def reposition(keys: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
                # Sinks keep their positions; window tokens shift as a block; a middle
                # entry takes its rank among this head's middle (works for positions
                # that are not entries too, e.g. cluster representatives).
                new = positions.clone()
                in_window = positions >= win_old
                new[in_window] = positions[in_window] - win_old + s + widest
                in_middle = (positions >= s) & ~in_window
                if in_middle.any():
                    rank = torch.searchsorted(sorted_pos.contiguous(), positions.contiguous())
                    new = torch.where(in_middle, base[:, None] + rank, new)
                return rerotate(keys, (new - positions).to(keys.device), self.inv_freq), new

            self._record_origins(layer, sorted_pos, counts, base)
            layer.compressor.reposition(reposition)
            layer.middle = layer.compressor.entries()
            if len(layer.window):
                window = layer.window
                keys, new = reposition(window.keys, window.pos.expand(h, -1))
                # New tensors, not writes into the old ones (those may be a caller's state dict).
                layer.window = WindowBuffer(keys, window.values, new[0].clone(), window.scores)
        s = self.sink_limit_used()
        self.origin_shift += win_old_all - (s + widest)
        self.origin_boundary = s + widest
        last = self._layers[-1]
        self.next_position = int(last.window.pos[-1]) + 1 if last.window.pos.numel() else self.sinks + int(
            max(layer.entry_count() for layer in self._layers)
        )
        self.compactions += 1

    def sink_limit_used(self) -> int:
        """Sink positions taken (every layer holds the same sinks)."""
        return int(self._layers[0].sink_pos.numel())

    def _record_origins(self, layer: CompressedLayer, sorted_pos: Tensor, counts: Tensor, base: Tensor) -> None:
        """Before a compaction moves this layer's middle: remember, for each new middle
        position (base + rank, per head), the token the old position stood for."""
        big = torch.iinfo(torch.long).max
        real = sorted_pos != big
        old = torch.where(real, sorted_pos, torch.zeros_like(sorted_pos)).cpu()
        tokens = self.token_index(layer, old)
        rank = torch.arange(sorted_pos.shape[1])[None]
        new = torch.where(real.cpu(), base.cpu()[:, None] + rank, torch.full_like(old, big))
        layer.origin_pos, layer.origin_tok = new, torch.where(real.cpu(), tokens, torch.full_like(tokens, -1))

    def token_index(self, layer: CompressedLayer | int, positions: Tensor) -> Tensor:
        """The token (index into everything the session fed) that each held position
        [H, n] stands for: positions are token indices until the first compaction,
        after which the layer's origin table and the running shift say where they came
        from. A position that is no entry (a cluster representative) reads as the
        entry at or before it."""
        layer = self._layers[layer] if isinstance(layer, int) else layer
        positions = positions.cpu()
        tokens = positions + self.origin_shift
        sinks = positions < self.sink_limit_used()
        tokens = torch.where(sinks, positions, tokens)
        below = ~sinks & (positions < self.origin_boundary)
        if layer.origin_pos is not None and bool(below.any()):
            table = layer.origin_pos.contiguous()
            at = torch.searchsorted(table, positions.contiguous(), right=True) - 1
            looked = torch.gather(layer.origin_tok, 1, at.clamp(0, table.shape[1] - 1))
            tokens = torch.where(below, looked, tokens)
        return tokens

    @torch.inference_mode()
    def memory_map(self, bounds: list[tuple[int, int]]) -> list[list[float]]:
        """For each layer, the share of each token range [start, end) that the cache
        still represents, averaged over KV heads. An entry counts for the tokens it
        stands for (exp of its denominator log-weight: a merged entry its degree, a
        cluster sample its count; numerator-only entries count nothing), credited to
        the range its own token lies in, and a range's share is capped at 1."""
        if not bounds:
            return [[] for _ in self._layers]
        starts = torch.tensor([b[0] for b in bounds], dtype=torch.long)
        lengths = torch.tensor([max(1, b[1] - b[0]) for b in bounds], dtype=torch.float64)
        shares = []
        for layer in self._layers:
            h = layer.spec.num_kv_heads
            parts = [(layer.sink_pos.cpu().expand(h, -1), torch.ones(h, layer.sink_pos.numel(), dtype=torch.float64))]
            m = layer.middle
            if m.length:
                counts = torch.where(torch.isfinite(m.log_den), m.log_den.double().exp(), torch.zeros((), dtype=torch.float64))
                parts.append((m.positions.cpu(), counts.cpu()))
            win = layer.window.pos.cpu()
            parts.append((win.expand(h, -1), torch.ones(h, win.numel(), dtype=torch.float64)))
            held = torch.zeros(h, len(bounds), dtype=torch.float64)
            for positions, counts in parts:
                if positions.numel() == 0:
                    continue
                tokens = self.token_index(layer, positions)
                span = torch.searchsorted(starts, tokens.contiguous(), right=True) - 1
                inside = (span >= 0) & (tokens < torch.tensor([b[1] for b in bounds])[span.clamp(min=0)])
                held.scatter_add_(1, span.clamp(min=0), torch.where(inside, counts, torch.zeros_like(counts)))
            shares.append((held / lengths).clamp(max=1.0).mean(0).tolist())
        return shares

    def layer_entries(self) -> list[int]:
        """Entries per KV head in each layer now (sinks + middle + window, largest head)."""
        return [layer.entry_count() for layer in self._layers]

    def flush(self) -> None:
        """End of an exact-then-compress prefill: compress the held tokens at once."""
        self.defer_eviction = False
        self.settle()

    def switch_method(self, method: str, params: dict[str, Any] | None = None) -> bool:
        """Re-stream every layer's middle into a new compressor: no recompute
        (docs/design.md, "Switching methods"). Each old compressor hands over its real tokens
        (`Compressor.tokens`: true keys/values, each with the count it stands for), in
        position order per head. Returns False, changing nothing, when some layer holds no
        such set or its heads hold different numbers of them (they cannot enter one
        batch without dropping counts): the caller must then rebuild from the transcript."""
        handed: list[Entries | None] = []
        for layer in self._layers:
            tokens = layer.compressor.tokens() if layer.middle.length else None
            if layer.middle.length and tokens is None:
                return False
            if tokens is not None:
                counts = torch.isfinite(tokens.log_den).sum(1)
                if bool((counts != counts[0]).any()):
                    return False
            handed.append(tokens)
        self.method = method
        self.params = dict(params or {})
        self._allocate()  # a byte budget buys a different number of entries per method
        for layer, tokens in zip(self._layers, handed):
            scores = layer.window.scores
            layer.compressor = self._make_compressor(layer.spec)
            layer._reset_scores()
            if layer.window.scores is not None and scores is not None:
                layer.window.set_scores(scores)  # the window's attention belongs to its tokens
            if tokens is not None:
                real = torch.isfinite(tokens.log_den)
                count = int(real.sum(1)[0])
                if count:
                    # Per head: the real tokens, oldest first (padding sorts last).
                    big = torch.iinfo(torch.long).max
                    order = torch.where(real, tokens.positions, big).argsort(1)[:, :count]
                    rows = order[..., None].expand(-1, -1, tokens.keys.shape[2])
                    layer.compressor.ingest(
                        torch.gather(tokens.keys, 1, rows),
                        torch.gather(tokens.values, 1, rows),
                        torch.gather(tokens.positions, 1, order),
                        log_weights=torch.gather(tokens.log_den, 1, order),
                    )
            layer.middle = layer.compressor.entries()
        self.settle()
        return True

    @torch.inference_mode()
    def add_window_scores(self, positions: Tensor, amount: float) -> None:
        """Add attention mass to the window tokens at `positions`, in every layer and head
        (score-based methods only). An ablation hook: the recall bench's oracle row uses it
        to force known tokens into the selection."""
        for layer in self._layers:
            if layer.window.scores is not None:
                hit = torch.isin(layer.window.pos, positions.to(layer.window.pos.device))
                layer.window.scores[..., hit] += amount

    def copy(self) -> CompressedCache:
        """An independent copy (same method, layout, counters and compressor states)."""
        spec = self.specs[0]
        twin = CompressedCache(
            num_layers=len(self.specs), num_kv_heads=spec.num_kv_heads, group_size=spec.group_size,
            head_dim=spec.head_dim, device=spec.device, dtype=spec.dtype, inv_freq=self.inv_freq,
            max_positions=self.max_positions, method=self.method, budget=self.budget, window=self.window,
            sinks=self.sinks, batch=self.batch, params=self.params, seed=self.seed, layer_params=self.layer_params,
            layer_weights=self.layer_weights,
        )
        states = [
            {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()} for state in self.layer_states()
        ]
        twin.load_layer_states(self.meta(), states)
        twin.defer_eviction = self.defer_eviction
        twin._settle_seconds = self.compress_seconds
        return twin

    # -- accounting -------------------------------------------------------------------
    def nbytes(self) -> int:
        """Exact bytes of every entry the cache holds (the window buffers' spare room,
        at most WINDOW_SLACK slots per layer, is not counted)."""
        return sum(layer.nbytes() for layer in self._layers)

    def entries_per_head(self) -> int:
        return max((layer.entry_count() for layer in self._layers), default=0)

    def full_cache_bytes(self) -> int:
        """What an exact cache of every token seen would take (keys + values)."""
        spec = self.specs[0]
        elem = torch.empty(0, dtype=spec.dtype).element_size()
        return self.tokens_seen * 2 * len(self._layers) * spec.num_kv_heads * spec.head_dim * elem

    # -- persistence --------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "method": self.method, "params": self.params, "budget": str(self.budget), "window": self.window,
            "sinks": self.sinks, "batch": self.batch, "seed": self.seed, "tokens_seen": self.tokens_seen,
            "next_position": self.next_position, "compactions": self.compactions,
            "origin_boundary": self.origin_boundary, "origin_shift": self.origin_shift,
            **({} if self._layer_budgets is None else {"layer_budgets": list(self._layer_budgets)}),
        }

    def layer_states(self) -> list[StateDict]:
        return [layer.state_dict() for layer in self._layers]

    def load_layer_states(self, meta: dict[str, Any], states: list[StateDict]) -> None:
        if len(states) != len(self._layers):
            raise ValueError(f"snapshot has {len(states)} layers, the model has {len(self._layers)}")
        self.tokens_seen = int(meta["tokens_seen"])
        self.next_position = int(meta["next_position"])
        self.compactions = int(meta.get("compactions", 0))
        self.origin_boundary = int(meta.get("origin_boundary", 0))
        self.origin_shift = int(meta.get("origin_shift", 0))
        saved = meta.get("layer_budgets")
        if self._layer_budgets is not None and saved is not None and len(saved) == len(self._layers):
            # The allocation as it was (lowered budgets included), not a new one.
            self._layer_budgets = [int(b) for b in saved]
        for layer, state in zip(self._layers, states):
            layer.load_state_dict(state)
        if self._layer_budgets is not None and compress.get(self.method).bounded:
            for layer, budget in zip(self._layers, self._layer_budgets):
                layer.compressor.budget = budget
