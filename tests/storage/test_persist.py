"""Saved sessions: resume from SQLite continues exactly, without recomputing the prefix."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from kvchat import compress
from kvchat.chat import persist
from kvchat.errors import SnapshotMismatch
from kvchat.model.engine import Engine
from kvchat.model.loading import load_model
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage.db import Store

QUESTIONS = ["Tell me about cats.", "What do they eat?", "And how long do they sleep?"]
NEXT = "Summarise what you said in one sentence."
# Small enough that every method really compresses within three turns.
SMALL = dict(budget="48", window=32, sinks=4, batch=16)
TURN = SamplingSettings(max_new_tokens=8)  # (93 tokens over three turns: every method keeps fewer)
CONTINUE = SamplingSettings(max_new_tokens=16)  # the turn after a resume, as in CONTINUE_IN_FRESH_PROCESS

CONTINUE_IN_FRESH_PROCESS = f"""
import json, sys
from kvchat.chat import persist
from kvchat.model.engine import Engine
from kvchat.settings import SamplingSettings
from kvchat.model.loading import load_model
from kvchat.storage.db import Store
engine = Engine(load_model(device="cpu", dtype="int8"))  # as this file's `engine` fixture
store = Store(sys.argv[1])
out = {{}}
for pair in sys.argv[2:]:
    method, sid = pair.split("=")
    session, _ = persist.resume(store, engine, int(sid))
    out[method] = session.send({NEXT!r}, SamplingSettings(max_new_tokens=16)).token_ids
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def engine(engine_fast):
    """The default CPU path (int8 weights, bf16 cache), which a saved session resumes on."""
    return engine_fast


def three_turns(engine, store, method):
    session = engine.new_session(CacheSettings(method=method, **SMALL))
    sid = persist.new_session_row(store, session, method)
    for q in QUESTIONS:
        persist.save_turn(store, sid, session, q, session.send(q, TURN))
    return session, sid


CRASH_WHILE_SAVING_A_DELTA = """
import os, signal, sys
from kvchat.chat import persist
from kvchat.storage import codec
from kvchat.model.engine import Engine
from kvchat.settings import SamplingSettings
from kvchat.model.loading import load_model
from kvchat.storage.db import Store
engine = Engine(load_model(device="cpu", dtype="int8"))  # as this file's `engine` fixture
store = Store(sys.argv[1], compact_share=100.0)  # the next save is a delta
session, _ = persist.resume(store, engine, int(sys.argv[2]))  # the store now knows the chain
result = session.send("And what about dogs?", SamplingSettings(max_new_tokens=16))
real_encode, calls = codec.encode_layer, []
def encode_then_die(layer, *rest):
    calls.append(1)
    if len(calls) == 5:  # four delta layers are in the open transaction
        os.kill(os.getpid(), signal.SIGKILL)
    return real_encode(layer, *rest)
codec.encode_layer = encode_then_die
persist.save_turn(store, int(sys.argv[2]), session, "And what about dogs?", result)
raise SystemExit("save_turn returned; the kill did not happen")
"""


def chain(db_path, sid):
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT parent_id FROM snapshots WHERE session_id = ? ORDER BY id", [sid]).fetchall()


