"""kvchat.storage on real SQLite files: schema, migrations, CRUD, snapshots, crash safety,
refusal of foreign/newer files, two processes sharing one file, export."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvchat.errors import StoreError
from kvchat.storage.db import Store, default_db_path
from kvchat.storage.migrations import SCHEMA_VERSION
from kvchat.storage.rows import MessageRow, Snapshot

HELPER = Path(__file__).parents[1] / "store_helpers.py"

EXPECTED_SCHEMA = """CREATE TABLE "_migrations" (
   "name" TEXT PRIMARY KEY,
   "applied_at" TEXT
);
CREATE TABLE "sessions" (
   "id" INTEGER PRIMARY KEY,
   "title" TEXT NOT NULL,
   "model_fingerprint" TEXT NOT NULL,
   "method" TEXT NOT NULL,
   "params" TEXT NOT NULL,
   "created" TEXT NOT NULL,
   "updated" TEXT NOT NULL
, "origin_session_id" INTEGER, "origin_turn" INTEGER, "tier_dropped" TEXT);
CREATE TABLE "messages" (
   "id" INTEGER PRIMARY KEY,
   "session_id" INTEGER NOT NULL REFERENCES "sessions"("id"),
   "role" TEXT NOT NULL,
   "text" TEXT NOT NULL,
   "token_ids" TEXT NOT NULL,
   "metrics" TEXT NOT NULL,
   "created" TEXT NOT NULL
);
CREATE INDEX "idx_messages_session_id"
    ON "messages" ("session_id");
CREATE TABLE "snapshots" (
   "id" INTEGER PRIMARY KEY,
   "session_id" INTEGER NOT NULL REFERENCES "sessions"("id"),
   "turn" INTEGER NOT NULL,
   "meta" TEXT NOT NULL,
   "created" TEXT NOT NULL
, "parent_id" INTEGER);
CREATE INDEX "idx_snapshots_session_id"
    ON "snapshots" ("session_id");
CREATE TABLE "snapshot_tensors" (
   "snapshot_id" INTEGER NOT NULL REFERENCES "snapshots"("id"),
   "layer" INTEGER NOT NULL,
   "blob" BLOB NOT NULL,
   PRIMARY KEY ("snapshot_id", "layer")
);
CREATE VIRTUAL TABLE "messages_fts" USING FTS5 (
    "text",
    content="messages"
);
CREATE TABLE 'messages_fts_data'(id INTEGER PRIMARY KEY, block BLOB);
CREATE TABLE 'messages_fts_idx'(segid, term, pgno, PRIMARY KEY(segid, term)) WITHOUT ROWID;
CREATE TABLE 'messages_fts_docsize'(id INTEGER PRIMARY KEY, sz BLOB);
CREATE TABLE 'messages_fts_config'(k PRIMARY KEY, v) WITHOUT ROWID;
CREATE TRIGGER "messages_ai" AFTER INSERT ON "messages" BEGIN
  INSERT INTO "messages_fts" (rowid, "text") VALUES (new.rowid, new."text");
END;
CREATE TRIGGER "messages_ad" AFTER DELETE ON "messages" BEGIN
  INSERT INTO "messages_fts" ("messages_fts", rowid, "text") VALUES('delete', old.rowid, old."text");
END;
CREATE TRIGGER "messages_au" AFTER UPDATE ON "messages" BEGIN
  INSERT INTO "messages_fts" ("messages_fts", rowid, "text") VALUES('delete', old.rowid, old."text");
  INSERT INTO "messages_fts" (rowid, "text") VALUES (new.rowid, new."text");
