"""The compressed KV cache: per layer, exact sinks + a compressed middle + an exact window.

A transformers `Cache` subclass. The model's attention layers call `update` with the new
keys/values of a forward pass, then kvchat's registered attention function calls
`attend`, which reads the three parts as segments (nothing is concatenated per step).
After each forward pass the engine calls `settle`: tokens beyond the window stream into
the layer's compressor in batches of at least `batch` tokens, so compression cost is
amortised. Positions come from the session's own counter (never the cache length); when
the next position would pass the model's trained context, `compact_positions` re-rotates
every cached key so entries take contiguous positions again.

This module is the `Cache` protocol and the session-wide state (counters, method,
switching, snapshots); the rest lives beside it, one seam per module:

- `kvchat.cache.layer`: one layer (sinks, middle, window) and its attention paths;
  `kvchat.cache.window_buffer`: a layer's window buffer.
- `kvchat.cache.budget`: how the budget becomes each layer's middle budget and window
  (`targets`), and the byte budget's bookkeeping.
- `kvchat.cache.positions`: compaction, re-rotation and which token a position stands for
  (the memory map).
- `kvchat.recall.tier`: with `recall` set, each layer's recall tier (every cold token exact on
  disk, a 4-bit key index in RAM, the best cold tokens attended at every forward pass).

The cache never reaches the model or the disk: per-layer weights and calibrated
parameters come in from the engine (`layer_weights`, `layer_params`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvchat import compress
from kvchat.cache import budget as allocate
from kvchat.cache import positions
from kvchat.cache.layer import CompressedLayer
from kvchat.compress.base import Compressor, LayerSpec
from kvchat.kv_types import Entries, LayerGeometry, StateDict
from kvchat.recall.cold_store import Segment
from kvchat.recall.key_index import ranking_channels
from kvchat.recall.tier import RECALL_EVERY, RecallPins, RecallTier
from kvchat.runtime import SMALL_INGEST, one_thread
from kvchat.settings import DEFAULT_BATCH, DEFAULT_BUDGET, DEFAULT_METHOD, DEFAULT_SINKS, DEFAULT_WINDOW, Budget


def _evict_all(evictions: list[tuple[Any, int]]) -> None:
    """`layer.evict(count)` for each pair. A flush (every layer hands its compressor more
    than SMALL_INGEST tokens: the end of an exact-then-compress prefill) runs the layers
    side by side, one per torch thread, each on one thread: the layers' compressors share nothing,
    and a selection like bumblebee's greedy is a long run of small steps that one core
    runs as fast as two. A layer's result is the same as when the layers run in turn on
    one thread."""
    # (A decode step's eviction is small: it goes in turn without asking torch for threads.)
    small = len(evictions) < 2 or any(count <= SMALL_INGEST for _, count in evictions)
    workers = 1 if small else min(torch.get_num_threads(), len(evictions))
    if workers < 2:
        for layer, count in evictions:
            layer.evict(count)
        return
    with one_thread(), ThreadPoolExecutor(workers, thread_name_prefix="kvchat-flush") as pool:
        for done in [pool.submit(layer.evict, count) for layer, count in evictions]:
            done.result()  # (raises what a layer raised)


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
        geometry: Sequence[LayerGeometry],
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
        recall: int = 0,
        recall_dir: str | None = None,
        recall_layers: Collection[int] | None = None,
        fit_window: bool = False,
    ) -> None:
        """`layer_weights`: how much middle each layer needs (measured by
        `kvchat.calibration.calibrate.layer_weights`), used to share a byte budget across layers;
        None shares it evenly. `layer_params(method, layer)`: per-layer calibrated
        parameters of a method (the engine's `calibrated_params`). `recall`: cold tokens
        recalled per KV head at every forward pass (0: no recall tier, `kvchat.recall.tier`);
        `recall_dir`: the folder of the tier's files (None: the system's temp folder);
        `recall_layers`: the layers whose tier recalls (None: every layer; the engine's
        are measured, `kvchat.calibration.calibrate.recall_layers`): the others keep no cold tokens
        and attend as without recall.
        `fit_window`: a byte budget may shrink the window (`allocate.plan`).
        `geometry`: each layer's RoPE, sliding window and soft-capping, as the model
        family's adapter reads them (`kvchat.model.families`)."""
        if len(geometry) != num_layers:
            raise ValueError(f"geometry for {len(geometry)} layers, the cache has {num_layers}")
        self.budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        self.window = int(window)
        self.fit_window = bool(fit_window)
        self.sinks = int(sinks)
        self.batch = max(1, int(batch))
        self.method = method
        self.params = dict(params or {})
        self.seed = seed
        self.geometry = list(geometry)
        self.max_positions = int(max_positions)
        self.layer_params = layer_params
        self.layer_weights = None if layer_weights is None else [float(w) for w in layer_weights]
        if recall < 0:
            raise ValueError("recall must be 0 (off) or a number of tokens")
        self.recall = int(recall)
        self.recall_dir = recall_dir
        self.recall_layers = None if recall_layers is None else tuple(sorted({int(i) for i in recall_layers}))
        self._recall_every = RECALL_EVERY  # decode passes a recalled selection serves
        # The last answer's recall, for the metrics and the memory map (`end_recall_log`):
        # (decode steps, rows per KV head and step per layer, the tokens some layer
        # recalled, in how many layers each).
        self.recall_log: tuple[int, list[float], Tensor, Tensor] | None = None
        self._recall_from = 0
        self.pins = RecallPins()  # tokens every recalling layer attends until the next chunk
        # Whether this session passes the trained context, so that recalled rows are laid
        # out before the window (`expect`, `RecallTier._place`).
        self.long_context = False
        self.specs = [LayerSpec(i, num_kv_heads, group_size, head_dim, device, dtype, seed) for i in range(num_layers)]
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
        self._layers = [
            CompressedLayer(spec, self._make_compressor(spec), self.sinks, self._make_recall(spec), shape)
            for spec, shape in zip(self.specs, self.geometry)
        ]
        super().__init__(layers=[])  # the parent's layer list is unused: we keep our own

    @property
    def compressed_layers(self) -> Sequence[CompressedLayer]:
        """Every layer's compressed cache, in model order. (Not `layers`: transformers'
        `Cache` keeps its own list under that name, which kvchat leaves empty.)"""
        return tuple(self._layers)

    @classmethod
    def for_model(cls, loaded, **kwargs: Any) -> CompressedCache:
        """A cache shaped for a `kvchat.model.loading.LoadedModel`."""
        return cls(
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            group_size=loaded.num_heads // loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            device=loaded.device,
            dtype=loaded.dtype,
            geometry=loaded.geometry,
            max_positions=loaded.max_positions,
            **kwargs,
        )

    def _params_for(self, spec: LayerSpec) -> dict[str, Any]:
        # Per-layer calibrated parameters first; what the user gave explicitly wins.
        params = {} if self.layer_params is None else dict(self.layer_params(self.method, spec.layer))
        params.update(self.params)
        return params

    def _make_recall(self, spec: LayerSpec) -> RecallTier | None:
        shape = self.geometry[spec.layer]
        if not self.recall or shape.sliding_window is not None:
            return None  # a sliding-window layer never sees a token its window dropped
        # Ranking reads the slowest-turning pairs; without RoPE on every channel, all of them.
        turns = shape.inv_freq
        channels = ranking_channels(turns) if turns is not None and shape.rotary_dim == spec.head_dim else None
        return RecallTier(
            heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            device=spec.device,
            recall=self.recall,
            folder=self.recall_dir,
            channels=channels,
            every=self._recall_every,
            ranks=self.recall_layers is None or spec.layer in self.recall_layers,
            inv_freq=turns,
            pins=self.pins,
        )

    @property
    def recall_every(self) -> int:
        """Decode passes one recalled selection serves (`RecallTier.every`); an ablation
        hook of the recall benches, as `mass_stride` is of the prefill's."""
        return self._recall_every

    @recall_every.setter
    def recall_every(self, passes: int) -> None:
        self._recall_every = int(passes)
        for layer in self._layers:
            if layer.recall is not None:
                layer.recall.every = passes

    def _make_compressor(self, spec: LayerSpec) -> Compressor:
        middles, _ = self.targets(max(self.tokens_seen, 1))
        return compress.make(self.method, spec, middles[spec.layer], **self._params_for(spec))

    # -- the budget (kvchat/cache/budget.py) ------------------------------------------------
    def _allocate(self) -> None:
        """Plan what the budget gives each layer under the current method (again after a
        switch: a byte budget buys a different number of entries per method)."""
        self.allocation = allocate.plan(
            self.budget,
            self.method,
            self.specs,
            sinks=self.sinks,
            window=self.window,
            params_for=self._params_for,
            weights=self.layer_weights,
            fit_window=self.fit_window,
            sliding=[shape.sliding_window for shape in self.geometry],
        )

    def targets(self, tokens_seen: int) -> tuple[list[int], int]:
        """(middle entries per layer, window) for the tokens seen so far."""
        return self.allocation.targets(tokens_seen)

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
        """Bytes one more exact token costs all layers at most (`allocate.token_bytes`)."""
        spec = self.specs[0]
        return allocate.token_bytes(self.method, self._params_for(spec), spec, len(self.specs))

    def index_bytes_per_token(self, compacted: bool | None = None) -> int:
        """RAM one more cold token costs the recall tiers of every layer (0 with recall
        off; `RecallTier.bytes_per_row`): what a byte budget must leave the index."""
        return sum(layer.recall.bytes_per_row(compacted) for layer in self._layers if layer.recall is not None)

    def recall_fixed_bytes(self) -> int:
        """RAM the recall tiers of every layer hold whatever their rows (0 with recall
        off; `RecallTier.fixed_bytes`)."""
        return sum(layer.recall.fixed_bytes() for layer in self._layers if layer.recall is not None)

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
        if layer_idx == 0:
            self.pins.start_pass(length)
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

    def expect(self, tokens: int) -> None:
        """`tokens` more are about to be fed (a turn's prompt): if they take the session
        past the model's trained context, recalled rows are laid out before the window
        from now on (`RecallTier._place`), the whole prompt included. A session that
        stays inside the context attends every recalled row where its token is."""
        if not self.long_context and self.next_position + tokens > self.max_positions:
            self.long_context = True
            self._bind_recall()

    def settle(self) -> None:
        """After a forward pass: stream window overflow into the compressors."""
        if self.defer_eviction:
            return

        cls = type(self._layers[0].compressor)
        middles, window = self.targets(self.tokens_seen)
        batch = self.batch if cls.keeps_middle else 1
        start = time.perf_counter()
        evictions = []
        for layer, middle in zip(self._layers, middles):
            if layer.sliding_window is not None:
                # A byte budget planned its tokens; else what every other layer may hold:
                # sinks, its middle budget and the window.
                planned = self.allocation.sliding_keep[layer.spec.layer] if self.allocation.sliding_keep else None
                allowance = planned or (self.sinks + middle + window if cls.bounded else self.tokens_seen)
                layer.evict(len(layer.window) - layer.sliding_keep(allowance))
                continue
            layer.compressor.budget = middle
            over = layer.window.keys.shape[1] - window
            if over > 0:
                evictions.append((layer, max(over, min(batch, layer.window.keys.shape[1]))))
        _evict_all(evictions)
        if self.budget.in_bytes and cls.bounded:
            allocate.hold_to_budget(self._layers, self.allocation)
        self._settle_seconds += time.perf_counter() - start

    # -- positions (kvchat/cache/positions.py) ---------------------------------------------
    def compact_positions(self) -> None:
        """Re-rotate every cached key so entries occupy contiguous positions in order
        (docs/design.md, "Positions and compaction"): sinks keep theirs, each head's middle
        is packed and right-aligned against the window, the window follows, the counter
        continues."""
        self.next_position, self.origin_boundary, self.origin_shift = positions.compact(
            self._layers,
            next_position=self.next_position,
            sinks=self.sinks,
            boundary=self.origin_boundary,
            shift=self.origin_shift,
        )
        self.compactions += 1
        self.long_context = True
        self._bind_recall()  # the tiers were re-rotated with the hot cache (positions.compact)

    def _bind_recall(self) -> None:
        """Tell each recall tier how this cache's positions read as tokens: the shift of
        new positions and, after a compaction, the lookup of middle positions (through a
        weak reference: a tier must not keep its cache, and so its files, alive)."""
        ref = weakref.ref(self)

        def reader(layer: CompressedLayer) -> Callable[[Tensor], Tensor]:
            def token_of(held: Tensor) -> Tensor:
                cache = ref()
                assert cache is not None, "a recall tier outlived its cache"
                return cache.token_index(layer, held)

            return token_of

        for layer in self._layers:
            if layer.recall is not None:
                layer.recall.pins = self.pins
                layer.recall.lay_out = self.long_context
                layer.recall.shift = self.origin_shift
                layer.recall.token_of = reader(layer) if self.compactions else None

    def sink_limit_used(self) -> int:
        """Sink positions taken (every layer holds the same sinks)."""
        return positions.sinks_used(self._layers)

    def token_index(self, layer: CompressedLayer | int, held: Tensor) -> Tensor:
        """The token (index into everything the session fed) that each held position
        [H, n] stands for (`positions.token_index`)."""
        layer = self._layers[layer] if isinstance(layer, int) else layer
        return positions.token_index(
            layer, held, sinks=self.sink_limit_used(), boundary=self.origin_boundary, shift=self.origin_shift
        )

    def memory_map(self, bounds: list[tuple[int, int]]) -> list[list[float]]:
        """For each layer, the share of each token range [start, end) that the cache
        still represents, averaged over KV heads (`positions.memory_map`)."""
        return positions.memory_map(self._layers, bounds, self.token_index)

    def layer_windows(self) -> list[int | None]:
        """Per layer, the model's own sliding window (None: the layer sees every earlier
        token); [] when no layer slides."""
        windows = [layer.sliding_window for layer in self._layers]
        return windows if any(w is not None for w in windows) else []

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
        # A method that keeps every token wrote no cold rows while it ran (`layer.evict`):
        # its middle is exactly those tokens, so they go cold now, as they would have.
        goes_cold = not compress.get(self.method).bounded and compress.get(method).bounded
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
                    keys, values = torch.gather(tokens.keys, 1, rows), torch.gather(tokens.values, 1, rows)
                    positions = torch.gather(tokens.positions, 1, order)
                    if goes_cold and layer.recall is not None and not layer.recall.rows:
                        layer.recall.append(keys, values, positions[0])  # (every head holds every token)
                    layer.compressor.ingest(keys, values, positions, log_weights=torch.gather(tokens.log_den, 1, order))
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
            num_layers=len(self.specs),
            num_kv_heads=spec.num_kv_heads,
            group_size=spec.group_size,
            head_dim=spec.head_dim,
            device=spec.device,
            dtype=spec.dtype,
            geometry=self.geometry,
            max_positions=self.max_positions,
            method=self.method,
            budget=self.budget,
            window=self.window,
            sinks=self.sinks,
            batch=self.batch,
            params=self.params,
            seed=self.seed,
            layer_params=self.layer_params,
            layer_weights=self.layer_weights,
            recall=self.recall,
            recall_dir=self.recall_dir,
            recall_layers=self.recall_layers,
            fit_window=self.fit_window,
        )
        states = [
            {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()} for state in self.layer_states()
        ]
        twin.load_layer_states(self.meta(), states)
        for mine, theirs in zip(self._layers, twin._layers):
            if mine.recall is not None:
                # Its own tier: the rows written so far shared read-only, its own file on.
                theirs.recall = mine.recall.fork()
        twin.pins = RecallPins(self.pins.tokens.clone())
        twin.long_context = self.long_context
        twin._bind_recall()
        twin._recall_every = self._recall_every
        twin.defer_eviction = self.defer_eviction
        twin._settle_seconds = self.compress_seconds
        return twin

    # -- accounting -------------------------------------------------------------------
    def nbytes(self) -> int:
        """Exact bytes of every entry the cache holds (the window buffers' spare room,
        at most WINDOW_SLACK slots per layer, is not counted)."""
        return sum(layer.nbytes() for layer in self._layers)

    def cold_bytes(self) -> int:
        """Bytes of exact cold keys and values the recall tiers keep on disk (0 when off);
        their index in RAM is part of `nbytes`."""
        return sum(layer.recall.cold_bytes() for layer in self._layers if layer.recall is not None)

    def recalled(self) -> float:
        """Cold tokens attended per KV head at the last forward pass, averaged over the
        layers that recall (0 when recall is off or nothing was recalled)."""
        # `recalls` is true only where the layer has a tier
        counts = [cast(RecallTier, layer.recall).recalled() for layer in self._layers if layer.recalls]
        return sum(counts) / len(counts) if counts else 0.0

    def start_recall_log(self) -> None:
        """Start logging what the recall tiers attend (an answer's decode steps; the
        tiers only keep a reference per step, see `RecallTier.start_log`)."""
        self._recall_from = self.tokens_seen
        for layer in self._layers:
            if layer.recall is not None:
                layer.recall.start_log()

    def end_recall_log(self) -> float:
        """Stop the log and keep it (`recall_log`, for `recall_report`). Returns the cold
        tokens attended per KV head and step since `start_recall_log`, averaged over the
        layers that recall and the one-token steps (0 when recall is off)."""
        steps = self.tokens_seen - self._recall_from
        means, tokens = [], []
        for layer in self._layers:
            if layer.recall is None:
                continue
            since, held = layer.recall.end_log()
            means.append(since / steps if steps > 0 else 0.0)
            if held.numel():
                tokens.append(held)  # rows are numbered by token already
        if not means:
            return 0.0
        merged = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long)
        self.recall_log = (steps, means, *merged.unique(return_counts=True))
        recalling = self._recalling(means)
        return sum(recalling) / len(recalling) if recalling else 0.0

    def _recalling(self, per_tier: list[float]) -> list[float]:
        """Of figures given per layer with a recall tier, those of the layers that recall."""
        tiers = [layer for layer in self._layers if layer.recall is not None]
        return [value for value, layer in zip(per_tier, tiers) if layer.recalls]

    def recall_report(self, spans: list[tuple[int, int]], cells: list[tuple[int, int]]) -> dict[str, Any]:
        """The recall tier for the memory map: `recall` (tokens per KV head and step; 0:
        off), `cold_bytes` and, once an answer was logged, its `recall_steps`, `recalled`
        and `layer_recalled` (tokens per KV head and step, over layers and per layer) and
        which tokens the layers recalled (`recalled_summary`, for the token ranges
        `spans` and `cells`)."""
        report: dict[str, Any] = {"recall": self.recall, "cold_bytes": self.cold_bytes()}
        if self.recall_log is not None:
            steps, means, tokens, layers = self.recall_log
            recalling = self._recalling(means) or [0.0]
            report.update(
                recall_steps=steps,
                recalled=round(sum(recalling) / len(recalling), 2),
                layer_recalled=[round(m, 2) for m in means],
                **recalled_summary(tokens, layers, len(recalling), spans, cells),
            )
        return report

    # -- the recall tier of a saved session (kvchat/storage/cold.py keeps the rows) ------
    def cold_rows(self) -> list[list[Segment]] | None:
        """Per layer, every cold row as views into the files that hold them, each named by
        its file (`kvchat.recall.cold_store.Segment`; nothing is copied); None when recall is off.
        The tiers' other state (first token, rows, positions) is in `layer_states`."""
        if not self.recall:
            return None
        return [[] if layer.recall is None else layer.recall.segments() for layer in self._layers]

    def release_cold_pages(self) -> None:
        """Unmap the recall tiers' file pages that reads mapped into this process: after a
        prefill chunk, an answer or a save, so that its resident memory does not grow with
        the cold rows it has read (`kvchat.recall.cold_store.ColdFile.release`)."""
        for layer in self._layers:
            if layer.recall is not None:
                layer.recall.release_pages()

    def load_cold(self, feed: Callable[[Callable[[int, Tensor], None]], None]) -> bool:
        """After `load_layer_states`: `feed(sink)` hands the saved rows to `sink(layer,
        rows)` (`RecallTier.load_rows`), in order per layer; each tier takes them into a file of its
        own and rebuilds its index from their keys. True when every tier got exactly the
        rows its state names; otherwise every tier is left empty (as a session saved
        without its tier resumes) and False. Rows that do not fit a tier (shape, dtype)
        raise ValueError, and anything `feed` raises goes through, tiers left empty."""
        tiers = [layer.recall for layer in self._layers]

        def sink(index: int, rows: Tensor) -> None:
            tier = tiers[index] if 0 <= index < len(tiers) else None
            if tier is None:
                raise ValueError(f"saved cold rows for layer {index}, which has no recall tier")
            tier.load_rows(rows)

        try:
            feed(sink)
        except BaseException:
            self.clear_cold()
            raise
        fits = [tier.finish_load() for tier in tiers if tier is not None]
        if not all(fits):
            self.clear_cold()
            return False
        return True

    def clear_cold(self) -> None:
        """Empty every recall tier (a saved tier that could not be read back)."""
        for layer in self._layers:
            if layer.recall is not None:
                layer.recall.load_state({})  # empty, and waiting for no rows

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
            "method": self.method,
            "params": self.params,
            "budget": str(self.budget),
            "window": self.window,
            "sinks": self.sinks,
            "batch": self.batch,
            "seed": self.seed,
            "tokens_seen": self.tokens_seen,
            "next_position": self.next_position,
            "compactions": self.compactions,
            "origin_boundary": self.origin_boundary,
            "origin_shift": self.origin_shift,
            **({"recall_pins": self.pins.tokens.tolist()} if self.pins.tokens.numel() else {}),
            **({"long_context": True} if self.long_context else {}),
            **({} if self.allocation.layer_budgets is None else {"layer_budgets": list(self.allocation.layer_budgets)}),
            # A window the recall index made smaller (`allocate.hold_to_budget`); absent otherwise.
            **({"byte_window": self.allocation.byte_window} if self.allocation.window_lowered else {}),
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
        self.pins = RecallPins(torch.tensor(meta.get("recall_pins", []), dtype=torch.long))
        self.long_context = bool(meta.get("long_context", self.compactions > 0))
        saved = meta.get("layer_budgets")
        if self.allocation.layer_budgets is not None and saved is not None and len(saved) == len(self._layers):
            # The allocation as it was (lowered budgets included), not a new one.
            self.allocation.layer_budgets = [int(b) for b in saved]
        if self.allocation.layer_budgets is not None and "byte_window" in meta:
            self.allocation.lower_window(int(meta["byte_window"]))
        for layer, state in zip(self._layers, states):
            layer.load_state_dict(state)
        self._bind_recall()
        if self.allocation.layer_budgets is not None and compress.get(self.method).bounded:
            for layer, budget in zip(self._layers, self.allocation.layer_budgets):
                layer.compressor.budget = budget


