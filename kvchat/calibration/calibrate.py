"""Per-model measurements, run once on calibration text and cached in the models folder.

Everything here runs the model or touches the disk, so that the cache and the allocation
maths (`kvchat.cache.compressed_cache`, `kvchat.cache.budget`) never do: the engine calls this module and hands
the results to the cache as plain numbers.

- **method calibration**: a compressor class that needs one defines `calibrate(keys)`: it
  receives exact keys of calibration text ({layer: [keys [H, n, d] per sample]}) and
  returns per-layer parameters (chelsea: its outlier heads, docs/methods.md).
  `calibrated_layer_params` feeds it and caches the result as
  `<models folder>/<method>-calibration-<fingerprint>.json`.
- **layer weights**: each layer's share of the middle under a byte budget
  (docs/design.md, "Budgets"). `measure_layers` runs `kvchat.cache.budget.error_curve` on
  every layer; `layer_weights` turns the curves into shares (`greedy_fractions`) and
  caches the curves as `<models folder>/allocation-<fingerprint>.json`.
- **recall layers**: which layers' recall tiers recall (`recall_layers`):
  the fewest that hold 95% of the attention the model puts on a planted sentence while
  it copies it (`retrieval_masses`), cached as `<models folder>/retrieval-<fingerprint>.json`.

The embedded model's measurements ship with kvchat (`kvchat/calibration/measured/`, written by
`python -m kvchat.calibration.measured`): a file there is read when the models folder has none of
that name, so the default model never waits for them. Every other model is measured on
first use.

The text is one that every installation has: the Python documentation topics shipped in the
standard library (`pydoc_data`, about 100k tokens of English prose). The paper calibrates
on random WikiText-2 sequences; any general prose serves, and an optional benchmark package
(the essays) must not be a condition for chatting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvchat.cache.budget import CURVE_FRACTIONS, CURVE_QUERIES, CURVE_RECENT, CURVE_SINKS, error_curve, greedy_fractions
from kvchat.calibration.realkv import capture_qkv
from kvchat.paths import models_dir

CALIBRATION_TOKENS = 2048
CALIBRATION_SAMPLES = 2
CALIBRATION_SOURCE = "pydoc_data.topics"
# Bumped when the layer measurement changes: a cached file of another version is measured again.
MEASUREMENT_VERSION = 2


# Measurements shipped with kvchat (the embedded model's); None reads and measures only
# the models folder (what `python -m kvchat.calibration.measured` does to write them).
SHIPPED: Path | None = Path(__file__).parent / "measured"


def saved(path: Path) -> Path | None:
    """Where a measurement cached as `path` can be read: the models folder's own file, or
    else the one shipped under the same name; None when neither exists."""
    if path.is_file():
        return path
    if SHIPPED is not None and (SHIPPED / path.name).is_file():
        return SHIPPED / path.name
    return None


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


def calibrated_layer_params(loaded, compressor: Any) -> dict[int, dict[str, Any]]:
    """{layer: parameters} from `compressor.calibrate` (a compressor class that has one), computed once per model and method
    and cached on disk (a damaged cache file is recomputed)."""
    path = calibration_path(compressor.name, loaded.fingerprint)
    if (found := saved(path)) is not None:
        try:
            return {int(layer): params for layer, params in json.loads(found.read_text())["layers"].items()}
        except (ValueError, KeyError, AttributeError):
            pass
    params = compressor.calibrate(calibration_keys(loaded))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path)
    partial.write_text(
        json.dumps(
            {
                "model": loaded.name,
                "method": compressor.name,
                "source": CALIBRATION_SOURCE,
                "tokens": CALIBRATION_TOKENS,
                "samples": CALIBRATION_SAMPLES,
                "layers": {str(k): v for k, v in params.items()},
            },
            indent=1,
        )
    )
    partial.replace(path)
    return params


def _partial(path: Path) -> Path:
    """Where a measurement is written before it replaces `path`: one file per process,
    so that two processes measuring the same model (parallel tests, two kvchats) never
    write into each other's file; the rename is atomic."""
    return path.with_name(f"{path.name}.partial-{os.getpid()}")


def layer_weights(loaded) -> list[float]:
    """Every layer's share of the middle (`greedy_fractions` of its `error_curve` on the
    calibration text) for a `kvchat.model.loading.LoadedModel`. The curves are measured once per
    model and cached as JSON beside the converted model (a damaged or stale file is
    measured again); rounded to 4 decimals, so that a measurement on another thread
    count gives the same allocation."""
    curves = _per_layer_cache(
        measurement_path(loaded.fingerprint),
        MEASUREMENT_VERSION,
        "curves",
        loaded.num_layers,
        lambda curve: [float(e) for e in curve],
        lambda: measure_layers(loaded),
        {
            "model": loaded.name,
            "fractions": list(CURVE_FRACTIONS),
            "sinks": CURVE_SINKS,
            "recent": CURVE_RECENT,
            "queries": CURVE_QUERIES,
        },
    )
    return greedy_fractions(curves)