END;
CREATE TABLE "cold_rows" (
   "session_id" INTEGER NOT NULL REFERENCES "sessions"("id"),
   "layer" INTEGER NOT NULL,
   "start" INTEGER NOT NULL,
   "rows" INTEGER NOT NULL,
   "blob" BLOB NOT NULL,
   PRIMARY KEY ("session_id", "layer", "start")
);"""


def new_session(store: Store, title: str = "chat") -> int:
    return store.create_session(title, "smollm2-135m:abc", "chelsea", {"budget": 256})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def count(path: Path, table: str) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def small_layers(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"k": torch.randn(2, 8, 4, generator=gen), "pos": torch.arange(8), "n": i} for i in range(3)]


def assert_layers_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for key, value in w.items():
            if isinstance(value, torch.Tensor):
                assert g[key].dtype == value.dtype and g[key].shape == value.shape, key
                assert torch.equal(g[key], value), key
            else:
                assert type(g[key]) is type(value) and g[key] == value, key


# -- schema and migrations -----------------------------------------------------------


def test_schema_is_pinned(store: Store) -> None:
    assert store.db.schema == EXPECTED_SCHEMA


def test_wal_mode_and_parent_dir_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "kvchat.db"
    with Store(path) as s:
        assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert path.is_file()


def test_migrations_recorded_and_not_rerun(db_path: Path) -> None:
    Store(db_path).close()
    with sqlite3.connect(db_path) as conn:
        first = conn.execute("SELECT name, applied_at FROM _migrations").fetchall()
    assert [name for name, _ in first] == [
        "m001_initial",
        "m002_snapshot_parent",
        "m003_message_search",
        "m004_session_origin",
        "m005_cold_rows",
        "m006_disk_budget",
    ]
    with Store(db_path) as s:
        assert s.schema_version() == SCHEMA_VERSION == 6
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT name, applied_at FROM _migrations").fetchall() == first


def test_default_db_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCHAT_DB", raising=False)
    monkeypatch.setenv("KVCHAT_HOME", "/home/u/kv")
    assert default_db_path() == Path("/home/u/kv/sessions/kvchat.db")
    monkeypatch.setenv("KVCHAT_DB", "/x/y.db")
    assert default_db_path() == Path("/x/y.db")


# -- sessions and messages -----------------------------------------------------------


def test_session_create_get_update_list(store: Store) -> None:
    a = new_session(store, "first")
    b = new_session(store, "second")
    row = store.get_session(a)
    assert (row.title, row.model_fingerprint, row.method, row.params) == (
        "first",
        "smollm2-135m:abc",
        "chelsea",
        {"budget": 256},
    )
    assert (row.tokens, row.message_count) == (0, 0)
    assert [s.id for s in store.list_sessions()] == [b, a]
    assert store.last_session_id() == b

    store.update_session(a, title="renamed", method="subgen", params={"budget": "25%"})
    row2 = store.get_session(a)
    assert (row2.title, row2.method, row2.params) == ("renamed", "subgen", {"budget": "25%"})
    assert row2.updated > row.updated and row2.created == row.created
    assert [s.id for s in store.list_sessions()] == [a, b]
    assert store.last_session_id() == a


def test_missing_session_is_a_clear_error(store: Store) -> None:
    with pytest.raises(StoreError) as err:
        store.get_session(42)
    assert str(err.value) == "no session 42; `kvchat sessions list` shows the saved ones"
    with pytest.raises(StoreError, match="no session 42"):
        store.add_message(42, "user", "hi", [1])


def test_last_session_id_empty(store: Store) -> None:
    assert store.last_session_id() is None


def test_message_round_trip(store: Store) -> None:
    sid = new_session(store)
    before = store.get_session(sid).updated
    m1 = store.add_message(sid, "user", "héllo\nworld", [1, 2, 50000], None)
    m2 = store.add_message(sid, "assistant", "hi", [7], {"tokens_per_s": 31.5, "ttft_ms": 120})
    msgs = store.messages(sid)
    assert [m.id for m in msgs] == [m1, m2]
    assert msgs[0] == MessageRow(m1, sid, "user", "héllo\nworld", [1, 2, 50000], {}, msgs[0].created)
    assert msgs[1].metrics == {"tokens_per_s": 31.5, "ttft_ms": 120}
    assert store.get_session(sid).message_count == 2
    assert store.get_session(sid).updated > before


def test_delete_session_removes_messages_and_snapshots(store: Store, db_path: Path) -> None:
    keep = new_session(store, "keep")
    gone = new_session(store, "gone")
    for sid in (keep, gone):
        store.add_message(sid, "user", "x", [1])
        store.save_snapshot(sid, 1, {}, small_layers(0))
    store.delete_session(gone)
    with pytest.raises(StoreError):
        store.get_session(gone)
    assert [s.id for s in store.list_sessions()] == [keep]
    assert count(db_path, "messages") == 1
    assert count(db_path, "snapshots") == 1
    assert count(db_path, "snapshot_tensors") == 3
    assert store.load_snapshot(keep) is not None


# -- snapshots -------------------------------------------------------------------------


def test_snapshot_round_trip_dtypes_empty_tensors_and_scalars(store: Store) -> None:
    sid = new_session(store)
    base = torch.randn(2, 6, 4)
    kv = torch.randn(2, 3, 5)
    layer = {
        "keys": base.transpose(1, 2),  # non-contiguous
        "values": torch.randn(3, 5).to(torch.bfloat16),
        "half": torch.randn(4).to(torch.float16),
        "positions": torch.tensor([0, 1, 2**40], dtype=torch.int64),
        "rng": torch.Generator().manual_seed(7).get_state(),  # uint8
        "log_a": torch.tensor([0.0, float("-inf")]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "empty_i": torch.zeros(3, 0, dtype=torch.int64),
        "k_view": kv[0],  # two views of one storage
        "v_view": kv[1],
        "scalar_t": torch.tensor(3.5),
        "n": 12,
        "big": 2**62,
        "flag": True,
        "off": False,
        "scale": 0.125,
        "neg_inf": float("-inf"),
        "whole": 2.0,
        "name": "chelsea",
    }
    meta = {"method": "chelsea", "params": {"budget": 64}, "tokens_seen": 1234, "dtype": "float32"}
    snap_id = store.save_snapshot(sid, 3, meta, [layer, {"n": 0}])
    snap = store.load_snapshot(sid)
    assert isinstance(snap, Snapshot)
    assert (snap.id, snap.session_id, snap.turn, snap.meta) == (snap_id, sid, 3, meta)
    assert_layers_equal(snap.layers, [layer, {"n": 0}])
    assert store.get_session(sid).tokens == 1234


def test_load_snapshot_none_without_one(store: Store) -> None:
    sid = new_session(store)
    assert store.load_snapshot(sid) is None
    assert store.snapshot_bytes(sid) == 0


def test_newest_snapshot_wins_and_older_removed(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    store.save_snapshot(sid, 1, {"tokens_seen": 10}, small_layers(1))
    second = small_layers(2)
    with Store(db_path) as other:  # knows no chain: writes a full snapshot
        snap_id = other.save_snapshot(sid, 2, {"tokens_seen": 20}, second)
    snap = store.load_snapshot(sid)
    assert (snap.id, snap.turn, snap.meta) == (snap_id, 2, {"tokens_seen": 20})
    assert_layers_equal(snap.layers, second)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT id FROM snapshots").fetchall() == [(snap_id,)]
        assert conn.execute("SELECT DISTINCT snapshot_id FROM snapshot_tensors").fetchall() == [(snap_id,)]
        blob_bytes = conn.execute("SELECT sum(length(blob)) FROM snapshot_tensors").fetchone()[0]
    assert store.snapshot_bytes(sid) == blob_bytes > 3 * 2 * 8 * 4 * 4
    assert store.get_session(sid).tokens == 20


def test_snapshot_with_unsupported_value_writes_nothing(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    with pytest.raises(TypeError, match="'bad'"):
        store.save_snapshot(sid, 1, {}, [{"k": torch.ones(2)}, {"bad": [1, 2]}])
    assert count(db_path, "snapshots") == 0
    assert count(db_path, "snapshot_tensors") == 0


# -- crash safety ----------------------------------------------------------------------


def run_helper(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HELPER), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_sigkill_mid_save_keeps_previous_snapshot(db_path: Path) -> None:
    with Store(db_path) as s:
        sid = new_session(s)
        first = small_layers(1)
        s.save_snapshot(sid, 1, {"tokens_seen": 100}, first)
    proc = run_helper("crash-mid-save", db_path, sid, 24, 20)
    assert proc.returncode == -9, proc.stderr
    # The kill landed inside the transaction, after ~20 MiB of uncommitted pages hit the WAL.
    assert Path(f"{db_path}-wal").stat().st_size > 4 * 2**20
    with Store(db_path) as s:
        snap = s.load_snapshot(sid)
        assert (snap.turn, snap.meta) == (1, {"tokens_seen": 100})
        assert_layers_equal(snap.layers, first)
    assert count(db_path, "snapshots") == 1
    assert count(db_path, "snapshot_tensors") == len(first)


def test_sigkill_after_commit_before_cleanup_keeps_new_snapshot(db_path: Path) -> None:
    with Store(db_path) as s:
        sid = new_session(s)
        s.save_snapshot(sid, 1, {"tokens_seen": 100}, small_layers(1))
    proc = run_helper("crash-before-cleanup", db_path, sid)
    assert proc.returncode == -9, proc.stderr
    with Store(db_path) as s:
        snap = s.load_snapshot(sid)
        assert (snap.turn, snap.meta, len(snap.layers)) == (2, {"tokens_seen": 2000}, 2)
        assert count(db_path, "snapshots") == 2  # the old one is still there...
        s.save_snapshot(sid, 3, {}, small_layers(3))
    assert count(db_path, "snapshots") == 1  # ...until the next save sweeps it
    assert count(db_path, "snapshot_tensors") == 3


# -- refusing files ----------------------------------------------------------------------


def test_not_a_database_is_refused_untouched(db_path: Path) -> None:
    db_path.write_bytes(os.urandom(8192))
    before = sha256(db_path)
    with pytest.raises(StoreError) as err:
        Store(db_path)
    assert str(err.value) == (
        f"{db_path} is not a kvchat database (file is not a database); move it away or pass --db NEWFILE"
    )
    assert sha256(db_path) == before


def test_foreign_sqlite_database_is_refused_untouched(db_path: Path) -> None:
    with sqlite3.connect(db_path) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    before = sha256(db_path)
    with pytest.raises(StoreError, match="is not a kvchat database .*; move it away or pass --db NEWFILE"):
        Store(db_path)
    assert sha256(db_path) == before


def test_newer_schema_is_refused_untouched(db_path: Path) -> None:
    Store(db_path).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute("INSERT INTO _migrations VALUES ('m007_from_the_future', '2099-01-01')")
    before = sha256(db_path)
    with pytest.raises(StoreError) as err:
        Store(db_path)
    assert str(err.value) == (
        f"{db_path} was written by a newer kvchat (schema 7 > 6); upgrade kvchat or use another --db"
    )
    assert sha256(db_path) == before


def test_uncreatable_parent_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match="cannot create the folder .*; pass --db with a writable path"):
        Store(blocker / "sub" / "kvchat.db")


# -- sharing the file --------------------------------------------------------------------


def test_locked_database_waits_then_raises(db_path: Path) -> None:
    store = Store(db_path, timeout_s=0.3)
    sid = new_session(store)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as err:
            store.add_message(sid, "user", "x", [1])
        assert 0.25 < time.monotonic() - t0 < 3
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert str(err.value) == (
        f"database {db_path} is locked by another process; close the other kvchat or pass --db to use another file"
    )
    store.add_message(sid, "user", "x", [1])  # usable again once the lock is gone
    store.close()


def test_two_processes_append_at_once(db_path: Path) -> None:
    with Store(db_path) as s:
        sid = new_session(s)
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), "append", str(db_path), str(sid), "200", tag],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in ("A", "B")
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:  # release both writers together
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out.strip() == "done", err
    with Store(db_path) as s:
        msgs = s.messages(sid)
    assert len(msgs) == 400
    for tag in ("A", "B"):
        assert [m.text for m in msgs if m.metrics["tag"] == tag] == [f"{tag} {i}" for i in range(200)]


# -- export ------------------------------------------------------------------------------


def test_export_md_keeps_markup_literally(store: Store) -> None:
    sid = new_session(store, "my chat")
    store.add_message(sid, "user", "show [bold]x[/bold] please", [1, 2])
    store.add_message(sid, "assistant", "here: [bold]x[/bold]", [3])
    md = store.export_session(sid, "md")
    assert md.startswith("# my chat\n")
    assert "## user (turn 1)\n\nshow [bold]x[/bold] please\n" in md
    assert "## assistant\n\nhere: [bold]x[/bold]\n" in md


def test_export_json_has_session_fields_and_messages(store: Store) -> None:
    sid = new_session(store, "my chat")
    store.add_message(sid, "user", "[bold]x[/bold]", [1, 2], {"ttft_ms": 5})
    store.save_snapshot(sid, 1, {"tokens_seen": 2}, small_layers(0))
    doc = json.loads(store.export_session(sid, "json"))
    assert doc["session"]["id"] == sid and doc["session"]["title"] == "my chat"
    assert doc["session"]["method"] == "chelsea" and doc["session"]["params"] == {"budget": 256}
    assert [(m["role"], m["text"], m["token_ids"], m["metrics"]) for m in doc["messages"]] == [
        ("user", "[bold]x[/bold]", [1, 2], {"ttft_ms": 5})
    ]
    assert "layers" not in json.dumps(doc)


def test_export_unknown_format(store: Store) -> None:
    sid = new_session(store)
    with pytest.raises(StoreError, match="unknown export format 'pdf'; use md or json"):
        store.export_session(sid, "pdf")
