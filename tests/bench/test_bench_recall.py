"""The recall benchmark's own machinery (the benchmark itself runs as `kvchat bench recall`)."""

from __future__ import annotations

from kvchat.bench import recall
from kvchat.cli.options import bench_options
from kvchat.cli.parser import build_parser
from kvchat.settings import CacheSettings


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