def test_every_method_resumes_in_a_fresh_process_token_for_token(engine, tmp_path):
    # Short turns on a short session pass half the base at once; keep the chains for the test.
    store = Store(tmp_path / "kvchat.db", compact_share=100.0)
    expected, pairs = {}, []
    for method in compress.available():
        session, sid = three_turns(engine, store, method)
        if method != "full":
            assert session.cache.entries_per_head() < session.cache.tokens_seen  # it did compress
        expected[method] = session.send(NEXT, CONTINUE).token_ids
        pairs.append(f"{method}={sid}")
        # the first turn's snapshot is full, the next two are deltas on it
        assert [parent is None for (parent,) in chain(tmp_path / "kvchat.db", sid)] == [True, False, False]
    store.close()
    done = subprocess.run(
        [sys.executable, "-c", CONTINUE_IN_FRESH_PROCESS, str(tmp_path / "kvchat.db"), *pairs],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_resume_does_no_prefill_of_the_old_prefix(engine, tmp_path):
    store = Store(tmp_path / "kvchat.db")
    original, sid = three_turns(engine, store, "h2o")
    calls, fed = engine.forward_calls, engine.tokens_fed
    session, info = persist.resume(store, engine, sid)
    assert engine.forward_calls == calls and engine.tokens_fed == fed
    assert info.tokens == original.cache.tokens_seen and not info.rebuilt
    result = session.send(NEXT, TURN)
    # the next turn feeds its own prompt and its answer, nothing of the saved prefix
    assert engine.tokens_fed - fed == result.metrics.prompt_tokens + len(result.token_ids)


def test_a_snapshot_from_another_model_is_refused_and_can_be_rebuilt(engine, tmp_path, tiny_model_dir):
    store = Store(tmp_path / "kvchat.db")
    _, sid = three_turns(engine, store, "window")
    other = Engine(load_model(str(tiny_model_dir)))
    with pytest.raises(SnapshotMismatch, match="another model"):
        persist.resume(store, other, sid)
    engine.model.set_attn_implementation("kvchat")  # the tiny model shares the registry; keep ours
    session, info = persist.rebuild(store, other, sid, CacheSettings(method="window", **SMALL), reason="test")
    assert info.rebuilt and session.cache.tokens_seen > 0
    assert [m["content"] for m in session.messages if m["role"] == "user"] == QUESTIONS
    # after the rebuild the other model resumes from its own snapshot
    resumed, _ = persist.resume(store, other, sid)
    assert resumed.cache.tokens_seen == session.cache.tokens_seen


def test_stored_messages_carry_exactly_the_tokens_fed(engine, tmp_path):
    store = Store(tmp_path / "kvchat.db")
    session, sid = three_turns(engine, store, "window")
    stored = [t for row in store.messages(sid) for t in row.token_ids]
    assert stored == session.token_ids
    assert [row.role for row in store.messages(sid)] == ["user", "assistant"] * 3


def test_a_turn_stopped_during_prefill_is_saved_as_what_the_model_saw(engine, tmp_path):
    import threading

    from kvchat.calibration.realkv import essays_text

    store = Store(tmp_path / "kvchat.db")
    session, sid = three_turns(engine, store, "window")
    cancel = threading.Event()
    document = essays_text()[:12000]  # ~2,600 tokens: several prefill chunks
    result = session.send(document, TURN, on_progress=lambda done, total: cancel.set(), cancel=cancel)
    persist.save_turn(store, sid, session, document, result)
    assert result.stop_reason == "cancelled" and not result.token_ids
    assert 0 < len(result.prompt_ids) < result.metrics.prompt_tokens
    rows = store.messages(sid)
    assert [r.role for r in rows][-2:] == ["assistant", "user"]  # no empty answer stored
    assert [t for r in rows for t in r.token_ids] == session.token_ids
    assert rows[-1].text == session.messages[-1]["content"] and len(rows[-1].text) < len(document)
    # the session goes on from there
    assert session.send("Thanks.", TURN).metrics.new_tokens > 0


def test_a_kill_while_a_delta_is_written_resumes_the_previous_turn_token_for_token(engine, tmp_path):
    db_path = tmp_path / "kvchat.db"
    store = Store(db_path, compact_share=100.0)
    session, sid = three_turns(engine, store, "full")
    store.close()
    messages_before = list(session.messages)
    expected = session.send(NEXT, TURN).token_ids
    done = subprocess.run(
        [sys.executable, "-c", CRASH_WHILE_SAVING_A_DELTA, str(db_path), str(sid)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == -9, done.stderr[-2000:]
    store = Store(db_path)
    assert len(chain(db_path, sid)) == 3 and len(store.messages(sid)) == 6  # nothing of the killed turn
    resumed, _ = persist.resume(store, engine, sid)
    assert resumed.messages == messages_before
    assert resumed.send(NEXT, TURN).token_ids == expected