def _per_layer_cache(
    path: Path,
    version: int,
    key: str,
    layers: int,
    parse: Callable[[Any], Any],
    measure: Callable[[], list],
    header: dict[str, Any],
) -> list:
    """A measurement with one entry per layer, cached as JSON at `path`: the file's `key`
    (each entry through `parse`) when it has this `version` and an entry per layer;
    otherwise `measure()`, written with `header` (atomically, `_partial`)."""
    if (found := saved(path)) is not None:
        try:
            data = json.loads(found.read_text())
            values = [parse(entry) for entry in data[key]]
            if data.get("version") == version and len(values) == layers:
                return values
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    values = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path)
    partial.write_text(json.dumps({**header, "version": version, key: values}))
    partial.replace(path)
    return values


def measure_layers(loaded) -> list[list[float]]:
    """`error_curve` of every layer, averaged over the calibration samples."""
    sums = [[0.0] * len(CURVE_FRACTIONS) for _ in range(loaded.num_layers)]
    for qkv in _samples(loaded):
        for layer, (q, k, v) in qkv.items():
            sums[layer] = [a + b for a, b in zip(sums[layer], error_curve(q, k, v))]
    return [[round(e / CALIBRATION_SAMPLES, 4) for e in curve] for curve in sums]


# -- which layers recall -----------------------------------------------------------------
# A planted fact and the question that makes the model copy it, at three depths of a
# RETRIEVAL_TOKENS-token stretch of the calibration text.
RETRIEVAL_TOKENS = 1536
RETRIEVAL_DEPTHS = (0.2, 0.5, 0.8)
RETRIEVAL_NUMBERS = (48213, 70596, 31847)
RETRIEVAL_FACT = " The special magic number is {number}."
RETRIEVAL_QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
# Layers recall until they hold this share of the copying attention (`recall_layers`).
RETRIEVAL_COVER = 0.95
RETRIEVAL_VERSION = 1


def retrieval_path(fingerprint: str) -> Path:
    return models_dir() / f"retrieval-{fingerprint}.json"


def retrieval_masses(loaded) -> list[float]:
    """Per layer: how much attention its queries put on a planted fact while the model
    copies it (the largest over the layer's query heads, averaged over the fact's tokens
    and RETRIEVAL_DEPTHS). The calibration text gets " The special magic number is N."
    at a depth, then a question and the same sentence again as the answer; at each
    answer position the exact attention (causal, over every earlier token) is summed
    over the planted sentence's tokens. The layers that hold that mass are the ones
    that fetch a detail from far back: what retrieval heads do ("Retrieval Head
    Mechanistically Explains Long-Context Factuality", Wu et al., 2024, arXiv 2404.15574)."""
    tok = loaded.tokenizer
    text_ids = tok(calibration_text()[: RETRIEVAL_TOKENS * 8], add_special_tokens=False).input_ids
    question = tok(RETRIEVAL_QUESTION, add_special_tokens=False).input_ids
    sums = [0.0] * loaded.num_layers
    for depth, number in zip(RETRIEVAL_DEPTHS, RETRIEVAL_NUMBERS):
        fact = tok(RETRIEVAL_FACT.format(number=number), add_special_tokens=False).input_ids
        filler = text_ids[: RETRIEVAL_TOKENS - 2 * len(fact) - len(question)]
        cut = int(depth * len(filler))
        ids = filler[:cut] + fact + filler[cut:] + question + fact
        answer = len(ids) - len(fact)
        # The query at position p predicts token p + 1: those predicting the answer's tokens.
        queries = torch.arange(answer - 1, len(ids) - 1)
        span = slice(cut, cut + len(fact))
        captured = capture_qkv(loaded.model, torch.tensor([ids]))  # (in inference mode)
        for layer, (q, k, _v) in captured.items():
            hq, _, d = q.shape
            group = hq // k.shape[0]
            keys = k.float().repeat_interleave(group, 0)  # [Hq, n, d]
            at = queries.to(q.device)  # (the model's device: CUDA too)
            logits = q[:, at].float() @ keys.transpose(1, 2) / d**0.5  # [Hq, J, n]
            later = torch.arange(len(ids), device=q.device)[None, :] > at[:, None]
            probs = logits.masked_fill_(later, float("-inf")).softmax(-1)
            sums[layer] += float(probs[..., span].sum(-1).amax(0).mean())
    return [round(s / len(RETRIEVAL_DEPTHS), 4) for s in sums]


def choose_recall_layers(masses: list[float], cover: float = RETRIEVAL_COVER) -> list[int]:
    """The fewest layers that hold `cover` of the summed masses (largest first), in layer
    order; every layer when there is no mass at all."""
    total = sum(masses)
    if total <= 0:
        return list(range(len(masses)))
    chosen, held = [], 0.0
    for layer in sorted(range(len(masses)), key=lambda i: -masses[i]):
        if held >= cover * total:
            break
        chosen.append(layer)
        held += masses[layer]
    return sorted(chosen)


def recall_layers(loaded) -> list[int]:
    """The layers whose recall tier recalls (`choose_recall_layers` of
    `retrieval_masses`), measured once per model and cached as JSON beside the converted
    model (a damaged or stale file is measured again)."""
    masses = _per_layer_cache(
        retrieval_path(loaded.fingerprint),
        RETRIEVAL_VERSION,
        "masses",
        loaded.num_layers,
        float,
        lambda: retrieval_masses(loaded),
        {
            "model": loaded.name,
            "source": CALIBRATION_SOURCE,
            "tokens": RETRIEVAL_TOKENS,
            "depths": list(RETRIEVAL_DEPTHS),
        },
    )
    return choose_recall_layers(masses)
