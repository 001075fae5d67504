"""Branches: a new session that shares a saved one's first N turns, on
real SQLite files (the store, the migration, `kvchat sessions branch`) and on the real
embedded model (the branch's cache, copied or rebuilt from the transcript; edit and
regenerate through the controller).

A turn is one user message and its answer, numbered from 1 in transcript order; a
branch "at N" holds the first N turns (0: none)."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest
import torch
from sqlite_utils import Database

from kvchat.chat.controller import Controller
from kvchat.cli import main
from kvchat.errors import Cancelled, StoreError
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage.db import Store
from kvchat.storage.migrations import SCHEMA_VERSION, m001_initial, m002_snapshot_parent, m003_message_search

TRANSCRIPT = [
    ("user", "Where do penguins live?"),
    ("assistant", "Around Antarctica."),
    ("user", "And puffins?"),
    ("assistant", "In the North Atlantic."),
    ("user", "Which one is bigger?"),
    ("assistant", "The emperor penguin."),
]


def layers(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"k": torch.randn(2, 8, 4, generator=gen), "n": i} for i in range(3)]


def saved_chat(store: Store, title: str = "Birds", snapshot_turn: int | None = 3) -> int:
    """A session with the three turns of TRANSCRIPT and, unless None, a snapshot of
    `snapshot_turn`."""
    sid = store.create_session(title, "fp", "window", {"method": "window", "system": "Be brief."})
    for number, (role, text) in enumerate(TRANSCRIPT):
        store.add_message(sid, role, text, [number, number + 1], {"n": number})
    if snapshot_turn is not None:
        store.save_snapshot(sid, snapshot_turn, {"tokens_seen": 60}, layers(0))
    return sid


def texts(store: Store, session_id: int) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in store.messages(session_id)]


# -- the store ----------------------------------------------------------------------------
def test_a_branch_holds_the_first_n_turns_and_records_its_origin(store: Store) -> None:
    sid = saved_chat(store)
    made = store.branch_session(sid, 2)
    assert made.origin_id == sid and made.at == 2 and made.session_id != sid
    assert texts(store, made.session_id) == TRANSCRIPT[:4]
    copied = store.messages(made.session_id)
    assert [(m.token_ids, m.metrics) for m in copied] == [([n, n + 1], {"n": n}) for n in range(4)]
    row = store.get_session(made.session_id)
    assert (row.origin_id, row.origin_turn) == (sid, 2)
    assert row.origin() == f"branch of #{sid} at turn 2"
    original = store.get_session(sid)
    assert (row.title, row.method, row.params) == (original.title, original.method, original.params)
    assert original.origin() == "" and original.origin_id is None


def test_the_original_stays_as_it_was_saved(store: Store, db_path: Path) -> None:
    sid = saved_chat(store)
    before = texts(store, sid), store.load_snapshot(sid)
    store.branch_session(sid, 1)
    store.branch_session(sid, 3)
    after = texts(store, sid), store.load_snapshot(sid)
    assert after[0] == before[0]
    assert after[1].id == before[1].id and after[1].meta == before[1].meta


def test_the_transcript_numbers_turns_as_branch_counts_them_and_names_the_origin(store: Store) -> None:
    sid = saved_chat(store)
    md = store.export_session(store.branch_session(sid, 2).session_id, "md")
    assert f"- branch of #{sid} at turn 2\n" in md
    assert "## user (turn 1)\n\nWhere do penguins live?" in md and "## user (turn 2)\n\nAnd puffins?" in md
    assert "turn 3" not in md and "## assistant\n\nIn the North Atlantic." in md


def test_a_branch_at_an_earlier_turn_gets_no_snapshot(store: Store) -> None:
    sid = saved_chat(store)
    made = store.branch_session(sid, 1)
    assert made.snapshot is False  # only the last turn's state is saved: rebuild it
    assert store.load_snapshot(made.session_id) is None
    assert store.get_session(made.session_id).tokens == 0


def test_a_branch_at_the_last_turn_copies_the_snapshot_chain(store: Store) -> None:
    sid = saved_chat(store)
    store.load_snapshot(sid)
    store.save_snapshot(sid, 3, {"tokens_seen": 64}, layers(1))  # a delta on the first
    assert store.db.execute("SELECT count(*) FROM snapshots WHERE session_id = ?", [sid]).fetchone()[0] == 2
    made = store.branch_session(sid, 3)
    assert made.snapshot is True
    got = store.load_snapshot(made.session_id)
    assert got is not None and got.meta == {"tokens_seen": 64} and got.turn == 3
    for mine, want in zip(got.layers, layers(1), strict=True):
        assert torch.equal(mine["k"], want["k"]) and mine["n"] == want["n"]
    assert store.get_session(made.session_id).tokens == 64
    # The two chains are apart: the original's next save does not touch the copy.
    store.save_snapshot(sid, 4, {"tokens_seen": 80}, layers(2))
    assert store.load_snapshot(made.session_id).meta == {"tokens_seen": 64}


def test_a_snapshot_of_another_turn_is_not_copied(store: Store) -> None:
    sid = saved_chat(store, snapshot_turn=2)  # a save of turn 3 failed, say
    made = store.branch_session(sid, 3)
    assert made.snapshot is False and store.load_snapshot(made.session_id) is None


def test_a_turn_stopped_before_its_answer_counts_as_a_turn(store: Store) -> None:
    sid = store.create_session("t", "fp", "window", {})
    for role, text in [("user", "one"), ("user", "two, stopped"), ("user", "three"), ("assistant", "3")]:
        store.add_message(sid, role, text, [])
    assert texts(store, store.branch_session(sid, 2).session_id) == [("user", "one"), ("user", "two, stopped")]
    assert texts(store, store.branch_session(sid, 0).session_id) == []


@pytest.mark.parametrize("at", [-1, 4])
def test_a_turn_the_session_does_not_have_is_a_clear_error_and_writes_nothing(store: Store, at: int) -> None:
    sid = saved_chat(store)
    with pytest.raises(StoreError) as err:
        store.branch_session(sid, at)
    assert str(err.value) == (
        f"session {sid} has turns 1 to 3, so it has no turn {at} to branch at; give a turn from 0 "
        "(before the first message) to 3"
    )
    assert [r.id for r in store.list_sessions()] == [sid]


def test_branching_an_unknown_session_is_a_clear_error(store: Store) -> None:
    with pytest.raises(StoreError, match=r"^no session 42; `kvchat sessions list` shows the saved ones$"):
        store.branch_session(42, 0)


def test_a_branch_outlives_its_original_as_a_branch_of_a_deleted_session(store: Store) -> None:
    sid = saved_chat(store)
    branch = store.branch_session(sid, 2).session_id
    store.delete_session(sid)
    row = store.get_session(branch)
    assert (row.origin_id, row.origin_turn) == (None, 2)
    assert row.origin() == "branch of a deleted session at turn 2"
    assert texts(store, branch) == TRANSCRIPT[:4]


def test_the_copied_messages_are_searchable(store: Store) -> None:
    sid = saved_chat(store)
    branch = store.branch_session(sid, 1).session_id
    assert [r.id for r in store.search("penguins")] == [branch, sid]  # newest first
    assert [r.id for r in store.search("puffins")] == [sid]  # after the branch point


# -- the migration --------------------------------------------------------------------------
def test_a_database_from_before_branches_gains_the_origin_columns_and_loses_nothing(db_path: Path) -> None:
    db = Database(db_path)  # what kvchat wrote with schema 3 (m001 .. m003)
    db["_migrations"].create({"name": str, "applied_at": str}, pk="name")
    for migration in (m001_initial, m002_snapshot_parent, m003_message_search):
        migration(db)
        db["_migrations"].insert({"name": migration.__name__, "applied_at": "2026-01-01"})
    db["sessions"].insert(
        {
            "id": 1,
            "title": "old",
            "model_fingerprint": "m",
            "method": "full",
            "params": "{}",
            "created": "2026-01-01",
            "updated": "2026-01-02",
        }
    )
    for role, text in TRANSCRIPT:
        db["messages"].insert(
            {"session_id": 1, "role": role, "text": text, "token_ids": "[1]", "metrics": "{}", "created": "2026-01-01"}
        )
    db["snapshots"].insert({"id": 1, "session_id": 1, "turn": 3, "meta": '{"tokens_seen": 9}', "created": "x"})
    tables = ("sessions", "messages", "snapshots", "snapshot_tensors")
    before = {t: db.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in tables}
    db.conn.close()

    with Store(db_path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        columns = [c[1] for c in s.db.execute("PRAGMA table_info(sessions)").fetchall()]
        assert columns[7:9] == ["origin_session_id", "origin_turn"]
        for table, rows in before.items():
            width = len(rows[0]) if rows else 0
            assert [r[:width] for r in s.db.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()] == rows
        (row,) = s.list_sessions()
        assert (row.origin_id, row.origin_turn, row.origin(), row.message_count) == (None, None, "", 6)
        assert [r.id for r in s.search("puffins")] == [1]  # the index of m003 is untouched
        made = s.branch_session(1, 3)  # and an old session branches like any
        assert made.snapshot and s.get_session(made.session_id).origin() == "branch of #1 at turn 3"
    with Store(db_path) as s:  # opened again: nothing re-applied
        assert s.schema_version() == SCHEMA_VERSION
        names = [r[0] for r in s.db.execute("SELECT name FROM _migrations").fetchall()]
        assert names[3:5] == ["m004_session_origin", "m005_cold_rows"] and len(names) == SCHEMA_VERSION


# -- kvchat sessions (no model) ------------------------------------------------------------
def sessions_cli(capsys, db_path: Path, *args: str) -> tuple[int, str, str]:
    code = main(["sessions", *args, "--db", str(db_path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_branch_at_the_last_turn_copies_the_cache_without_the_model(db_path: Path, capsys) -> None:
    with Store(db_path) as s:
        sid = saved_chat(s)
    code, out, err = sessions_cli(capsys, db_path, "branch", str(sid), "--at", "3")
    assert (code, err) == (0, "")
    assert out == f"session {sid + 1}: branch of session {sid} at turn 3; copied the saved cache of turn 3\n"
    code, out, _ = sessions_cli(capsys, db_path, "list")
    first, second, _total = out.splitlines()
    assert first.startswith(f"{sid + 1:>4}  ") and first.endswith(f"Birds  (branch of #{sid} at turn 3)")
    assert second.startswith(f"{sid:>4}  ") and second.endswith("Birds")


@pytest.mark.parametrize(
    ("args", "cause"),
    [
        (["7", "--at", "1"], "no session 7; `kvchat sessions list` shows the saved ones"),
        (
            ["1", "--at", "5"],
            (
                "session 1 has turns 1 to 3, so it has no turn 5 to branch at; give a turn from 0 "
                "(before the first message) to 3"
            ),
        ),
    ],
)
def test_cli_branch_errors_are_one_line_with_exit_code_2(db_path: Path, capsys, args: list[str], cause: str) -> None:
    with Store(db_path) as s:
        saved_chat(s)
    code, out, err = sessions_cli(capsys, db_path, "branch", *args)
    assert (code, out, err) == (2, "", f"kvchat: error: {cause}\n")
    with Store(db_path) as s:
        assert len(s.list_sessions()) == 1


def test_cli_branch_needs_at(db_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:  # argparse's own exit, in kvchat's one-line style
        main(["sessions", "branch", "1", "--db", str(db_path)])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == "kvchat: error: the following arguments are required: --at (see `kvchat sessions branch --help`)\n"


# -- on the real model ------------------------------------------------------------------------
SMALL = {"method": "window", "budget": "16", "window": 16, "sinks": 4, "batch": 16, "prefill_mode": "streaming"}


@pytest.fixture(scope="module")
def engine(embedded):
    from kvchat.model.engine import Engine

    return Engine(embedded)


def chat(engine, store: Store, **cache) -> Controller:
    return Controller(engine, store, CacheSettings(**{**SMALL, **cache}), SamplingSettings(max_new_tokens=10))


def test_regenerating_in_a_branch_rebuilt_from_the_transcript_gives_the_same_answer(engine, store: Store) -> None:
    # `full` keeps every token, so a cache rebuilt from the transcript is the state the
    # original had after turn 1, exactly: greedy decoding answers turn 2 the same way.
    c = chat(engine, store, method="full")
    c.send("What is the capital of France?")
    second = c.send("And of Italy?").result.text
    original, ids = c.conversation.session_id, list(c.conversation.session.token_ids)
    calls = engine.forward_calls
    branched = c.branch(original, 1)
    assert engine.forward_calls > calls  # read again: there is no saved cache of turn 1
    assert branched.how.startswith("rebuilt ") and "(no saved cache of turn 1)" in branched.how
    assert c.conversation.session_id == branched.session_id != original
    assert ids[: len(c.conversation.session.token_ids)] == c.conversation.session.token_ids
    assert c.send("And of Italy?").result.text == second
    assert [m.text for m in store.messages(branched.session_id)][-2:] == ["And of Italy?", second]
    assert len(store.messages(original)) == 4  # the original as it was
    assert store.get_session(branched.session_id).origin() == f"branch of #{original} at turn 1"


def test_editing_the_first_message_branches_at_turn_0(engine, store: Store) -> None:
    c = chat(engine, store)
    c.send("What is the capital of France?")
    original = c.conversation.session_id
    branched = c.branch(original, 0)
    assert c.conversation.session.token_ids == [] and c.user_messages() == []
    c.send("What is the capital of Spain?")
    assert store.messages(branched.session_id)[0].text == "What is the capital of Spain?"
    assert c.user_messages() == ["What is the capital of Spain?"]
    assert store.messages(original)[0].text == "What is the capital of France?"


def test_a_branch_at_the_last_turn_opens_the_copied_cache_without_a_forward_pass(engine, store: Store) -> None:
    c = chat(engine, store)
    c.send("Name a colour.")
    c.send("Another one?")
    original, state = c.conversation.session_id, list(c.conversation.session.token_ids)
    calls = engine.forward_calls
    branched = c.branch(original, 2)
    assert engine.forward_calls == calls
    assert branched.how == "copied the saved cache of turn 2"
    assert branched.opened is not None and branched.opened.info is not None and not branched.opened.info.rebuilt
    assert c.conversation.session.token_ids == state
    assert c.send("And a third?").result.text.strip()
    assert store.snapshot_meta(original)["token_ids"] == state  # the original's cache is untouched


def test_a_stopped_branch_leaves_nothing_behind(engine, store: Store) -> None:
    c = chat(engine, store)
    c.send("Name a colour.")
    c.send("Another one?")
    original = c.conversation.session_id
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled):
        c.branch(original, 1, cancel=stop)
    assert [r.id for r in store.list_sessions()] == [original]
    assert c.conversation.session_id == original  # still the open conversation


def test_a_branch_of_a_snapshot_from_another_dtype_is_rebuilt(engine, store: Store) -> None:
    c = chat(engine, store)
    c.send("Name a colour.")
    original = c.conversation.session_id
    row = store.db.execute("SELECT id, meta FROM snapshots WHERE session_id = ?", [original]).fetchone()
    meta = json.loads(row[1])
    meta["dtype"] = "float16"
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE snapshots SET meta = ? WHERE id = ?", [json.dumps(meta), row[0]])
    branched = c.branch(original, 1)
    assert branched.how.startswith("rebuilt ") and "float16" in branched.how
    assert store.snapshot_meta(branched.session_id)["dtype"] == "float32"


def test_cli_branch_at_an_earlier_turn_rebuilds_the_cache(engine, db_path: Path, capsys) -> None:
    with Store(db_path) as s:
        c = chat(engine, s)
        c.send("Name a colour.")
        c.send("Another one?")
        original = c.conversation.session_id
    code, out, err = (
        main(
            [
                "sessions",
                "branch",
                str(original),
                "--at",
                "1",
                "--db",
                str(db_path),
                "--dtype",
                "float32",
                "--device",
                "cpu",
            ]
        ),
        *capsys.readouterr(),
    )
    assert code == 0 and "Traceback" not in err
    assert out.startswith(f"session {original + 1}: branch of session {original} at turn 1; rebuilt ")
    assert out.rstrip().endswith("(no saved cache of turn 1)")
    with Store(db_path) as s:
        assert s.get_session(original + 1).tokens > 0 and len(s.messages(original + 1)) == 2
