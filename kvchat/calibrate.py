"""Per-model measurements, run once on calibration text and cached in the models folder.

Everything here runs the model or touches the disk, so that the cache and the allocation
maths (`kvchat.cache`, `kvchat.allocate`) never do: the engine calls this module and hands
the results to the cache as plain numbers.

- **method calibration**: a compressor class that needs one defines `calibrate(keys)`: it
  receives exact keys of calibration text ({layer: [keys [H, n, d] per sample]}) and
  returns per-layer parameters (chelsea: its outlier heads, docs/methods.md).
  `calibrated_layer_params` feeds it and caches the result as
  `<models folder>/<method>-calibration-<fingerprint>.json`.
- **layer weights**: each layer's share of the middle under a byte budget
  (docs/design.md, "Budgets"). `measure_layers` runs `allocate.error_curve` on every
  layer; `layer_weights` turns the curves into shares (`allocate.greedy_fractions`) and
  caches the curves as `<models folder>/allocation-<fingerprint>.json`.

The text is one that every installation has: the Python documentation topics shipped in the
standard library (`pydoc_data`, about 100k tokens of English prose). The paper calibrates
on random WikiText-2 sequences; any general prose serves, and an optional benchmark package
(the essays) must not be a condition for chatting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from .allocate import CURVE_FRACTIONS, CURVE_QUERIES, CURVE_RECENT, CURVE_SINKS, error_curve, greedy_fractions
from .paths import models_dir
from .realkv import capture_qkv

CALIBRATION_TOKENS = 2048
CALIBRATION_SAMPLES = 2
CALIBRATION_SOURCE = "pydoc_data.topics"
# Bumped when the layer measurement changes: a cached file of another version is measured again.
MEASUREMENT_VERSION = 2


def calibration_path(method: str, fingerprint: str) -> Path:
    return models_dir() / f"{method}-calibration-{fingerprint}.json"


def measurement_path(fingerprint: str) -> Path:
    return models_dir() / f"allocation-{fingerprint}.json"


def calibration_text() -> str:
    """The Python documentation topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def _samples(loaded) -> Iterator[dict[int, tuple[Tensor, Tensor, Tensor]]]:
    """{layer: (q, k, v)} of each of CALIBRATION_SAMPLES spread-out windows of the text."""
    ids = loaded.tokenizer(calibration_text(), return_tensors="pt").input_ids[0]
    for sample in range(CALIBRATION_SAMPLES):
        start = sample * (len(ids) - CALIBRATION_TOKENS) // max(1, CALIBRATION_SAMPLES - 1)
        yield capture_qkv(loaded.model, ids[start : start + CALIBRATION_TOKENS][None])


def calibration_keys(loaded) -> dict[int, list]:
    """{layer: [keys [H, n, d] per sample]} of CALIBRATION_SAMPLES spread-out windows."""
    keys: dict[int, list] = {}
    for qkv in _samples(loaded):
        for layer, (_q, k, _v) in qkv.items():
            keys.setdefault(layer, []).append(k)
    return keys


def calibrated_layer_params(loaded, compressor: type) -> dict[int, dict[str, Any]]:
    """{layer: parameters} from `compressor.calibrate`, computed once per model and method
    and cached on disk (a damaged cache file is recomputed)."""
    path = calibration_path(compressor.name, loaded.fingerprint)
    if path.is_file():
        try:
            return {int(layer): params for layer, params in json.loads(path.read_text())["layers"].items()}
        except (ValueError, KeyError, AttributeError):
            pass
    params = compressor.calibrate(calibration_keys(loaded))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path)
    partial.write_text(json.dumps({"model": loaded.name, "method": compressor.name, "source": CALIBRATION_SOURCE,
                                   "tokens": CALIBRATION_TOKENS, "samples": CALIBRATION_SAMPLES,
                                   "layers": {str(k): v for k, v in params.items()}}, indent=1))
    partial.replace(path)
    return params


def _partial(path: Path) -> Path:
    """Where a measurement is written before it replaces `path`: one file per process,
    so that two processes measuring the same model (parallel tests, two kvchats) never
    write into each other's file; the rename is atomic."""
    return path.with_name(f"{path.name}.partial-{os.getpid()}")


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
        partial = _partial(path)
        partial.write_text(json.dumps({
            "model": loaded.name, "version": MEASUREMENT_VERSION, "fractions": list(CURVE_FRACTIONS),
            "sinks": CURVE_SINKS, "recent": CURVE_RECENT, "queries": CURVE_QUERIES, "curves": curves,
        }))
        partial.replace(path)
    return greedy_fractions(curves)


def measure_layers(loaded) -> list[list[float]]:
    """`allocate.error_curve` of every layer, averaged over the calibration samples."""
    sums = [[0.0] * len(CURVE_FRACTIONS) for _ in range(loaded.num_layers)]
    for qkv in _samples(loaded):
        for layer, (q, k, v) in qkv.items():
            sums[layer] = [a + b for a, b in zip(sums[layer], error_curve(q, k, v))]
    return [[round(e / CALIBRATION_SAMPLES, 4) for e in curve] for curve in sums]
