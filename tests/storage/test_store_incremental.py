"""Incremental snapshots on real SQLite files: a delta stores only what changed since the
session's newest snapshot, loads back exactly, compacts into a full one, survives a kill
while it is written, and old databases still open. Plus: a turn saved in one transaction,
one Store shared by threads."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from sqlite_utils import Database

from kvchat.storage import codec
from kvchat.storage.codec import encode_layer
from kvchat.storage.db import MAX_DELTAS, Store
from kvchat.storage.migrations import SCHEMA_VERSION, m001_initial

HELPER = Path(__file__).parents[1] / "store_helpers.py"
ROW = 3 * 64  # floats per row of a [heads=3, rows, 64] cache tensor


def new_session(store: Store) -> int:
    return store.create_session("chat", "smollm2-135m:abc", "full", {})


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(3, n, 64, generator=torch.Generator().manual_seed(seed))


def layer(keys: torch.Tensor, window: torch.Tensor, **extra: object) -> dict:
    return {"keys": keys, "win": window, "pos": torch.arange(keys.shape[1]), "n": keys.shape[1], **extra}


def snapshot_rows(db_path: Path) -> list[tuple[int, int | None]]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT id, parent_id FROM snapshots ORDER BY id").fetchall()


def assert_layers_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for key, value in w.items():
            if isinstance(value, torch.Tensor):
                assert g[key].dtype == value.dtype and torch.equal(g[key], value), key
            else:
                assert g[key] == value, key


def test_appended_rows_are_all_a_delta_stores(store: Store) -> None:
    sid = new_session(store)
    keys, window = rows(1000, 1), rows(64, 2)
    store.save_snapshot(sid, 1, {"tokens_seen": 1064}, [layer(keys, window)])
    full_bytes = store.last_write_bytes(sid)
    grown = torch.cat([keys, rows(10, 3)], 1)
    store.save_snapshot(sid, 2, {"tokens_seen": 1074}, [layer(grown, window)])
    # 10 new rows of keys + 10 positions, no window (unchanged), plus headers.
    assert store.last_write_bytes(sid) < 10 * ROW * 4 + 4096
    assert store.last_write_bytes(sid) < full_bytes / 50
    assert_layers_equal(store.load_snapshot(sid).layers, [layer(grown, window)])


def test_a_shifted_window_is_stored_as_its_shift_and_new_rows(store: Store) -> None:
    sid = new_session(store)
    keys, window = rows(100, 1), rows(512, 2)
    store.save_snapshot(sid, 1, {}, [layer(keys, window)])
    shifted = torch.cat([window[:, 40:], rows(40, 3)], 1)  # 40 rows out on the left, 40 in
    store.save_snapshot(sid, 2, {}, [layer(keys, shifted)])
    assert store.last_write_bytes(sid) < 40 * ROW * 4 + 4096
    assert_layers_equal(store.load_snapshot(sid).layers, [layer(keys, shifted)])


def test_rows_dropped_from_the_middle_are_stored_as_source_indices(store: Store) -> None:
    sid = new_session(store)
    keys, window = rows(1000, 1), rows(64, 2)
    store.save_snapshot(sid, 1, {}, [layer(keys, window)])
    evicted = torch.cat([keys[:, torch.arange(1000) % 7 != 3], rows(5, 3)], 1)  # evicted, then appended
    store.save_snapshot(sid, 2, {}, [layer(evicted, window)])
    # 5 new rows, plus a 4-byte source index per kept row of each head, plus positions.
    assert store.last_write_bytes(sid) < 5 * ROW * 4 + 3 * 860 * 4 + 8 * 1000 + 4096
    assert_layers_equal(store.load_snapshot(sid).layers, [layer(evicted, window)])


def test_changed_and_retyped_tensors_load_exactly(store: Store) -> None:
    sid = new_session(store)
    keys, window = rows(200, 1), rows(64, 2)
    store.save_snapshot(sid, 1, {}, [layer(keys, window)])
    changed = keys.clone()
    changed[1, 150] += 1.0  # one value of one head
    reordered = changed[:, torch.randperm(200, generator=torch.Generator().manual_seed(5))]
    for turn, new in enumerate([changed, reordered, keys.to(torch.float16), rows(200, 9)], start=2):
        store.save_snapshot(sid, turn, {}, [layer(new, window)])
        assert_layers_equal(store.load_snapshot(sid).layers, [layer(new, window)])


def test_a_chain_compacts_into_a_full_snapshot_after_max_deltas(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    keys, window = rows(2000, 1), rows(16, 2)
    for turn in range(MAX_DELTAS + 2):
        keys = torch.cat([keys, rows(1, 10 + turn)], 1)
        store.save_snapshot(sid, turn, {}, [layer(keys, window)])
        if turn == MAX_DELTAS:  # a full snapshot and MAX_DELTAS deltas
            assert [parent is None for _, parent in snapshot_rows(db_path)] == [True] + [False] * MAX_DELTAS
    # The next save is full again and the old chain is gone.
    assert [parent for _, parent in snapshot_rows(db_path)] == [None]
    assert_layers_equal(store.load_snapshot(sid).layers, [layer(keys, window)])


def test_a_chain_compacts_when_deltas_pass_half_the_base(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    store.save_snapshot(sid, 1, {}, [layer(rows(100, 1), rows(8, 2))])
    store.save_snapshot(sid, 2, {}, [layer(rows(100, 3), rows(8, 2))])  # all keys changed: > half the base
    store.save_snapshot(sid, 3, {}, [layer(rows(101, 3), rows(8, 2))])
    assert [parent for _, parent in snapshot_rows(db_path)] == [None]


def test_a_store_that_loaded_the_snapshot_writes_a_delta_on_it(db_path: Path) -> None:
    keys, window = rows(1000, 1), rows(64, 2)
    with Store(db_path) as first:
        sid = new_session(first)
        base = first.save_snapshot(sid, 1, {}, [layer(keys, window)])
    grown = torch.cat([keys, rows(5, 3)], 1)
    with Store(db_path) as resumed:  # a fresh process resuming the session
        resumed.load_snapshot(sid)
        delta = resumed.save_snapshot(sid, 2, {}, [layer(grown, window)])
        assert resumed.last_write_bytes(sid) < 5 * ROW * 4 + 4096
    assert snapshot_rows(db_path) == [(base, None), (delta, base)]
    with Store(db_path) as later:
        assert_layers_equal(later.load_snapshot(sid).layers, [layer(grown, window)])


def test_another_store_writing_in_between_forces_a_full_snapshot(db_path: Path) -> None:
    with Store(db_path) as a, Store(db_path) as b:
        sid = new_session(a)
        a.save_snapshot(sid, 1, {}, [layer(rows(100, 1), rows(8, 2))])
        newest = b.save_snapshot(sid, 2, {}, [layer(rows(100, 3), rows(8, 2))])
        a.save_snapshot(sid, 3, {}, [layer(rows(101, 3), rows(8, 2))])  # a's chain is stale
        assert snapshot_rows(db_path)[-1][1] is None
        assert_layers_equal(a.load_snapshot(sid).layers, [layer(rows(101, 3), rows(8, 2))])
        assert newest not in [i for i, _ in snapshot_rows(db_path)]


def test_sigkill_while_a_delta_is_written_keeps_the_previous_state(db_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    base = [{"k": torch.randn(256 * 1024, generator=gen), "i": i} for i in range(6)]
    with Store(db_path) as s:
        sid = new_session(s)
        s.save_snapshot(sid, 1, {"tokens_seen": 1000}, base)
        first_delta = [{"k": torch.cat([state["k"], torch.ones(8)]), "i": state["i"]} for state in base]
        s.save_snapshot(sid, 2, {"tokens_seen": 2000}, first_delta)
    proc = subprocess.run(
        [sys.executable, str(HELPER), "crash-mid-delta", str(db_path), str(sid), "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stderr
    with Store(db_path) as s:
        snap = s.load_snapshot(sid)
        assert (snap.turn, snap.meta) == (2, {"tokens_seen": 2000})
        assert_layers_equal(snap.layers, first_delta)
    assert [parent is None for _, parent in snapshot_rows(db_path)] == [True, False]


def test_a_database_from_before_incremental_snapshots_opens_and_loads(db_path: Path) -> None:
    old_layers = [layer(rows(50, 1), rows(8, 2)), layer(rows(50, 3), rows(8, 4))]
    db = Database(db_path)  # what kvchat with schema 1 wrote
    db["_migrations"].create({"name": str, "applied_at": str}, pk="name")
    m001_initial(db)
    db["_migrations"].insert({"name": "m001_initial", "applied_at": "2026-01-01"})
    db["sessions"].insert(
        {
            "id": 1,
            "title": "old",
            "model_fingerprint": "m",
            "method": "full",
            "params": "{}",
            "created": "2026-01-01",
            "updated": "2026-01-01",
        }
    )
    db["snapshots"].insert(
        {"id": 1, "session_id": 1, "turn": 4, "meta": '{"tokens_seen": 58}', "created": "2026-01-01"}
    )
    for index, state in enumerate(old_layers):
        db["snapshot_tensors"].insert({"snapshot_id": 1, "layer": index, "blob": encode_layer(state)})
    db.conn.close()
    with Store(db_path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        snap = s.load_snapshot(1)
        assert (snap.turn, snap.meta) == (4, {"tokens_seen": 58})
        assert_layers_equal(snap.layers, old_layers)
        grown = [layer(torch.cat([state["keys"], rows(2, 9)], 1), state["win"]) for state in old_layers]
        s.save_snapshot(1, 5, {}, grown)  # a delta on the old snapshot
        assert_layers_equal(s.load_snapshot(1).layers, grown)
    assert [parent for _, parent in snapshot_rows(db_path)] == [None, 1]


def test_save_turn_writes_messages_snapshot_and_session_in_one_transaction(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    messages = [
        {"role": "user", "text": "hi", "token_ids": [1, 2]},
        {"role": "assistant", "text": "hello", "token_ids": [3], "metrics": {"tok_s": 9.5}},
    ]
    store.save_turn(
        sid,
        messages,
        1,
        {"tokens_seen": 3},
        [layer(rows(3, 1), rows(1, 2))],
        {"method": "h2o", "params": {"budget": "25%"}, "title": "greeting"},
    )
    row = store.get_session(sid)
    assert (row.title, row.method, row.params, row.tokens, row.message_count) == (
        "greeting",
        "h2o",
        {"budget": "25%"},
        3,
        2,
    )
    assert [(m.role, m.text, m.token_ids, m.metrics) for m in store.messages(sid)] == [
        ("user", "hi", [1, 2], {}),
        ("assistant", "hello", [3], {"tok_s": 9.5}),
    ]


def test_a_failing_save_turn_writes_none_of_the_turn(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    messages = [{"role": "user", "text": "hi", "token_ids": [1]}]
    with pytest.raises(TypeError, match="'bad'"):
        store.save_turn(sid, messages, 1, {}, [{"bad": [1]}], {"title": "never"})
    assert store.messages(sid) == [] and store.load_snapshot(sid) is None
    assert store.get_session(sid).title == "chat"


def test_one_store_takes_writes_from_two_threads_at_once(store: Store) -> None:
    sessions = [new_session(store), new_session(store)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(sid: int, seed: int) -> None:
        try:
            start.wait()
            keys = rows(50, seed)
            for turn in range(15):
                keys = torch.cat([keys, rows(1, seed * 100 + turn)], 1)
                store.save_turn(
                    sid,
                    [{"role": "user", "text": f"{seed} {turn}", "token_ids": [turn]}],
                    turn,
                    {"tokens_seen": keys.shape[1]},
                    [layer(keys, rows(4, seed))],
                )
        except BaseException as exc:  # collected: an exception in a thread would pass silently
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(sid, seed)) for seed, sid in enumerate(sessions, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for seed, sid in enumerate(sessions, 1):
        assert [m.text for m in store.messages(sid)] == [f"{seed} {turn}" for turn in range(15)]
        assert store.load_snapshot(sid).layers[0]["keys"].shape == (3, 65, 64)


def test_row_hashes_tell_rows_apart_that_differ_in_one_bit() -> None:
    t = rows(4, 1)
    flipped = t.clone()
    flipped.view(torch.int32)[2, 3, 17] ^= 1 << 30
    a, b = codec.row_hashes(t, 1), codec.row_hashes(flipped, 1)
    assert torch.equal(a[[0, 1]], b[[0, 1]]) and torch.equal(a[2, :3], b[2, :3])
    assert a[2, 3] != b[2, 3]
