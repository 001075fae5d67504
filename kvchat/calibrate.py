"""Per-model calibration that some methods need, run once and cached in the models folder.

A compressor class that needs one defines `calibrate(keys)`: it receives exact keys of
calibration text ({layer: [keys [H, n, d] per sample]}) and returns per-layer parameters
(chelsea: its outlier heads, docs/methods.md). This module feeds it and caches the
result as `<models folder>/<method>-calibration-<fingerprint>.json`.

The text is one that every installation has: the Python documentation topics shipped in the
standard library (`pydoc_data`, about 100k tokens of English prose). The paper calibrates
on random WikiText-2 sequences; any general prose serves, and an optional benchmark package
(the essays) must not be a condition for chatting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .paths import models_dir
from .realkv import capture_qkv

CALIBRATION_TOKENS = 2048
CALIBRATION_SAMPLES = 2
CALIBRATION_SOURCE = "pydoc_data.topics"


def calibration_path(method: str, fingerprint: str) -> Path:
    return models_dir() / f"{method}-calibration-{fingerprint}.json"


def calibration_text() -> str:
    """The Python documentation topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def calibration_keys(loaded) -> dict[int, list]:
    """{layer: [keys [H, n, d] per sample]} of CALIBRATION_SAMPLES spread-out windows."""
    ids = loaded.tokenizer(calibration_text(), return_tensors="pt").input_ids[0]
    keys: dict[int, list] = {}
    for sample in range(CALIBRATION_SAMPLES):
        start = sample * (len(ids) - CALIBRATION_TOKENS) // max(1, CALIBRATION_SAMPLES - 1)
        qkv = capture_qkv(loaded.model, ids[start : start + CALIBRATION_TOKENS][None])
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
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"model": loaded.name, "method": compressor.name, "source": CALIBRATION_SOURCE,
                                   "tokens": CALIBRATION_TOKENS, "samples": CALIBRATION_SAMPLES,
                                   "layers": {str(k): v for k, v in params.items()}}, indent=1))
    partial.replace(path)
    return params
