"""The controller on the real embedded model and real SQLite files, without Textual:
what the app does besides drawing."""

from __future__ import annotations

import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from kvchat import compress
from kvchat.chat.controller import Controller
from kvchat.errors import Cancelled, CommandError, SnapshotMismatch
from kvchat.settings import CacheSettings, SamplingSettings, human_size
from kvchat.storage.db import Store
from kvchat.tui.slash import SlashCommand, parse_input

# sinks 4 + window 16 + middle 16 per KV head: a chat prompt alone overflows it.
SMALL = dict(method="window", budget="16", window=16, sinks=4, batch=16, prefill_mode="streaming")

METHODS = compress.available()


@pytest.fixture(scope="module")
def engine(embedded):
    from kvchat.model.engine import Engine

    return Engine(embedded)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "kvchat.db"
    Store(path).close()  # created and migrated, as the CLI does before the app starts
    return path


OPENED: list[Store] = []


@pytest.fixture(autouse=True)
def close_stores():
    yield
    while OPENED:
        OPENED.pop().close()


def opened(db: Path | None) -> Store | None:
    """The one store a controller holds for a process (closed after the test)."""
    if db is None:
        return None
    OPENED.append(Store(db))
    return OPENED[-1]


def controller(engine, db: Path | None, max_new_tokens: int = 8, **cache) -> Controller:
    return Controller(
        engine, opened(db), CacheSettings(**{**SMALL, **cache}), SamplingSettings(max_new_tokens=max_new_tokens)
    )


# -- typed commands (no model) -----------------------------------------------------------
def test_parse_input_tells_commands_from_messages():
    assert parse_input("  hello ", METHODS) == "hello"
    assert parse_input("//etc/hosts is a path", METHODS) == "/etc/hosts is a path"
    assert parse_input("/file notes.txt", METHODS) == SlashCommand("file", "notes.txt")
    assert parse_input("/method h2o", METHODS) == SlashCommand("method", "h2o")
    assert parse_input("/sessions", METHODS) == SlashCommand("sessions")
    assert parse_input("/new", METHODS) == SlashCommand("new_session")


def test_parse_input_refuses_unknown_commands_and_methods_with_the_way_out():
    with pytest.raises(CommandError, match=r"Unknown command /frobnicate; try /file PATH.*start with //"):
        parse_input("/frobnicate now", METHODS)
    with pytest.raises(CommandError, match=r"Unknown method 'nope'; choose one of: full, window"):
        parse_input("/method nope", METHODS)


# -- the model -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_loader_runs_once_and_only_when_asked(engine, db):
    calls = []

    def loader():
        calls.append(threading.current_thread().name)
        return engine

    chat = Controller(loader, opened(db), CacheSettings(**SMALL), SamplingSettings(max_new_tokens=4))
    assert calls == [] and not chat.ready and chat.stats() is None
    assert chat.load(timeout=60)
    assert chat.load(timeout=60)
    assert calls == ["kvchat-model-load"] and chat.ready
    assert chat.stats().tokens_seen == 0


@pytest.mark.slow
def test_a_failing_loader_raises_its_error_to_whoever_waits(db):
    def loader():
        raise FileNotFoundError("no such model: nope.gguf")

    chat = Controller(loader, opened(db), CacheSettings(**SMALL), SamplingSettings())
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        chat.load(timeout=30)


# -- turns -------------------------------------------------------------------------------
@pytest.mark.slow
def test_send_streams_answers_and_saves_the_turn(engine, db):
    chat = controller(engine, db)
    pieces: list[str] = []
    outcome = chat.send("Name a colour.", on_token=pieces.append)
    result = outcome.result
    assert outcome.save_error is None
    assert result.text.strip() and "".join(pieces).strip() == result.text.strip()
    conv = chat.conversation
    assert conv.session_id is not None and conv.title == "Name a colour."
    with Store(db) as store:
        assert [m.role for m in store.messages(conv.session_id)] == ["user", "assistant"]
        assert store.load_snapshot(conv.session_id) is not None
    stats = chat.stats()
    assert stats.entries_per_head < stats.tokens_seen  # compression really happened


