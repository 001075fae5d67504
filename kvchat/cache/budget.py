"""How a budget becomes what each layer keeps, and whether a turn fits: one unit.

`--budget` is given in entries per KV head (`1024`), as a share of the tokens seen
(`25%`) or in bytes (`64MB`, docs/design.md, "Budgets"). Everything that turns it into
per-layer middle budgets and a window, and everything that decides whether a turn can be
fed under it, lives here, as functions over plain numbers, layer specs and the cache's
public accessors (this module never imports `kvchat.cache.compressed_cache`, which calls it):

- **what things cost**: `middle_cost`, what one more middle entry costs a method in
  bytes, *measured* by running the method's compressor on random tokens at two small
  budgets (its auxiliary state, e.g. h2o's scores or bumblebee's neighbour arrays, is
  then counted without the cache knowing any method); `exact_token_bytes`, what a sink
  and a window token cost, measured on a scratch layer. Both memoised per method,
  parameters and layer shape.
- **the plan**: `plan` gives each layer its middle entries, the window and its share of
  the bytes (`split_middle` shares the bytes left after sinks and windows, evenly or by
  per-layer weights); `Allocation.targets` answers the cache on every settle;
  `hold_to_budget` lowers a layer's budget when its compressor grew past what the probe
  measured, and makes room for a recall index (the middles, then a window the budget
  sized).
- **the layer weights' maths**: `error_curve` (how much a layer's attention output
  changes when only the top share of its middle is kept) and `greedy_fractions` (shares
  given out where they lower that error most). Running them on a model, and caching the
  result on disk, is `kvchat.calibration.calibrate`'s job: the cache only ever receives the weights.
- **the fit policy**: `prefill_mode` (whether an exact-then-compress prefill may hold a
  turn whole), `held_fits` and `check_fits` (whether a turn fits the model's positions
  and a byte budget, refused before anything is fed; with recall, whether the index
  after the turn still fits beside the least the hot cache can hold).

Per layer, not per head: a layer's middle is one padded [H, n, d] tensor per part
(`kvchat.kv_types.Entries`), so a head that keeps fewer entries than its neighbours frees
no bytes; only the layer's widest head costs memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from kvchat import compress
from kvchat.cache.layer import CompressedLayer
from kvchat.compress.base import LayerSpec
from kvchat.errors import InputTooLong
from kvchat.settings import Budget

# The probe: budgets it measures at, and how many budgets' worth of tokens it streams
# (first one large batch, as a prefill hands over, then small ones, as decoding does).
PROBE_BUDGETS = (16, 64)
PROBE_FILL = 6
PROBE_BATCH = 8

# The measurement (per layer, on the calibration text): the attention output of the last
# CURVE_QUERIES queries with every key, against the output when the middle (keys beyond
# CURVE_SINKS first and CURVE_RECENT recent ones) keeps only the share f of its keys that
# drew the most attention (summed over those queries, as h2o would keep them); the
# relative error at each f of CURVE_FRACTIONS, averaged over queries and heads.
CURVE_FRACTIONS = (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
CURVE_SINKS = 4
CURVE_RECENT = 128
CURVE_QUERIES = 256
# The shares are given out in steps of GREEDY_STEP of a layer's middle, each to the layer
# whose error it lowers most, until the layers keep TARGET_FRACTION of their middles on
# average (a typical compression; the weights are then scaled to any budget).
GREEDY_STEP = 1 / 256
TARGET_FRACTION = 0.25
# A fifth of the middle bytes is split evenly, the rest by the weights: the measurement
# comes from one text, and a layer that needed little there may need some on another.
# On two essay passages (1,024 tokens, 96 scored, at 12.5% and 25% in bytes) this beat
# the even split for h2o and chelsea, and beat an even share of one half.
EVEN_SHARE = 0.2
# Tokens the scratch layer of `exact_token_bytes` takes into its sinks, then its window.
PROBE_EXACT_TOKENS = 4
# Rounds of `hold_to_budget` before it gives up for this settle (each round lowers every
# layer still over its share; one round nearly always suffices).
HOLD_ROUNDS = 8


def _megabytes(nbytes: float) -> str:
    """Bytes as MB (10^6), rounded up to 0.1 so that the figure is enough."""
    return f"{math.ceil(nbytes / 1e5) / 10:.1f} MB"


# -- what an entry costs ---------------------------------------------------------------
@dataclass(frozen=True)
class MiddleCost:
    """A compressor's bytes at budget B: `base + per_entry * B` (bounded methods), or
    `base + per_entry * tokens` for a method that keeps every token (`bounded` False)."""

    base: int
    per_entry: float
    bounded: bool

    def bytes_at(self, budget: int) -> int:
        return math.ceil(self.base + self.per_entry * max(budget, 0))

    def entries_for(self, nbytes: float) -> int:
        """The largest budget whose bytes fit `nbytes` (0 when nothing fits)."""
        if self.per_entry <= 0:
            return 0
        return max(0, math.floor((nbytes - self.base) / self.per_entry))


_COSTS: dict[tuple, MiddleCost] = {}


def _frozen(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def middle_cost(method: str, params: dict[str, Any], spec: LayerSpec) -> MiddleCost:
    """Measured bytes of `method`'s middle for one layer of shape `spec` (memoised).

    Bounded methods: the peak bytes after any ingest while streaming PROBE_FILL budgets'
    worth of random tokens, at the two PROBE_BUDGETS, give a line through both. A method
    whose bytes grow with the tokens at a fixed budget (chelsea with
    `outlier_cache=full`) is refused: no budget in bytes can hold it."""
    key = (
        method,
        _frozen(params),
        spec.num_kv_heads,
        spec.group_size,
        spec.head_dim,
        str(spec.dtype),
        str(spec.device),
    )
    if key in _COSTS:
        return _COSTS[key]
    cls = compress.get(method)
    base = cls(spec, PROBE_BUDGETS[0], **params).nbytes()
    if not cls.bounded:
        tokens = PROBE_BUDGETS[-1]
        grown = max(_stream(cls, params, spec, budget=tokens, tokens=tokens))
        cost = MiddleCost(base, (grown - base) / tokens, bounded=False)
    else:
        peaks = []
        for budget in PROBE_BUDGETS:
            early, late = _stream(cls, params, spec, budget=budget, tokens=PROBE_FILL * budget)
            # Once full, a bounded compressor's bytes stop growing with the tokens.
            if late > early * 1.25 + 1024:
                raise ValueError(
                    f"{method} with these parameters keeps more than its budget as the conversation grows, so it "
                    f"cannot keep to a budget in bytes; give the budget in entries (e.g. --budget 1024) instead"
                )
            peaks.append(max(early, late))
        (b1, p1), (b2, p2) = zip(PROBE_BUDGETS, peaks)
        per_entry = max((p2 - p1) / (b2 - b1), 0.0)
        cost = MiddleCost(max(base, math.ceil(p1 - per_entry * b1)), per_entry, bounded=True)
    _COSTS[key] = cost
    return cost


def _stream(cls, params: dict[str, Any], spec: LayerSpec, budget: int, tokens: int) -> tuple[int, int]:
    """Stream `tokens` random tokens into a fresh compressor at `budget`; the peak bytes
    over the first half and over the second half of the stream."""
    comp = cls(spec, budget, **params)
    gen = torch.Generator().manual_seed(0)
    h, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    peaks = [0, 0]
    fed = 0
    sizes = [min(tokens, 2 * budget)]
    while sum(sizes) < tokens:
        sizes.append(min(PROBE_BATCH, tokens - sum(sizes)))
    for size in sizes:
        keys = torch.randn(h, size, d, generator=gen).to(spec.device, spec.dtype)
        values = torch.randn(h, size, d, generator=gen).to(spec.device, spec.dtype)
        positions = torch.arange(fed, fed + size, device=spec.device).expand(h, -1).contiguous()
        scores = torch.rand(h, g, size, generator=gen).to(spec.device) if cls.needs_attention else None
        comp.ingest(keys, values, positions, scores=scores)
        fed += size
        if cls.needs_attention:
            held = comp.entries().length
            comp.observe(torch.rand(h, g, held, generator=gen).to(spec.device))
        half = 0 if fed <= tokens // 2 else 1
        peaks[half] = max(peaks[half], comp.nbytes())
    return peaks[0], peaks[1]


_EXACT_BYTES: dict[tuple, tuple[float, float]] = {}


def exact_token_bytes(method: str, params: dict[str, Any], spec: LayerSpec) -> tuple[float, float]:
    """Bytes one sink token and one window token cost a layer of shape `spec` (keys,
    values, positions and, for score-based methods, the window's attention mass),
    measured on a scratch layer of `method` (memoised)."""
    key = (
        method,
        _frozen(params),
        spec.num_kv_heads,
        spec.group_size,
        spec.head_dim,
        str(spec.dtype),
        str(spec.device),
    )
    if key in _EXACT_BYTES:
        return _EXACT_BYTES[key]
    count = PROBE_EXACT_TOKENS
    layer = CompressedLayer(spec, compress.make(method, spec, 0, **params), count)
    h, d = spec.num_kv_heads, spec.head_dim
    tokens = torch.zeros(h, count, d, device=spec.device, dtype=spec.dtype)
    sizes = [layer.nbytes()]
    for first in (0, count):  # the first `count` tokens fill the sinks, the next the window
        layer.append(tokens, tokens, torch.arange(first, first + count, device=spec.device))
        sizes.append(layer.nbytes())
    _EXACT_BYTES[key] = (sizes[1] - sizes[0]) / count, (sizes[2] - sizes[1]) / count
    return _EXACT_BYTES[key]


def token_bytes(method: str, params: dict[str, Any], spec: LayerSpec, layers: int) -> int:
    """Bytes one more exact token costs `layers` layers at most (in the window, or in a
    middle that keeps every token): what an exact prefill or `full` adds per token."""
    _, window_bytes = exact_token_bytes(method, params, spec)
    cost = middle_cost(method, params, spec)
    per_entry = cost.per_entry if not cost.bounded else 0.0
    return math.ceil(layers * max(window_bytes, per_entry))


# -- the plan ------------------------------------------------------------------------------
@dataclass
class Allocation:
    """What a budget gives the layers of one cache under one method.

    `layer_budgets` is None unless the budget is in bytes: then the middle budget
    follows the tokens seen (`Budget.split`) and is the same in every layer. Under a byte
    budget it holds each layer's middle entries (lowered ones included: it is part of the
    snapshot), `byte_window` the window every layer keeps and `allowance` each layer's
    share of the bytes (what `hold_to_budget` holds it to).

    For the recall index: `planned_window` is the window the plan gave (a
    recall index may have lowered `byte_window` below it since), `window_floor` the
    smallest window the index may take it down to (1 when the budget sized the window:
    `window`, or `fit_window`; else the window as given), `floor_bytes` what sinks, that
    window and each middle's fixed state take in every layer (the least the hot cache
    can hold) and `window_token_bytes` what one window token costs a layer."""

    budget: Budget
    method: str
    sinks: int
    window: int  # the window asked for (--window)
    layers: int
    layer_budgets: list[int] | None = None
    byte_window: int = 0
    allowance: list[int] = field(default_factory=list)
    planned_window: int = 0
    window_floor: int = 0
    floor_bytes: int = 0
    window_token_bytes: float = 0.0
    # Per layer, the exact tokens a sliding-window layer keeps under a byte budget (None:
    # the layer does not slide); [] otherwise.
    sliding_keep: list[int | None] = field(default_factory=list)

    @property
    def window_lowered(self) -> bool:
        return self.layer_budgets is not None and self.byte_window < self.planned_window

    def lower_window(self, window: int) -> None:
        """Take the window down to `window` (never below `window_floor`, never up)."""
        self.byte_window = max(self.window_floor, min(self.byte_window, window))

    def targets(self, tokens_seen: int) -> tuple[list[int], int]:
        """(middle entries per layer, window) for the tokens seen so far."""
        if self.layer_budgets is not None:
            return list(self.layer_budgets), self.byte_window
        keeps_middle = compress.get(self.method).keeps_middle
        middle, window = self.budget.split(tokens_seen, self.sinks, self.window, keeps_middle)
        return [middle] * self.layers, window


def plan(
    budget: Budget,
    method: str,
    specs: list[LayerSpec],
    *,
    sinks: int,
    window: int,
    params_for: Callable[[LayerSpec], dict[str, Any]],
    weights: list[float] | None,
    fit_window: bool = False,
    sliding: list[int | None] | None = None,
) -> Allocation:
    """The allocation of `budget` for `method` over layers shaped `specs`. For a byte
    budget: sinks and window cost what a scratch layer measures (`exact_token_bytes`); a
    middle entry costs what the method's compressor measures (`middle_cost`, with each
    layer's parameters from `params_for`); the bytes left after every layer's sinks,
    window and fixed state go to the middles, evenly or by `weights` (`split_middle`).
    `fit_window` (the user left the window unset): the window shrinks, as it does under a
    share budget, so that sinks, window and fixed state take at most half of the bytes,
    and never below one token. `sliding`: per layer, the model's sliding window (None: the
    layer sees every token); such a layer keeps no sinks and no middle, only its last
    tokens (at most window - 1, at most what an even share of the bytes buys), and the
    bytes it leaves go to the other layers' middles. Raises ValueError when the budget
    cannot hold the sinks and the window (with `fit_window`, a window of one token)."""
    allocation = Allocation(budget, method, sinks, window, len(specs), byte_window=window)
    if not budget.in_bytes:
        return allocation
    cls = compress.get(method)
    if not cls.bounded:
        # `full` keeps every token whatever its budget: the budget is a cap that
        # `check_fits` holds it to, turn by turn.
        allocation.layer_budgets = [0] * len(specs)
        return allocation
    sink_bytes, window_bytes = exact_token_bytes(method, params_for(specs[0]), specs[0])
    costs = [middle_cost(method, params_for(spec), spec) for spec in specs]
    total, layers = int(budget.value), len(specs)
    if not cls.keeps_middle:
        # The whole budget is window, the same length in every layer.
        fixed = max(sinks * sink_bytes + cost.base for cost in costs)
        byte_window = math.floor((total / layers - fixed) / window_bytes)
        if byte_window < 1:
            minimum = layers * (fixed + window_bytes)
            raise ValueError(
                f"budget {budget} is below the {_megabytes(minimum)} that {sinks} sinks and a window of "
                f"one token take in the {layers} layers of this model; raise --budget or lower --sinks"
            )
        allocation.byte_window = allocation.planned_window = byte_window
        allocation.layer_budgets = [0] * layers
        allocation.allowance = [math.floor(fixed + byte_window * window_bytes)] * layers
        # The budget sized this window, so a recall index may take it down to one token.
        allocation.window_floor, allocation.window_token_bytes = 1, window_bytes
        allocation.floor_bytes = math.ceil(layers * (fixed + window_bytes))
        return allocation
    if fit_window:
        window = fitted_window(
            total, window, layers, sinks * sink_bytes + max(cost.base for cost in costs), window_bytes
        )
        allocation.byte_window = window
    fixed_bytes = [math.ceil(sinks * sink_bytes + window * window_bytes) + cost.base for cost in costs]
    slides = sliding or [None] * layers
    if any(w is not None for w in slides):
        share_tokens = max(1, math.floor(total / layers / window_bytes))
        keep = [None if w is None else max(1, min(w - 1, share_tokens)) for w in slides]
        allocation.sliding_keep = keep
        fixed_bytes = [
            f if k is None else math.ceil(k * window_bytes) + cost.base for f, k, cost in zip(fixed_bytes, keep, costs)
        ]
    available = total - sum(fixed_bytes)
    if available < 0:
        way_out = "raise --budget or lower --sinks" if fit_window else "raise --budget or lower --window"
        raise ValueError(
            f"budget {budget} is below the {_megabytes(sum(fixed_bytes))} that {sinks} sinks and a window of "
            f"{window} take in the {layers} layers of this model; {way_out}"
        )
    full = [i for i, w in enumerate(slides) if w is None]
    middles = split_middle(available, [costs[i] for i in full], None if weights is None else [weights[i] for i in full])
    allocation.layer_budgets = [0] * layers
    for i, middle in zip(full, middles):
        allocation.layer_budgets[i] = middle
    allocation.allowance = [f + cost.bytes_at(b) for f, cost, b in zip(fixed_bytes, costs, allocation.layer_budgets)]
    # A recall index takes the middles first, then (only a window the budget sized) the window.
    allocation.planned_window = window
    allocation.window_floor = 1 if fit_window else window
    allocation.window_token_bytes = window_bytes
    allocation.floor_bytes = sum(
        math.ceil(sinks * sink_bytes + allocation.window_floor * window_bytes) + cost.base if w is None else fixed
        for cost, w, fixed in zip(costs, slides, fixed_bytes)
    )
    return allocation


def fitted_window(total: int, window: int, layers: int, fixed: float, window_bytes: float) -> int:
    """The window (at most `window`, at least 1) whose exact tokens, with each layer's
    `fixed` bytes (sinks and state), take at most half of `total` over `layers` layers:
    the share rule of `Budget.split` (sinks + window at most half) in bytes, so that a
    byte budget leaves the middle room as a share budget does."""
    fits = math.floor((total / 2 / layers - fixed - 1) / window_bytes)  # - 1: `plan` rounds each layer up
    return max(1, min(window, fits))


def hold_to_budget(layers: list[CompressedLayer], allocation: Allocation) -> None:
    """After a settle under a byte budget: if the layers hold more than the budget (a
    compressor's state grew past what the probe measured, or a recall index grew), lower
    the budget of each layer over its share and refit it now. Lowered budgets stay
    lowered (`allocation` keeps them, and it is part of the snapshot).

    With a recall tier, whose index grows by every token that leaves the window and is
    in every layer's `nbytes`, that is not always enough: once no layer with a middle is
    over its own share (the ones over it have none left), the excess is taken from every
    layer that still has a middle, in proportion to its middle's bytes; once no middle
    is left, from a window the budget sized (`_shrink_window`). What still cannot fit was
    refused before the turn (`check_fits`)."""
    limit = int(allocation.budget.value)
    budgets, allowance = allocation.layer_budgets, allocation.allowance
    assert budgets is not None, "only a byte budget is held to its bytes"
    recall = any(layer.recall is not None for layer in layers)
    for _ in range(HOLD_ROUNDS):
        total = sum(layer.nbytes() for layer in layers)
        if total <= limit:
            return
        overs = [layer.nbytes() - allowance[i] for i, layer in enumerate(layers)]
        if recall and not any(over > 0 and budgets[i] > 0 for i, over in enumerate(overs)):
            held = [layer.compressor.nbytes() if budgets[i] > 0 else 0 for i, layer in enumerate(layers)]
            if not any(held):
                _shrink_window(layers, allocation, total - limit)
                continue
            overs = [math.ceil((total - limit) * h / sum(held)) for h in held]
        for i, layer in enumerate(layers):
            over = overs[i]
            budget = budgets[i]
            if over <= 0 or budget == 0:
                continue
            held_bytes = max(layer.compressor.nbytes(), 1)
            budgets[i] = max(0, min(budget - 1, math.floor(budget * (held_bytes - over) / held_bytes)))
            layer.compressor.budget = budgets[i]
            layer.refit()


def _shrink_window(layers: list[CompressedLayer], allocation: Allocation, excess: int) -> None:
    """Lower the window (never below `allocation.window_floor`) so that `excess` bytes
    go: each token that leaves it frees a window token and costs a row of the recall
    index, so the tokens to move are the excess over that difference; then evict them
    (into the compressor and the tier, as a settle does)."""
    saved = sum(
        allocation.window_token_bytes - (0 if layer.recall is None else layer.recall.bytes_per_row())
        for layer in layers
    )
    before = allocation.byte_window
    allocation.lower_window(before - max(1, math.ceil(excess / max(saved, 1.0))))
    for layer in layers:
        layer.evict(layer.window.keys.shape[1] - allocation.byte_window)


# -- sharing the bytes across layers ---------------------------------------------------------
def split_middle(available: int, costs: list[MiddleCost], weights: list[float] | None) -> list[int]:
    """Middle entries per layer so that the layers' middles together take at most
    `available` bytes: EVEN_SHARE of the bytes split evenly and the rest in proportion to
    `weights` (None or all zero: everything evenly)."""
    layers = len(costs)
    if layers == 0:
        return []
    total = float(sum(weights)) if weights else 0.0
    if not weights or total <= 0:
        shares = [1.0 / layers] * layers
    else:
        shares = [EVEN_SHARE / layers + (1 - EVEN_SHARE) * w / total for w in weights]
    return [cost.entries_for(available * share) for cost, share in zip(costs, shares)]


# -- the layer weights' maths (`kvchat.calibration.calibrate` runs them on a model) ----------------------
def error_curve(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    fractions: tuple[float, ...] = CURVE_FRACTIONS,
    sinks: int = CURVE_SINKS,
    recent: int = CURVE_RECENT,
    queries: int = CURVE_QUERIES,
) -> list[float]:
    """A layer's relative attention-output error when its middle keeps only the share f
    of its keys (those that drew the most attention), for each f of `fractions`; sinks and
    the recent keys are always kept. query [Hq, n, d], keys/values [H, n, d] (post-RoPE,
    causal). A sharp layer reaches a small error with few keys, a spread one needs many."""
    hq, n, d = query.shape
    h = keys.shape[0]
    group = hq // h
    first = max(sinks + recent + 1, n - queries)
    k = keys.float().repeat_interleave(group, 0)  # query head i reads KV head i // group
    v = values.float().repeat_interleave(group, 0)
    rows = torch.arange(first, n)
    causal = torch.arange(n)[None, :] <= rows[:, None]
    logits = (query[:, first:].float() @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
    probs = logits.softmax(-1)
    exact = probs @ v
    end = first - recent  # the middle: [sinks, end), before every measured query's recent keys
    drawn = probs.view(h, group, -1, n).sum((1, 2))[:, sinks:end]  # per KV head, over its group
    order = drawn.sort(dim=-1, descending=True, stable=True).indices
    errors = []
    for fraction in fractions:
        keep = torch.ones(h, n, dtype=torch.bool)
        keep[:, sinks:end] = False
        top = order[:, : round(fraction * (end - sinks))]
        keep.scatter_(1, sinks + top, True)
        mask = keep.repeat_interleave(group, 0)[:, None, :]
        out = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        errors.append(float(((out - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)).mean()))
    return errors


def greedy_fractions(
    curves: list[list[float]],
    fractions: tuple[float, ...] = CURVE_FRACTIONS,
    target: float = TARGET_FRACTION,
    step: float = GREEDY_STEP,
) -> list[float]:
    """The share of its middle each layer keeps, given out `step` by `step` to the layer
    whose error (linear between the measured points of its curve) drops most, until the
    shares average `target`. Ties go to the lower layer: the result is deterministic."""

    def error(layer: int, share: float) -> float:
        xs, ys = fractions, curves[layer]
        for i in range(1, len(xs)):
            if share <= xs[i]:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (share - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[-1]

    steps = [0] * len(curves)
    full = round(1 / step)
    for _ in range(round(target * full * len(curves))):
        gains = [error(i, s * step) - error(i, (s + 1) * step) if s < full else -math.inf for i, s in enumerate(steps)]
        steps[gains.index(max(gains))] += 1
    return [s * step for s in steps]


# -- the fit policy --------------------------------------------------------------------------------
class FitsCache(Protocol):
    """What the fit policy reads of a cache (`kvchat.cache.compressed_cache.CompressedCache`'s public
    accessors); a protocol so that this module needs no import of the cache."""

    method: str
    budget: Budget
    sinks: int
    window: int
    batch: int
    max_positions: int
    tokens_seen: int
    next_position: int
    compactions: int
    recall: int
    allocation: Allocation

    def entries_per_head(self) -> int: ...
    def index_bytes_per_token(self, compacted: bool | None = None) -> int: ...
    def nbytes(self) -> int: ...
    def recall_fixed_bytes(self) -> int: ...
    def budget_bytes(self) -> int | None: ...
    def token_bytes(self) -> int: ...
    def targets(self, tokens_seen: int) -> tuple[list[int], int]: ...


def held_fits(cache: FitsCache, count: int) -> bool:
    """Whether holding `count` more exact tokens keeps the cache within a byte budget
    (always true for other budgets)."""
    limit = cache.budget_bytes()
    return limit is None or cache.nbytes() + count * cache.token_bytes() <= limit


def prefill_mode(cache: FitsCache, count: int, *, mode: str, prefill_memory: int, bytes_per_token: int) -> str:
    """The prefill a turn of `count` tokens gets: `mode` itself unless it is "auto";
    then "exact-then-compress" when the whole input, held exact on top of what the cache
    holds, fits `prefill_memory` bytes (at the model's `bytes_per_token`), the model's
    positions and a byte budget, else "streaming"."""
    if mode != "auto":
        return mode
    held = cache.entries_per_head() + count
    exact_bytes = held * bytes_per_token
    # An exact prefill holds the whole input at once, so it must also fit the positions,
    # and under a byte budget the budget itself (docs/design.md, "Budgets").
    fits = exact_bytes <= prefill_memory and held <= cache.max_positions
    return "exact-then-compress" if fits and held_fits(cache, count) else "streaming"


def check_fits(cache: FitsCache, prompt_tokens: int, max_new_tokens: int, mode: str, chunk: int) -> None:
    """Raise InputTooLong when a turn of `prompt_tokens` plus up to `max_new_tokens`
    cannot fit the model's positions (or, for `full`, a byte budget), before anything is
    fed. `mode` is the prefill the turn will get (`prefill_mode`'s answer), `chunk`
    the prefill's chunk length. Compaction re-packs positions, so what must fit is the
    most entries the cache holds at once."""
    limit = cache.max_positions
    held = cache.entries_per_head()
    method = cache.method
    compresses = compress.get(method).bounded
    budget_bytes = cache.budget_bytes()
    if budget_bytes is not None:
        _check_index_fits(cache, prompt_tokens, max_new_tokens, budget_bytes)
    if not compresses and budget_bytes is not None:
        # `full` under a byte budget: the budget is a cap on what it may hold (and, with a
        # recall tier, every token that leaves its window also takes a row of the index).
        per_token = cache.token_bytes() + cache.index_bytes_per_token(
            _may_compact(cache, prompt_tokens + max_new_tokens)
        )
        need = cache.nbytes() + (prompt_tokens + max_new_tokens) * per_token
        if need > budget_bytes:
            raise InputTooLong(
                prompt_tokens,
                limit,
                f"`{method}` keeps every token and this turn would take its cache to about {need / 1e6:,.1f} MB, "
                f"past --budget {cache.budget}",
                "use a compressing method, e.g. `--method h2o`, or raise `--budget`",
            )
    if not compresses:
        need = held + prompt_tokens + max_new_tokens
        if need > limit:
            already = f"{held:,} already held + " if held else ""
            raise InputTooLong(
                prompt_tokens,
                limit,
                f"`{method}` holds at most {limit:,} tokens (the model's positions) and this turn needs "
                f"{need:,} ({already}this input + up to {max_new_tokens:,} answer tokens)",
                "use a compressing method, e.g. `--method h2o`",
            )
        return
    exact = mode == "exact-then-compress"
    if exact and held + prompt_tokens > limit:
        raise InputTooLong(
            prompt_tokens,
            limit,
            f"an exact-then-compress prefill holds it whole, and the model has {limit:,} positions",
            "use `--prefill streaming`",
        )
    if exact and not held_fits(cache, prompt_tokens):
        raise InputTooLong(
            prompt_tokens,
            limit,
            f"an exact-then-compress prefill holds it whole, more than --budget {cache.budget}",
            "use `--prefill streaming` or raise `--budget`",
        )
    # Steady state: sinks + middle + window, plus a batch waiting to leave the window
    # and the chunk being fed; never more than the tokens seen.
    seen_after = cache.tokens_seen + prompt_tokens + max_new_tokens
    keeps_middle = compress.get(method).keeps_middle
    middles, window = cache.targets(seen_after)
    middle = max(middles)
    steady = cache.sinks + middle + window + (cache.batch if keeps_middle else 1) + chunk
    need = min(seen_after, steady)
    if need > limit:
        raise InputTooLong(
            prompt_tokens,
            limit,
            f"at budget {cache.budget} and window {cache.window} the cache would hold about {need:,} entries, "
            f"more than the model's {limit:,} positions",
            "lower `--budget` or `--window`",
        )


def _may_compact(cache: FitsCache, tokens: int) -> bool:
    """Whether the recall index may hold a position per row by the end of `tokens` more
    (after a compaction, which comes when the positions run out)."""
    return cache.compactions > 0 or cache.next_position + tokens > cache.max_positions


def _check_index_fits(cache: FitsCache, prompt_tokens: int, max_new_tokens: int, budget_bytes: int) -> None:
    """Raise InputTooLong when, after this turn, the recall index (a row per token that
    left the window, in every layer; it never shrinks) would not fit the byte budget
    beside the least the hot cache can hold: sinks, the smallest window the index may
    leave (`Allocation.window_floor`) and middles of no entries. The bound is safe: every
    token the window holds beyond that floor costs more than the index row it would
    become, and the tokens of the pass in flight are not held to the budget."""
    tokens = prompt_tokens + max_new_tokens
    per_row = cache.index_bytes_per_token(_may_compact(cache, tokens))
    allocation = cache.allocation
    if not per_row or not compress.get(cache.method).bounded:
        return  # no recall tier; `full` is held token by token in `check_fits`
    rows = max(0, cache.tokens_seen + tokens - cache.sinks - allocation.window_floor)
    index = rows * per_row + cache.recall_fixed_bytes()
    if allocation.floor_bytes + index <= budget_bytes:
        return
    window = f"a window of {allocation.window_floor}"
    raise InputTooLong(
        prompt_tokens,
        cache.max_positions,
        f"with --recall {cache.recall} the recall index keeps {per_row:,} bytes in RAM for every token that left "
        f"the window, and after this turn it would take {_megabytes(index)}, which with {cache.sinks} sinks and "
        f"{window} ({_megabytes(allocation.floor_bytes)}) passes --budget {cache.budget}",
        "raise `--budget`, turn recall off (`--recall off`), or start a new session",
    )
