"""A saved session keeps its recall tier (kvchat/storage/cold.py), on the real embedded
model with a window of 16, so that most of a chat goes cold:

- a resumed session answers token for token as the same conversation held in one process
  (its tier read back exactly, its index rebuilt from the saved keys);
- a save after a resume writes only the rows that went cold since;
- a kill while a turn's rows are appended leaves the previous turn, whole, to resume;
- a branch resumes with the tier of the snapshot it copied;
- damaged rows resume with an empty tier, and say so; a snapshot that holds no tier
  resumes with an empty one, silently; so does a tier the disk budget dropped, saying
  so, and a rebuild reads it back;
- recall off saves no rows and no tier state.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest
import torch

from kvchat.chat import persist
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage.db import Store

pytestmark = pytest.mark.slow

QUESTIONS = [
    "The keeper of the lighthouse wrote down 41 ships on the first night. Remember it.",
    "On the second night he wrote down 17. What is the sum of the two nights?",
]
NEXT = "How many ships did he write down on the first night?"
TURN = SamplingSettings(max_new_tokens=8)


def small(method: str = "window", recall: int = 32) -> CacheSettings:
    return CacheSettings(method=method, budget="16", window=16, sinks=4, batch=8, recall=recall)


def two_turns(engine, store: Store, settings: CacheSettings):
    session = engine.new_session(settings)
    sid = persist.new_session_row(store, session, "t")
    for question in QUESTIONS:
        persist.save_turn(store, sid, session, question, session.send(question, TURN))
    return session, sid


def cold_table(db_path, sid: int) -> list[tuple[int, int, int]]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(
            "SELECT layer, start, rows FROM cold_rows WHERE session_id = ? ORDER BY layer, start", [sid]
        ).fetchall()


def tier_rows(session) -> list[int]:
    return [layer.recall.rows for layer in session.cache.compressed_layers]


def recalling(session) -> list:
    """The layers whose tier recalls (the model's retrieval layers): the only ones with rows."""
    return [layer for layer in session.cache.compressed_layers if layer.recalls]


@pytest.mark.parametrize("method", ["window", "h2o"])
def test_resume_with_recall_equals_the_same_conversation_held_in_one_process(engine, tmp_path, method):
    db_path = tmp_path / "kvchat.db"
    with Store(db_path) as store:
        original, sid = two_turns(engine, store, small(method))
    rows = tier_rows(original)
    assert min(layer.recall.rows for layer in recalling(original)) > 40  # most of the chat went cold
    assert sum(rows) == sum(layer.recall.rows for layer in recalling(original))  # kept where it is recalled
    with Store(db_path) as store:  # another Store, as a new process opens it
        resumed, info = persist.resume(store, engine, sid)
    assert info.note == "" and tier_rows(resumed) == rows
    assert resumed.cache.cold_bytes() == original.cache.cold_bytes()
    query = torch.randn(3, 3, 64)  # [KV heads, queries, channels]
    for mine, theirs in zip(original.cache.compressed_layers, resumed.cache.compressed_layers):
        assert theirs.recalls == mine.recalls
        if mine.recalls:
            assert torch.equal(theirs.recall.index.scores(query), mine.recall.index.scores(query))  # the same index
    # The next pass reads the tier: its logits are the same to the bit, and not what an
    # empty tier gives (short answers often agree token for token even then).
    probe = engine.tokenizer(NEXT, add_special_tokens=False).input_ids
    logits = [engine.forward(probe, cache.copy()) for cache in (original.cache, resumed.cache)]
    assert torch.equal(*logits)
    empty = resumed.cache.copy()
    empty.clear_cold()
    assert not torch.equal(engine.forward(probe, empty), logits[0])
    assert resumed.send(NEXT, TURN).token_ids == original.send(NEXT, TURN).token_ids
    assert resumed.cache.recalled() > 0


def test_a_save_after_resume_writes_only_the_rows_that_went_cold_since(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    with Store(db_path) as store:
        _, sid = two_turns(engine, store, small())
    before = cold_table(db_path, sid)
    with Store(db_path) as store:
        session, _ = persist.resume(store, engine, sid)
        saved = recalling(session)[0].recall.rows
        persist.save_turn(store, sid, session, NEXT, session.send(NEXT, TURN))
    after = cold_table(db_path, sid)
    new = [row for row in after if row not in before]
    assert len(new) == len(recalling(session))  # one blob per recalling layer: this turn's rows
    assert {start for _layer, start, _rows in new} == {saved}
    assert {start + rows for _layer, start, rows in new} == {recalling(session)[0].recall.rows}


CRASH_WHILE_APPENDING = """
import os, signal, sys
from kvchat.model.engine import Engine
from kvchat.model.loading import load_model
from kvchat.settings import SamplingSettings
from kvchat.chat import persist
from kvchat.storage import cold
from kvchat.storage.db import Store
engine = Engine(load_model(device="cpu", dtype="float32"))  # as the `engine` fixture
store = Store(sys.argv[1])
session, _ = persist.resume(store, engine, int(sys.argv[2]))
result = session.send("And on the third night?", SamplingSettings(max_new_tokens=8))
real_insert, calls = cold._insert, []
def insert_then_die(*args):
    calls.append(1)
    if len(calls) == 5:  # four layers' new rows are in the open transaction
        os.kill(os.getpid(), signal.SIGKILL)
    return real_insert(*args)
cold._insert = insert_then_die
persist.save_turn(store, int(sys.argv[2]), session, "And on the third night?", result)
raise SystemExit("save_turn returned; the kill did not happen")
"""


def test_a_kill_mid_append_leaves_a_consistent_session(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    with Store(db_path) as store:
        original, sid = two_turns(engine, store, small())
    before = cold_table(db_path, sid)
    messages = list(original.messages)
    expected = original.send(NEXT, TURN).token_ids
    done = subprocess.run(
        [sys.executable, "-c", CRASH_WHILE_APPENDING, str(db_path), str(sid)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == -9, done.stderr[-2000:]
    assert cold_table(db_path, sid) == before  # nothing of the killed turn
    with Store(db_path) as store:
        resumed, info = persist.resume(store, engine, sid)
    assert info.note == "" and resumed.messages == messages
    assert resumed.send(NEXT, TURN).token_ids == expected


def test_a_branch_resumes_with_the_tier_of_the_snapshot_it_copied(engine, tmp_path):
    with Store(tmp_path / "kvchat.db") as store:
        original, sid = two_turns(engine, store, small())
        made = store.branch_session(sid, 2)
        branch, info = persist.resume(store, engine, made.session_id)
        assert made.snapshot and not info.rebuilt and info.note == ""
        assert tier_rows(branch) == tier_rows(original)
        store.delete_session(sid)  # the branch's tier is its own
        again, info = persist.resume(store, engine, made.session_id)
    assert info.note == "" and tier_rows(again) == tier_rows(original)
    assert again.send(NEXT, TURN).token_ids == original.send(NEXT, TURN).token_ids


def test_damaged_rows_resume_with_an_empty_tier_and_say_so(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    with Store(db_path) as store:
        _, sid = two_turns(engine, store, small())
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE cold_rows SET blob = x'00' WHERE layer = 6")  # a retrieval layer's
    with Store(db_path) as store:
        resumed, info = persist.resume(store, engine, sid)
    assert "recall tier starts empty" in info.note and "unreadable at layer 6" in info.note
    assert "recall tier starts empty" in info.describe()
    assert set(tier_rows(resumed)) == {0}
    assert resumed.send(NEXT, TURN).token_ids  # and the chat goes on, filling it again
    assert min(layer.recall.rows for layer in recalling(resumed)) > 0


def test_a_tier_the_disk_budget_dropped_resumes_empty_says_why_and_a_rebuild_brings_it_back(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    with Store(db_path, disk_budget=1) as store:
        original, sid = two_turns(engine, store, small())
        newer = store.create_session("newer", "fp", "window", {})
        assert store.fit_disk_budget(keep=newer).sessions == (sid,)
        resumed, info = persist.resume(store, engine, sid)
        assert (
            info.note
            == "its recall tier starts empty: the disk budget dropped it (a rebuild reads it again from the transcript)"
        )
        assert set(tier_rows(resumed)) == {0}
        assert resumed.send(NEXT, TURN).token_ids  # and the chat goes on, filling it again
        rebuilt, _ = persist.rebuild(store, engine, sid, small())
        # The whole transcript again (one prefill: its batches end elsewhere than the turns' did).
        assert min(layer.recall.rows for layer in recalling(rebuilt)) > 0.9 * min(
            layer.recall.rows for layer in recalling(original)
        )
        assert store.get_session(sid).cold_bytes > 0 and store.get_session(sid).tier_dropped is None


def test_rows_saved_for_every_layer_are_read_back(engine, tmp_path):
    # A session saved while every layer, not only the retrieval layers, kept cold rows
    # resumes with all of them.
    db_path = tmp_path / "kvchat.db"
    chosen = engine.measured("recall_layers")
    engine._measured["recall_layers"] = list(range(len(engine.loaded.model.model.layers)))
    try:
        with Store(db_path) as store:
            original, sid = two_turns(engine, store, small())
    finally:
        engine._measured["recall_layers"] = chosen
    assert min(tier_rows(original)) > 40
    with Store(db_path) as store:
        resumed, info = persist.resume(store, engine, sid)
    assert info.note == "" and tier_rows(resumed) == tier_rows(original)
    assert [i for i, layer in enumerate(resumed.cache.compressed_layers) if layer.recalls] == chosen
    assert resumed.send(NEXT, TURN).token_ids


def test_a_tier_saved_as_exact_rows_resumes_with_them_quantised(engine, tmp_path):
    # Tiers once saved each row exact, [2, H, d] in the model's dtype, its key rotated for
    # where its token sat: such a session resumes with those rows kept as tiers keep them now.
    import safetensors.torch

    db_path = tmp_path / "kvchat.db"
    with Store(db_path) as store:
        original, sid = two_turns(engine, store, small())
    exact = {}
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM cold_rows WHERE session_id = ?", [sid])
        for index, layer in enumerate(original.cache.compressed_layers):
            if layer.recalls:
                every = torch.arange(layer.recall.rows).expand(layer.recall.heads, -1)
                exact[index] = layer.recall.read(every)
                rows = torch.stack(exact[index]).permute(2, 0, 1, 3).contiguous()  # [n, 2, H, d]
                blob = safetensors.torch.save({"rows": rows})
                conn.execute(
                    "INSERT INTO cold_rows (session_id, layer, start, rows, blob) VALUES (?, ?, 0, ?, ?)",
                    [sid, index, rows.shape[0], blob],
                )
    with Store(db_path) as store:
        resumed, info = persist.resume(store, engine, sid)
    assert info.note == "" and tier_rows(resumed) == tier_rows(original)
    for index, (keys, values) in exact.items():
        tier = resumed.cache.compressed_layers[index].recall
        got_keys, got_values = tier.read(torch.arange(tier.rows).expand(tier.heads, -1))
        # within a step of the 8-bit keys and the 4-bit values they were kept in
        key_step = keys.abs().amax(-1, keepdim=True) / 127
        value_step = (values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)) / 15
        assert bool(((got_keys - keys).abs() <= key_step).all())
        assert bool(((got_values - values).abs() <= value_step).all())
    assert resumed.send(NEXT, TURN).token_ids == original.send(NEXT, TURN).token_ids


def test_a_session_saved_before_tiers_were_saved_resumes_with_an_empty_tier(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    session = engine.new_session(small())
    session.send(QUESTIONS[0], TURN)
    with Store(db_path) as store:
        sid = persist.new_session_row(store, session, "old")
        # What kvchat saved then: layer states without the tier's keys, and no rows.
        states = [
            {k: v for k, v in state.items() if not k.startswith("recall.")} for state in session.cache.layer_states()
        ]
        store.save_turn(sid, [], 1, persist.snapshot_meta(session), states)
        resumed, info = persist.resume(store, engine, sid)
    assert info.note == "" and set(tier_rows(resumed)) == {0}


def test_recall_off_saves_no_rows_and_no_tier_state(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    with Store(db_path) as store:
        session, sid = two_turns(engine, store, small(recall=0))
        assert session.cache.cold_rows() is None
        assert not any(k.startswith("recall.") for state in session.cache.layer_states() for k in state)
        resumed, info = persist.resume(store, engine, sid)
    assert cold_table(db_path, sid) == [] and info.note == ""
    assert all(layer.recall is None for layer in resumed.cache.compressed_layers)