@pytest.mark.slow
def test_send_puts_the_document_before_the_question(engine, db):
    chat = controller(engine, db, max_new_tokens=4)
    chat.send("What is it about?", "A note about red apples.")
    assert chat.conversation.session.messages[0]["content"] == "A note about red apples.\n\nWhat is it about?"


@pytest.mark.slow
def test_cancel_keeps_the_partial_answer_and_saves_it(engine, db):
    chat = controller(engine, db, max_new_tokens=200)
    cancel = threading.Event()
    pieces: list[str] = []

    def on_token(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            cancel.set()

    outcome = chat.send("Write a long story about a dragon.", on_token=on_token, cancel=cancel)
    assert outcome.result.stop_reason == "cancelled" and 0 < outcome.result.metrics.new_tokens < 200
    with Store(db) as store:
        stored = store.messages(chat.conversation.session_id)
    assert [m.role for m in stored] == ["user", "assistant"] and stored[1].text == outcome.result.text


@pytest.mark.slow
def test_without_a_database_nothing_is_saved_or_listed(engine):
    chat = controller(engine, None, max_new_tokens=4)
    assert chat.send("Hi").save_error is None
    assert chat.conversation.session_id is None and chat.list_sessions() == []


# -- switching, rebuilding, forking --------------------------------------------------------
@pytest.mark.slow
def test_switch_method_restreams_and_saves_the_new_method(engine, db):
    chat = controller(engine, db)
    chat.send("Name a colour.")
    assert chat.next_method() == "h2o"  # the picker's order: full, window, h2o, ...
    outcome = chat.switch_method("h2o")
    assert outcome.method == "h2o" and outcome.save_error is None and outcome.kv_bytes_after > 0
    assert chat.method == "h2o" and chat.stats().method == "h2o"
    with Store(db) as store:
        assert store.get_session(chat.conversation.session_id).method == "h2o"
    chat.new_session()
    assert chat.method == "h2o"  # a new session keeps the method switched to


@pytest.mark.slow
def test_rebuild_rereads_every_token_and_can_be_cancelled(engine, db):
    chat = controller(engine, db)
    chat.send("Name a colour.")
    tokens = len(chat.conversation.session.token_ids)
    progress: list[tuple[int, int]] = []
    outcome = chat.rebuild(lambda done, total: progress.append((done, total)))
    assert outcome.tokens == tokens and outcome.save_error is None
    assert progress and progress[-1] == (tokens, tokens)
    process = ("rss_bytes", "cuda_bytes")  # the process's memory, not the cache's
    before = {key: value for key, value in asdict(chat.stats()).items() if key not in process}
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        chat.rebuild(cancel=cancel)
    after = {key: value for key, value in asdict(chat.stats()).items() if key not in process}
    assert after == before  # the previous cache is kept


@pytest.mark.slow
def test_fork_continues_a_copy_under_another_method(engine, db):
    chat = controller(engine, db)
    chat.send("Name a colour.")
    original = chat.conversation
    fork = chat.fork("h2o")
    assert fork is chat.conversation and fork.session_id is None
    assert fork.session.messages == original.session.messages and fork.session.settings.method == "h2o"
    assert original.session.settings.method == "window"
    chat.send("Another one?")
    assert len(original.session.messages) == 2 and len(fork.session.messages) == 4
    assert fork.session_id != original.session_id  # saved as a session of its own
    with Store(db) as store:  # with the whole transcript, the turn before the fork included
        saved = [(m.role, m.text) for m in store.messages(fork.session_id)]
    assert saved == [(m["role"], m["content"]) for m in fork.session.messages]


# -- one question under several methods -------------------------------------------------
@pytest.mark.slow
def test_compare_asks_the_last_question_again_from_where_it_was_asked(engine, db):
    chat = controller(engine, db, method="full", prefill_mode="auto")
    chat.send("Name a colour.")
    chat.send("And a fruit?")
    session = chat.conversation.session
    messages, tokens = [dict(m) for m in session.messages], list(session.token_ids)
    comparison = chat.compare(["full", "window"])
    # `full` drops nothing: reading the first turn back exactly gives the same answer.
    assert [a.method for a in comparison.answers] == ["full", "window"]
    assert comparison.answers[0].answer == messages[-1]["content"]
    assert comparison.answers[1].session.messages[:-1] == messages[:-1]  # same question, same past
    assert session.messages == messages and session.token_ids == tokens  # the open conversation is untouched
    with Store(db) as store:
        assert store.get_session(chat.conversation.session_id).message_count == 4  # nothing saved


@pytest.mark.slow
def test_continue_with_a_compared_answer_opens_it_as_a_new_session(engine, db):
    chat = controller(engine, db, prefill_mode="auto")
    chat.send("Name a colour.")
    original_id = chat.conversation.session_id
    comparison = chat.compare(["window", "h2o"])
    chosen = chat.continue_with("h2o")
    assert chosen is chat.conversation and chosen.session_id is None and chat.method == "h2o"
    assert chosen.session.messages[-1]["content"] == comparison.answers[1].answer
    spans = chosen.session.spans  # its memory map knows its messages
    assert spans[0].start == 0 and spans[-1].end == len(chosen.session.token_ids)
    assert [s.role for s in spans][-2:] == ["user", "assistant"]
    assert spans[-1].message == len(chosen.session.messages) - 1
    chat.send("Another one?")
    assert chat.conversation.session_id != original_id  # saved as a session of its own on its next turn
    with Store(db) as store:
        assert store.get_session(original_id).message_count == 2  # the original stays as it was saved
        assert store.get_session(chat.conversation.session_id).method == "h2o"
    assert chat.compare(["window"]).answers[0].answer  # the new last question can be compared again


@pytest.mark.slow
def test_compare_before_any_question_says_what_to_do(engine, db):
    chat = controller(engine, db)
    with pytest.raises(ValueError, match="ask a question first"):
        chat.compare(["window", "h2o"])


# -- saved sessions ----------------------------------------------------------------------
@pytest.mark.slow
def test_resume_restores_the_saved_cache_without_prefill(engine, db):
    first = controller(engine, db)
    first.send("Name a colour.")
    saved_id, saved = first.conversation.session_id, first.stats()
    again = controller(engine, db)
    assert again.last_session_id() == saved_id
    calls = engine.forward_calls
    outcome = again.resume(saved_id)
    assert engine.forward_calls == calls  # no prefill
    assert outcome.session_id == saved_id and outcome.title == "Name a colour."
    assert [m["role"] for m in outcome.messages] == ["user", "assistant"]
    assert outcome.info is not None and not outcome.info.rebuilt
    assert again.stats().tokens_seen == saved.tokens_seen
    again.send("Another one?")
    with Store(db) as store:
        assert store.get_session(saved_id).message_count == 4


@pytest.mark.slow
def test_later_turns_are_saved_as_deltas_that_resume_to_the_same_answer(engine, db):
    chat = controller(engine, db, max_new_tokens=6)
    chat.send("Name a colour.")
    chat.send("And another one?")
    session_id = chat.conversation.session_id
    with Store(db) as store:
        parents = [
            row["parent_id"]
            for row in store.db.query("SELECT parent_id FROM snapshots WHERE session_id = ? ORDER BY id", [session_id])
        ]
    assert len(parents) == 2 and parents[0] is None and parents[1] is not None  # the second turn is a delta
    held = chat.conversation.session.fork()  # the conversation as this process holds it
    again = controller(engine, db, max_new_tokens=6)
    again.resume(session_id)
    expected = held.send("Name a third.", SamplingSettings(max_new_tokens=6)).token_ids
    assert again.send("Name a third.").result.token_ids == expected


@pytest.mark.slow
def test_ask_s_fallback_rebuilds_a_snapshot_that_does_not_fit(engine, db):
    with Store(db) as store:
        session_id = store.create_session("Old chat", "another-model", "window", {})
        store.add_message(session_id, "user", "Name a colour.", [])
        store.add_message(session_id, "assistant", "Blue.", [])
    outcome = controller(engine, db).open_saved(session_id)
    assert outcome.info.rebuilt and outcome.info.reason == "the session has no saved cache yet"


@pytest.mark.slow
def test_a_session_without_snapshot_is_refused_then_rebuilt_from_its_transcript(engine, db):
    with Store(db) as store:
        session_id = store.create_session("Old chat", "another-model", "window", {})
        store.add_message(session_id, "user", "Name a colour.", [])
        store.add_message(session_id, "assistant", "Blue.", [])
    chat = controller(engine, db)
    with pytest.raises(SnapshotMismatch):
        chat.resume(session_id)
    outcome = chat.rebuild_saved(session_id, "no snapshot")
    assert outcome.info.rebuilt and outcome.info.tokens > 0
    assert [m["content"] for m in outcome.messages] == ["Name a colour.", "Blue."]
    assert chat.conversation.session_id == session_id
    calls = engine.forward_calls
    controller(engine, db).resume(session_id)  # the rebuild was saved
    assert engine.forward_calls == calls


@pytest.mark.slow
def test_rename_and_delete_sessions(engine, db):
    chat = controller(engine, db, max_new_tokens=4)
    chat.send("First chat")
    first = chat.conversation.session_id
    chat.new_session()
    chat.send("Second chat")
    second = chat.conversation.session_id
    chat.rename_session(second, "Renamed")
    assert chat.conversation.title == "Renamed"
    assert {r.id: r.title for r in chat.list_sessions()} == {first: "First chat", second: "Renamed"}
    assert chat.delete_session(first) is False  # not the open one: the conversation stays
    assert chat.conversation.session_id == second
    assert chat.delete_session(second) is True  # the open one: a fresh conversation replaces it
    assert chat.conversation.session_id is None and chat.list_sessions() == []


@pytest.mark.slow
def test_a_turn_past_the_disk_budget_drops_an_older_session_s_tier_and_says_so(engine, db):
    from store_helpers import cold_layers

    store = Store(db, disk_budget=1)  # any save passes it
    OPENED.append(store)
    older = store.create_session("older", "fp", "window", {})
    store.save_turn(older, [], 1, {}, [{}], cold_rows=cold_layers(1, 300))
    held = store.get_session(older).cold_bytes
    notes: list[str] = []
    chat = Controller(
        engine, store, CacheSettings(**SMALL), SamplingSettings(max_new_tokens=4), on_disk_note=notes.append
    )
    chat.send("Hello there")
    assert len(notes) == 1
    assert notes[0].startswith(f"disk budget 1 B: dropped the recall tier of 1 older session ({human_size(held)}); ")
    assert "the sessions still take" in notes[0]  # the new session's transcript and cache alone pass 1 byte
    row = store.get_session(older)
    assert row.cold_bytes == 0 and row.tier_dropped is not None
    assert store.get_session(chat.conversation.session_id).tier_dropped is None  # never the one just saved
    chat.send("And again")
    assert len(notes) == 1  # nothing more to drop: nothing more said


def test_the_disk_budget_line_names_the_budget_the_sessions_and_the_bytes():
    from kvchat.chat.controller import disk_budget_line
    from kvchat.storage.rows import TierDrop

    assert disk_budget_line(TierDrop(2 * 10**9, (3, 4), 410 * 10**6, 10**9)) == (
        "disk budget 2.0 GB: dropped the recall tiers of 2 older sessions (410.0 MB)"
    )
    assert disk_budget_line(TierDrop(10**9, (3,), 10**6, 10**8)) == (
        "disk budget 1.0 GB: dropped the recall tier of 1 older session (1.0 MB)"
    )
    over = disk_budget_line(TierDrop(10**6, (3,), 10**6, 3 * 10**6))
    assert over.endswith(
        "; the sessions still take 3.0 MB: delete some (`kvchat sessions list` shows their sizes) or raise disk_budget"
    )
