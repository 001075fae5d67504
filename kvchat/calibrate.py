"""Per-model calibration that some methods need, run once and cached in the models folder.

Chelsea keeps its outlier heads out of clustering (docs/methods.md): heads whose
keys do not find a close partner in their chunk. They are found on real keys of the
shipped essays and stored as `<models folder>/chelsea-outliers-<fingerprint>.json` (see kvchat.paths).
"""

from __future__ import annotations

import json
from pathlib import Path

from .compress.chelsea import outlier_fraction, select_outlier_heads
from .paths import models_dir
from .realkv import capture_qkv, essays_text

CALIBRATION_TOKENS = 2048
CALIBRATION_SAMPLES = 2


def chelsea_outliers_path(fingerprint: str) -> Path:
    return models_dir() / f"chelsea-outliers-{fingerprint}.json"


def chelsea_outliers(loaded) -> dict[int, list[int]]:
    """{layer: [KV heads kept out of clustering]} for this model (cached on disk)."""
    path = chelsea_outliers_path(loaded.fingerprint)
    if path.is_file():
        try:
            return {int(k): v for k, v in json.loads(path.read_text())["outlier_heads"].items()}
        except (ValueError, KeyError):
            pass  # a damaged cache file is simply recomputed
    ids = loaded.tokenizer(essays_text(), return_tensors="pt").input_ids[0]
    fractions: dict[int, list] = {}
    for sample in range(CALIBRATION_SAMPLES):
        # Samples from spread-out offsets of the essays (the paper: random WikiText-2 sequences).
        start = sample * (len(ids) - CALIBRATION_TOKENS) // max(1, CALIBRATION_SAMPLES - 1)
        qkv = capture_qkv(loaded.model, ids[start : start + CALIBRATION_TOKENS][None])
        for layer, (_q, k, _v) in qkv.items():
            fractions.setdefault(layer, []).append(outlier_fraction(k.float()))
    mean = {layer: sum(f) / len(f) for layer, f in fractions.items()}
    heads = select_outlier_heads(mean)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps({"model": loaded.name, "outlier_heads": heads,
                               "fractions": {k: [round(float(x), 4) for x in v] for k, v in mean.items()}}, indent=1))
    tmp.replace(path)
    return heads
