"""A budget in bytes, turned into middle entries per layer (docs/design.md, "Budgets").

Three pieces, used by `kvchat.cache` for `--budget 64MB`:

- `middle_cost`: what one more middle entry costs a method, in bytes, *measured* by
  running the method's compressor on random tokens at two small budgets (its auxiliary
  state, e.g. h2o's scores or bumblebee's neighbour arrays, is then counted without
  the cache knowing any method). Measured once per method, parameters and layer shape.
- `split_middle`: the bytes left for middles after sinks and windows, shared across
  layers, either uniformly or by the measured weights, as entries per layer.
- `layer_weights`: each layer's share of the middle, measured once per model on the
  calibration text (`kvchat.calibrate`) and cached as JSON in the models folder: per
  layer, how much its attention output changes when only the top share of its middle is
  kept (`error_curve`), then shares given out greedily where they lower that error most
  (`greedy_fractions`).

Per layer, not per head: a layer's middle is one padded [H, n, d] tensor per part
(`compress.base.Entries`), so a head that keeps fewer entries than its neighbours frees
no bytes; only the layer's widest head costs memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import compress
from .compress.base import LayerSpec

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
MEASUREMENT_VERSION = 2


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
    key = (method, _frozen(params), spec.num_kv_heads, spec.group_size, spec.head_dim, str(spec.dtype),
           str(spec.device))
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


# -- measuring the layers -----------------------------------------------------------------------
def error_curve(query: Tensor, keys: Tensor, values: Tensor, fractions: tuple[float, ...] = CURVE_FRACTIONS,
                sinks: int = CURVE_SINKS, recent: int = CURVE_RECENT, queries: int = CURVE_QUERIES) -> list[float]:
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


def greedy_fractions(curves: list[list[float]], fractions: tuple[float, ...] = CURVE_FRACTIONS,
                     target: float = TARGET_FRACTION, step: float = GREEDY_STEP) -> list[float]:
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


def measurement_path(fingerprint: str) -> Path:
    from .paths import models_dir

    return models_dir() / f"allocation-{fingerprint}.json"


def layer_weights(loaded) -> list[float]:
    """Every layer's share of the middle (`greedy_fractions` of its `error_curve` on the
    calibration text) for a `kvchat.models.LoadedModel`. The curves are measured once per
    model and cached as JSON beside the converted model (a damaged or stale file is
    measured again); rounded to 4 decimals, so that a measurement on another thread
    count gives the same allocation."""
    path = measurement_path(loaded.fingerprint)
    curves = None
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            curves = [[float(e) for e in curve] for curve in data["curves"]]
            if data.get("version") != MEASUREMENT_VERSION or len(curves) != loaded.num_layers:
                curves = None
        except (ValueError, KeyError, TypeError, AttributeError):
            curves = None
    if curves is None:
        curves = measure_layers(loaded)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({
            "model": loaded.name, "version": MEASUREMENT_VERSION, "fractions": list(CURVE_FRACTIONS),
            "sinks": CURVE_SINKS, "recent": CURVE_RECENT, "queries": CURVE_QUERIES, "curves": curves,
        }))
        partial.replace(path)
    return greedy_fractions(curves)


def measure_layers(loaded) -> list[list[float]]:
    """`error_curve` of every layer, averaged over the calibration samples."""
    from .calibrate import CALIBRATION_SAMPLES, CALIBRATION_TOKENS, calibration_text
    from .realkv import capture_qkv

    ids = loaded.tokenizer(calibration_text(), return_tensors="pt").input_ids[0]
    sums = [[0.0] * len(CURVE_FRACTIONS) for _ in range(loaded.num_layers)]
    for sample in range(CALIBRATION_SAMPLES):
        start = sample * (len(ids) - CALIBRATION_TOKENS) // max(1, CALIBRATION_SAMPLES - 1)
        qkv = capture_qkv(loaded.model, ids[start : start + CALIBRATION_TOKENS][None])
        for layer, (q, k, v) in qkv.items():
            sums[layer] = [a + b for a, b in zip(sums[layer], error_curve(q, k, v))]
    return [[round(e / CALIBRATION_SAMPLES, 4) for e in curve] for curve in sums]
