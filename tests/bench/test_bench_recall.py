"""The recall benchmark's own machinery (the benchmark itself runs as `kvchat bench recall`)."""

from __future__ import annotations

import dataclasses

from kvchat.bench import recall
from kvchat.cli.options import bench_options
from kvchat.cli.parser import build_parser
from kvchat.model.engine import Engine
from kvchat.model.loading import LoadedModel
from kvchat.settings import DEFAULT_BUDGET, CacheSettings


def test_a_method_row_comes_with_the_mode_its_paper_evaluates_and_the_oracle_is_h2o():
    options = bench_options(
        build_parser({}).parse_args(["bench", "recall", "--methods", "full,subgen,balancekv:prefill,oracle"])
    )
    rows = recall.rows_for(options, list(options.methods))
    assert [r.label for r in rows] == ["full", "subgen", "subgen:stream", "balancekv:prefill", "oracle"]
    assert rows[2].settings.params["mode"] == "stream"
    assert rows[3].settings.params["schedule"] == "prefill"
    assert rows[4].oracle and rows[4].settings.method == "h2o"
    assert all(r.settings.budget == "25%" for r in rows), "the suite's budget is 25% unless given"


def test_recall_values_give_each_method_a_row_per_value_side_by_side():
    options = bench_options(
        build_parser({}).parse_args(["bench", "recall", "--methods", "h2o,window", "--recall", "0,32"])
    )
    rows = recall.rows_for(options, list(options.methods))
    assert [r.label for r in rows] == ["h2o", "h2o+recall32", "window", "window+recall32"]
    assert [r.settings.recall for r in rows] == [0, 32, 0, 32]


def test_fact_positions_are_exactly_the_tokens_that_spell_the_fact(engine):
    fact = "The special magic number is 48213."
    session = engine.new_session(CacheSettings(method="full"))
    session.prefill_message(f"Some text before. {fact} And some text after.")
    positions = recall.fact_positions(engine, session, fact).tolist()
    assert positions == list(range(positions[0], positions[-1] + 1))
    spelled = engine.tokenizer.decode([session.token_ids[i] for i in positions])
    assert fact in spelled and len(spelled) <= len(fact) + 2  # at most a leading space more


@dataclasses.dataclass
class TrainedFor1024(LoadedModel):
    @property
    def max_positions(self) -> int:
        return 1024


def long_options(*args: str):
    return bench_options(build_parser({}).parse_args(["bench", "recall", *args]))


def test_past_the_trained_context_rows_run_at_their_own_budget_beside_the_full_ceiling():
    options = long_options("--methods", "window,h2o,oracle", "--recall", "32")
    rows = recall.long_rows(options, recall.rows_for(options, list(options.methods)))
    assert [r.label for r in rows] == ["full (ceiling)", "window+recall32", "h2o+recall32"]
    assert rows[0].settings.method == "full" and rows[0].settings.recall == 0
    assert all(r.settings.budget == DEFAULT_BUDGET for r in rows), "a user's budget, not the grid's 25%"
    assert all(r.settings.prefill_mode == "auto" for r in rows)
    given = long_options("--methods", "window", "--budget", "2048")
    assert recall.long_rows(given, recall.rows_for(given, ["window"]))[1].settings.budget == "2048"


def test_every_length_past_the_context_asks_for_the_same_needles_as_the_reference(engine):
    probes = recall.long_probes(engine, (1024,), (0.1, 0.9), reference=256)
    assert [(p.context, p.depth) for p in probes] == [(256, 0.1), (256, 0.9), (1024, 0.1), (1024, 0.9)]
    assert [p.answer for p in probes[:2]] == [p.answer for p in probes[2:]]
    assert probes[0].answer != probes[1].answer
    assert all(p.fact in p.document for p in probes)


def test_a_document_past_the_trained_context_is_read_in_its_own_session_and_its_cost_recorded(embedded):
    # The embedded model, told its context is 1,024 positions: a 1,400-token document passes it.
    short = Engine(TrainedFor1024(**{f.name: getattr(embedded, f.name) for f in dataclasses.fields(embedded)}))
    assert recall.is_long(short, 1400) and not recall.is_long(short, 256)
    options = long_options("--methods", "window", "--recall", "32", "--budget", "256", "--window", "128")
    rows = recall.long_rows(options, recall.rows_for(options, ["window"]))
    trials: list[dict] = []
    recall.run_long_probes(short, rows, recall.long_probes(short, (1400,), (0.5,), reference=256), trials, 256)
    assert [(t["method"], t["context"]) for t in trials] == [
        ("full (ceiling)", 256),
        ("window+recall32", 256),
        ("window+recall32", 1400),
    ]
    long = trials[-1]
    assert long["compactions"] >= 1 and long["prompt_tokens"] > 1400
    assert long["prefill_tokens_per_s"] > 0 and long["decode_tokens_per_s"] > 0
    assert long["cold_bytes"] > 0 and long["rss_bytes"] > 0
    assert long["correct"] == recall.is_correct(long["answer"], long["expected"])
    table = {(r["method"], r["context"]): r for r in recall.speed_rows(trials, reference=256)}
    assert set(table) == {(t["method"], t["context"]) for t in trials}
    assert (table[("window+recall32", 1400)]["correct"], table[("window+recall32", 1400)]["total"]) == (
        int(long["correct"]),
        1,
    )
    ratio = table[("window+recall32", 1400)]["decode_tokens_per_s_vs_256"]
    assert ratio == round(long["decode_tokens_per_s"] / trials[1]["decode_tokens_per_s"], 3)