# Runs of recalled tokens the memory map lists (the longest ones).
RECALL_RUNS = 24


def recalled_summary(
    tokens: Tensor,
    layers: Tensor,
    layer_count: int,
    spans: list[tuple[int, int]],
    cells: list[tuple[int, int]],
) -> dict[str, Any]:
    """What the memory map shows of an answer's recalled tokens: `tokens` [n] (ascending
    token indices, none twice) were recalled by some KV head in `layers` [n] of the
    `layer_count` layers. Over every layer, head and step, some layer recalls most cold
    tokens once (measured: 1,230 of about 1,330 cold ones over an 18-token answer), so
    the figures weigh each token by its layers:

    - `recalled_tokens`: how many tokens some layer recalled;
    - `span_recalled`, `cell_recalled`: per span and per cell [start, end), the tokens a
      layer recalled there, on average over the layers (tokens × layers / layer_count);
    - `recalled_runs`: [start, end) runs of consecutive tokens that at least half the
      layers recalled, the longest `RECALL_RUNS`, in order."""
    tokens, weight = tokens.long().cpu(), layers.float().cpu() / max(1, layer_count)
    cumulative = torch.cat([torch.zeros(1), weight.cumsum(0)])

    def share(bounds: list[tuple[int, int]]) -> list[float]:
        if not bounds:
            return []
        starts, ends = torch.tensor(bounds, dtype=torch.long).T.contiguous()
        inside = cumulative[torch.searchsorted(tokens, ends)] - cumulative[torch.searchsorted(tokens, starts)]
        return [round(float(x), 2) for x in inside]

    runs: list[list[int]] = []
    most = tokens[layers * 2 >= layer_count]
    if most.numel():
        breaks = (most[1:] - most[:-1] != 1).nonzero().flatten() + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
        ends = torch.cat([breaks, torch.tensor([most.numel()])])
        runs = [[int(most[a]), int(most[b - 1]) + 1] for a, b in zip(starts.tolist(), ends.tolist())]
        runs = sorted(sorted(runs, key=lambda r: r[0] - r[1])[:RECALL_RUNS])
    return {
        "recalled_tokens": int(tokens.numel()),
        "span_recalled": share(spans),
        "cell_recalled": share(cells),
        "recalled_runs": runs,
    }
