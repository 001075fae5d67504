"""The speed benchmark's own machinery (the benchmark itself runs as `kvchat bench speed`),
at tiny sizes: nothing here asserts a speed."""

from __future__ import annotations

from kvchat.bench import speed
from kvchat.settings import CacheSettings, SamplingSettings

# A window of 16 behind 4 sinks: a 300-token document sends most of its tokens cold.
SMALL = CacheSettings(window=16, sinks=4, batch=8)


def test_a_later_turn_feeds_what_the_app_feeds_after_an_answer(engine):
    session = engine.new_session(CacheSettings(method="full"))
    answer = session.send("Tell me about lighthouses.", SamplingSettings(max_new_tokens=6)).token_ids
    expected = session.prompt_ids(speed.NEXT_TURN_QUESTION)
    assert speed.next_turn_ids(engine.new_session(CacheSettings(method="full")), answer) == expected
    assert speed.NEXT_TURN_QUESTION in engine.tokenizer.decode(expected)
    assert len(expected) <= speed.NEXT_TURN_ROOM


def test_ours_times_the_first_token_of_a_later_turn(engine):
    ids = speed._prompt_ids(engine, 300)
    r = speed._ours(engine, ids, CacheSettings(method="window", budget="64", window=16, sinks=4, batch=8), new_tokens=8)
    assert r["next_turn_ttft_s"] > 0 and 0 < r["next_turn_tokens"] <= speed.NEXT_TURN_ROOM
    assert {"ttft_s", "decode_tok_s", "kv_mb", "prefill_mode"} <= set(r)
    assert "next_turn_ttft_s" not in speed._ours(engine, ids, SMALL, new_tokens=2, next_turn=False)


def test_recall_rows_follow_each_method_with_ratios_to_it(engine):
    rows = speed.part_methods(
        engine, engine.model, ["window"], [300], "64", None, [0, 16], settings=SMALL, new_tokens=8
    )
    assert [r["method"] for r in rows] == ["generate (fp32)", "window", "window+recall16"]
    window, recalled = rows[1], rows[2]
    assert recalled["context_tokens"] == window["context_tokens"] == 300
    assert recalled["decode_vs_method"] == recalled["decode_tok_s"] / window["decode_tok_s"]
    assert recalled["ttft_vs_method"] > 0 and recalled["next_turn_vs_method"] > 0
    assert window["next_turn_ttft_s"] > 0 and "decode_vs_method" not in window
    assert recalled["kv_mb"] > window["kv_mb"]  # the tier's key index in RAM: tokens went cold
    # Side by side: each row's decode and later turn are medians of rounds taken in turn.
    assert window["rounds"] == recalled["rounds"] == speed.PAIRED_ROUNDS


def test_without_recall_values_the_method_rows_are_alone(engine):
    rows = speed.part_methods(engine, engine.model, ["window"], [64], "64", None, None, settings=SMALL, new_tokens=2)
    assert [r["method"] for r in rows] == ["generate (fp32)", "window"]


def test_each_methods_hyperparameters_reach_its_rows(engine):
    """`kvchat bench speed --subgen-mode stream` measures subgen in stream mode: its
    numerator and denominator samples are held as more entries per KV head than the
    kcenter default's one per kept token."""
    entries = {}
    for mode in ("kcenter", "stream"):
        rows = speed.part_methods(
            engine,
            engine.model,
            ["subgen"],
            [300],
            "64",
            None,
            None,
            settings=SMALL,
            method_params={"subgen": {"mode": mode}},
            new_tokens=2,
        )
        entries[mode] = rows[1]["entries_per_head"]
    assert entries["stream"] != entries["kcenter"], entries
