"""`kvchat bench attention`.

BalanceKV's single-layer protocol (docs/methods.md) on every layer of the
loaded model: real post-RoPE q/k/v on ~2,048 tokens of the Paul Graham essays, the
first and last 256 tokens exact, the middle handed to a compressor at keep-ratios
1/2, 1/4, 1/8, and the relative error ||approx - exact|| / ||exact|| of the last 256
queries' attention output. Every method runs in its default mode, plus its other paper
mode (subgen's provable stream algorithm, balancekv's prefill schedule) and a uniform
random subset as the reference.

Each row is also compared with uniform sampling at keep 1/4: the ratio of mean errors and
the number of layers where the method's error is lower. These comparisons are
measurements, reported here rather than asserted in tests: a method that improves must
not break the suite.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from kvchat.bench import report
from kvchat.calibration.evaluate import attention_error, compress_middle, uniform_middle
from kvchat.compress import Entries
from kvchat.settings import BenchOptions

CONTEXT_TOKENS = 2048
SINKS = RECENT = 256  # as evaluate.py / the BalanceKV study
RATIOS = (2, 4, 8)  # keep 1/r of the middle
SEEDS = 3
UNIFORM = "uniform"
# Each method's other paper mode, next to its default mode.
PAPER_MODES: dict[str, dict[str, Any]] = {
    "subgen:stream": {"mode": "stream"},
    "balancekv:prefill": {"schedule": "prefill"},
}
TARGET_RATIO = 4  # the comparison with uniform sampling is made at keep 1/4

QKV = tuple[Tensor, Tensor, Tensor]


@dataclass
class Variant:
    """One row of the report: a method in one mode (or the uniform reference)."""

    label: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)


def variants(names: list[str], user_params: Callable[[str], dict[str, Any]]) -> list[Variant]:
    """A method name brings its default mode and its paper mode; a label such as
    "subgen:kcenter" brings that mode alone. Hyperparameters given on the command line
    apply to every row of their method. The uniform reference always comes last."""
    rows = [Variant(n, n, user_params(n)) for n in names if n not in PAPER_MODES and n != UNIFORM]
    for label, mode in PAPER_MODES.items():
        method = label.split(":")[0]
        if method in names or label in names:
            rows.append(Variant(label, method, {**user_params(method), **mode}))
    return rows + [Variant(UNIFORM, UNIFORM)]


def capture_layers(engine, layers: list[int]) -> dict[int, QKV]:
    """Real q/k/v of the listed layers, moved to CPU float32: evaluate.py computes on CPU
    and the comparison is of algorithms, so it uses the reference precision."""
    from kvchat.calibration.realkv import capture_qkv, essays_text

    ids = engine.tokenizer(essays_text(), add_special_tokens=False, return_tensors="pt").input_ids
    captured = capture_qkv(engine.model, ids[:, :CONTEXT_TOKENS], layers)
    return {layer: cast(QKV, tuple(t.float().cpu() for t in qkv)) for layer, qkv in captured.items()}


def middle_entries(variant: Variant, qkv: QKV, budget: int, layer: int, seed: int) -> Entries:
    q, k, v = qkv
    if variant.method == UNIFORM:
        return uniform_middle(k, v, budget=budget, sinks=SINKS, recent=RECENT, seed=seed)
    return compress_middle(
        variant.method,
        q,
        k,
        v,
        budget=budget,
        sinks=SINKS,
        recent=RECENT,
        layer=layer,
        seed=seed,
        params=variant.params,
    )


def relative_error(variant: Variant, qkv: QKV, budget: int, layer: int, seed: int) -> float:
    q, k, v = qkv
    entries = middle_entries(variant, qkv, budget, layer, seed)
    return attention_error(q, k, v, entries, sinks=SINKS, recent=RECENT)


def draws_randomness(variant: Variant, qkv: QKV, budget: int, layer: int) -> bool:
    """Whether two seeds give different middles; a deterministic method needs one seed."""
    a = middle_entries(variant, qkv, budget, layer, seed=0)
    b = middle_entries(variant, qkv, budget, layer, seed=1)
    same = all(
        torch.equal(x, y)
        for x, y in ((a.keys, b.keys), (a.values, b.values), (a.log_num, b.log_num), (a.log_den, b.log_den))
    )
    return not same


def layer_errors(variant: Variant, captured: dict[int, QKV], ratio: int, seeds: int) -> list[float]:
    """Per layer (in `captured` order), the error averaged over seeds."""
    errors = []
    for layer, qkv in captured.items():
        budget = (qkv[1].shape[1] - SINKS - RECENT) // ratio
        per_seed = [relative_error(variant, qkv, budget, layer, seed) for seed in range(seeds)]
        errors.append(sum(per_seed) / len(per_seed))
    return errors


def seeds_for(variant: Variant, captured: dict[int, QKV], max_seeds: int) -> int:
    """`max_seeds` for a method that draws random numbers (checked on the first layer at
    every ratio: some draw only when they compress hard), 1 for a deterministic one."""
    if max_seeds == 1:
        return 1
    layer, qkv = next(iter(captured.items()))
    middle = qkv[1].shape[1] - SINKS - RECENT
    random = any(draws_randomness(variant, qkv, middle // ratio, layer) for ratio in RATIOS)
    return max_seeds if random else 1


def measure(variants_: list[Variant], captured: dict[int, QKV], max_seeds: int) -> tuple[list[dict], dict]:
    """(table rows: mean over layers per ratio, per-layer errors {label: {"r4": [...]}})."""
    rows: list[dict] = []
    per_layer: dict[str, dict[str, list[float]]] = {}
    for variant in variants_:
        seeds = seeds_for(variant, captured, max_seeds)
        row: dict[str, Any] = {"method": variant.label, "seeds": seeds}
        per_layer[variant.label] = {}
        for ratio in RATIOS:
            start = time.perf_counter()
            errors = layer_errors(variant, captured, ratio, seeds)
            per_layer[variant.label][f"r{ratio}"] = errors
            row[f"keep 1/{ratio}"] = mean = sum(errors) / len(errors)
            print(
                f"{variant.label:>18} keep 1/{ratio}: mean error {mean:.4f} over {len(errors)} layers "
                f"x {seeds} seed(s) ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
        rows.append(row)
    compare_with_uniform(rows, per_layer)
    return rows, per_layer


def compare_with_uniform(rows: list[dict], per_layer: dict[str, dict[str, list[float]]]) -> None:
    """Add to every row its mean error over uniform's at keep 1/TARGET_RATIO and the
    layers where it is lower than uniform's (same layers, seed-averaged)."""
    key = f"r{TARGET_RATIO}"
    if UNIFORM not in per_layer:
        return
    reference = per_layer[UNIFORM][key]
    for row in rows:
        errors = per_layer[row["method"]][key]
        row[f"vs uniform @1/{TARGET_RATIO}"] = sum(errors) / sum(reference)
        won = sum(ours < theirs for ours, theirs in zip(errors, reference))
        row[f"layers won @1/{TARGET_RATIO}"] = f"{won}/{len(errors)}"


