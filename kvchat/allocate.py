"""A budget in bytes, turned into middle entries per layer (docs/design.md, "Budgets").

Three pieces, used by `kvchat.cache` for `--budget 64MB`:

- `middle_cost`: what one more middle entry costs a method, in bytes, *measured* by
  running the method's compressor on random tokens at two small budgets (its auxiliary
  state, e.g. h2o's scores or bumblebee's neighbour arrays, is then counted without
  the cache knowing any method). Measured once per method, parameters and layer shape.
- `split_middle`: the bytes left for middles after sinks and windows, shared across
  layers, either uniformly or by the measured weights, as entries per layer.
- `layer_weights`: how much middle each layer needs, measured once per model on the
  calibration text (`kvchat.calibrate`) and cached as JSON in the models folder.

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

# The measurement (per layer, on the calibration text): for each late query, how many
# middle keys (beyond SPREAD_SINKS first and SPREAD_RECENT recent keys) it takes, the
# largest first, to bring the attention it reads to SPREAD_MASS of the total; as a share
# of the middle, averaged over KV heads and the last SPREAD_QUERIES queries.
SPREAD_MASS = 0.95
SPREAD_SINKS = 4
SPREAD_RECENT = 128
SPREAD_QUERIES = 256
# Half of the middle bytes are split evenly and half by the measured need: the
# measurement comes from one text, and a layer that needed nothing there may need some
# on another, so no layer is starved.
EVEN_SHARE = 0.5
MEASUREMENT_VERSION = 1


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
def middle_need(query: Tensor, keys: Tensor, mass: float = SPREAD_MASS, sinks: int = SPREAD_SINKS,
                recent: int = SPREAD_RECENT, queries: int = SPREAD_QUERIES) -> float:
    """The share of its middle a layer needs: for each of the last `queries` queries and
    each KV head, the fewest middle keys (largest attention first) that bring the mass
    read from sinks + recent + those keys to `mass`, over the middle's size; averaged.
    query [Hq, n, d], keys [H, n, d] (post-RoPE, causal). 0 = sinks and recent suffice
    (sharp attention), 1 = every middle key is needed (spread attention)."""
    hq, n, d = query.shape
    h = keys.shape[0]
    group = hq // h
    first = max(sinks + recent + 1, n - queries)
    q = query[:, first:].float()
    k = keys.float().repeat_interleave(group, 0)  # query head i reads KV head i // group
    logits = q @ k.transpose(1, 2) / math.sqrt(d)  # [Hq, m, n]
    rows = torch.arange(first, n)
    causal = torch.arange(n)[None, :] <= rows[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    probs = probs.view(h, group, -1, n).mean(1)  # a KV head serves its group: mean of its queries
    keys_at = torch.arange(n)[None, :]
    recent_from = rows[:, None] + 1 - recent
    in_middle = (keys_at >= sinks) & (keys_at < recent_from)  # [m, n]
    held = (probs * (causal & ~in_middle)).sum(-1)  # [H, m]: sinks + recent
    deficit = (mass - held).clamp_min(0)
    ranked = (probs * in_middle).sort(-1, descending=True).values.cumsum(-1)
    count = (ranked < deficit[..., None]).sum(-1) + (deficit > 0).long()
    size = in_middle.sum(-1)  # [m]
    return float((count.clamp_max(size) / size).mean())


def measurement_path(fingerprint: str) -> Path:
    from .paths import models_dir

    return models_dir() / f"allocation-{fingerprint}.json"


def layer_weights(loaded) -> list[float]:
    """Every layer's measured middle need (`middle_need`) on the calibration text, for a
    `kvchat.models.LoadedModel`: computed once per model and cached as JSON beside the
    converted model; a damaged or stale file is recomputed. Rounded to 4 decimals so that
    a recomputation on another thread count gives the same allocation."""
    path = measurement_path(loaded.fingerprint)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            weights = [float(w) for w in data["layers"]]
            if data.get("version") == MEASUREMENT_VERSION and len(weights) == loaded.num_layers:
                return weights
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    weights = measure_layers(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({
        "model": loaded.name, "version": MEASUREMENT_VERSION, "mass": SPREAD_MASS, "sinks": SPREAD_SINKS,
        "recent": SPREAD_RECENT, "queries": SPREAD_QUERIES, "layers": weights,
    }, indent=1))
    partial.replace(path)
    return weights


def measure_layers(loaded) -> list[float]:
    """`middle_need` of every layer, averaged over the calibration samples."""
    from .calibrate import CALIBRATION_SAMPLES, CALIBRATION_TOKENS, calibration_text
    from .realkv import capture_qkv

    ids = loaded.tokenizer(calibration_text(), return_tensors="pt").input_ids[0]
    sums = [0.0] * loaded.num_layers
    for sample in range(CALIBRATION_SAMPLES):
        start = sample * (len(ids) - CALIBRATION_TOKENS) // max(1, CALIBRATION_SAMPLES - 1)
        qkv = capture_qkv(loaded.model, ids[start : start + CALIBRATION_TOKENS][None])
        for layer, (q, k, _v) in qkv.items():
            sums[layer] += middle_need(q, k)
    return [round(s / CALIBRATION_SAMPLES, 4) for s in sums]