def plot_per_ratio(out: str | Path, layers: list[int], per_layer: dict[str, dict[str, list[float]]]) -> None:
    for ratio in RATIOS:
        series = {label: (layers, errors[f"r{ratio}"]) for label, errors in per_layer.items()}
        report.plot(
            out,
            f"attention_r{ratio}",
            series,
            xlabel="layer",
            ylabel="relative error",
            title=f"Attention output error per layer, middle kept at 1/{ratio}",
        )


def describe(model_name: str, context: int, layers: list[int]) -> str:
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    return (
        f"Real q/k/v of {model_name} on {context} tokens of the Paul Graham essays, layers {layers[0]}..{layers[-1]} "
        f"(every {step}); first {SINKS} and last {RECENT} tokens exact, the middle ({context - SINKS - RECENT} "
        f"tokens) compressed in one batch to 1/r of its size; error = mean over the last {RECENT} queries and "
        "heads of ||approx - exact|| / ||exact|| (float32, CPU). `seeds`: methods whose middle depends on the "
        "seed are averaged over that many seeds. `uniform` = a uniform random subset, count-weighted (reference). "
        f"`vs uniform @1/{TARGET_RATIO}`: mean error over uniform's (below 1: better); `layers won`: layers where "
        "the method's error is below uniform's."
    )


def run(options: BenchOptions) -> int:
    from kvchat.compress import available
    from kvchat.model.engine import load_engine

    engine = load_engine(options.model)
    num_layers = engine.model.config.num_hidden_layers
    layers = list(range(0, num_layers, 3)) if options.quick else list(range(num_layers))
    methods = list(options.methods or available())
    start = time.perf_counter()
    captured = capture_layers(engine, layers)
    context = next(iter(captured.values()))[1].shape[1]
    print(
        f"captured q/k/v of {len(layers)} layers on {context} tokens ({time.perf_counter() - start:.1f} s)", flush=True
    )
    rows, per_layer = measure(
        variants(methods, lambda m: dict(options.cache.method_params.get(m, {}))),
        captured,
        max_seeds=1 if options.quick else SEEDS,
    )

    out = options.out
    report.write(
        out,
        "attention",
        rows,
        ["method"]
        + [f"keep 1/{r}" for r in RATIOS]
        + [f"vs uniform @1/{TARGET_RATIO}", f"layers won @1/{TARGET_RATIO}", "seeds"],
        title="Attention output relative error, mean over layers",
        notes=describe(engine.loaded.name, context, layers),
        extra={"layers": layers, "context_tokens": context, "sinks": SINKS, "recent": RECENT, "per_layer": per_layer},
    )
    plot_per_ratio(out, layers, per_layer)
    print(f"reports written to {out}/")
    return 0
