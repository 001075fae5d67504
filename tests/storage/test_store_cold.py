"""A saved session's recall tier in the store (kvchat/storage/cold.py), on real SQLite
files and plain tensors: rows written once, in the snapshot's transaction, and read back
in order; rows of other files written again whole; deleted with the session; copied to a
branch; a kill while they are appended leaves the previous turn's rows."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from store_helpers import cold_layers

from kvchat.errors import StoreError
from kvchat.storage.db import Store

HELPER = Path(__file__).parents[1] / "store_helpers.py"
LAYERS = 4


def new_session(store: Store) -> int:
    return store.create_session("t", "fp", "window", {})


def read_back(store: Store, sid: int) -> dict[int, torch.Tensor]:
    """Every saved row of the newest snapshot, per layer, as the resume gets them."""
    snap = store.load_snapshot(sid)
    got: dict[int, list[torch.Tensor]] = {}
    store.load_cold(sid, snap.id, lambda layer, rows: got.setdefault(layer, []).append(rows), lambda: None)
    return {layer: torch.cat(parts) for layer, parts in got.items()}


def cold_table(db_path: Path, sid: int) -> list[tuple[int, int, int]]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(
            "SELECT layer, start, rows FROM cold_rows WHERE session_id = ? ORDER BY layer, start", [sid]
        ).fetchall()


def grown(rows: int, more: int, ident: str = "file-a") -> list[list[tuple[str, int, torch.Tensor]]]:
    """The tier of `cold_layers(LAYERS, rows)` after `more` rows went cold in the same file."""
    old = cold_layers(LAYERS, rows, ident)
    extra = cold_layers(LAYERS, more, ident + "-more")
    return [[(ident, 0, torch.cat([a[0][2], b[0][2]]))] for a, b in zip(old, extra)]


def test_rows_are_written_once_and_read_back_in_order(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    store.save_turn(sid, [], 1, {}, [{} for _ in range(LAYERS)], cold_rows=cold_layers(LAYERS, 300))
    # The tier read back is what the store knows it holds: the next save adds the new rows only.
    store.load_cold(sid, store.load_snapshot(sid).id, lambda layer, rows: None, lambda: cold_layers(LAYERS, 300))
    later = grown(300, 2100)
    store.save_turn(sid, [], 2, {}, [{} for _ in range(LAYERS)], cold_rows=later)
    # 300 rows, then the 2,100 after them in blobs of at most 2,048 rows.
    assert cold_table(db_path, sid) == [
        (layer, start, rows) for layer in range(LAYERS) for start, rows in ((0, 300), (300, 2048), (2348, 52))
    ]
    for layer, rows in read_back(store, sid).items():
        assert torch.equal(rows, later[layer][0][2])


def test_rows_of_another_file_are_written_again_whole(store: Store, db_path: Path) -> None:
    # A rebuilt or compacted tier holds other rows under the same numbers: all go again.
    sid = new_session(store)
    store.save_turn(sid, [], 1, {}, [{}], cold_rows=cold_layers(1, 300))
    other = cold_layers(1, 350, "file-b")
    store.save_turn(sid, [], 2, {}, [{}], cold_rows=other)
    assert cold_table(db_path, sid) == [(0, 0, 350)]
    assert torch.equal(read_back(store, sid)[0], other[0][0][2])


def test_a_store_that_did_not_write_the_rows_writes_them_again(db_path: Path) -> None:
    with Store(db_path) as first:
        sid = new_session(first)
        first.save_turn(sid, [], 1, {}, [{}], cold_rows=cold_layers(1, 300))
    with Store(db_path) as second:  # never read them: it cannot know they are the same
        second.save_turn(sid, [], 2, {}, [{}], cold_rows=grown(300, 10)[:1])
        assert cold_table(db_path, sid) == [(0, 0, 310)]


def test_a_snapshot_without_a_tier_drops_the_saved_rows(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    store.save_turn(sid, [], 1, {}, [{}], cold_rows=cold_layers(1, 30))
    store.save_turn(sid, [], 2, {}, [{}])  # recall turned off: the rows are no one's now
    assert cold_table(db_path, sid) == []


def test_deleting_a_session_deletes_its_rows(store: Store, db_path: Path) -> None:
    keep, gone = new_session(store), new_session(store)
    for sid in (keep, gone):
        store.save_turn(sid, [], 1, {}, [{}], cold_rows=cold_layers(1, 30))
    store.delete_session(gone)
    assert cold_table(db_path, gone) == [] and cold_table(db_path, keep) == [(0, 0, 30)]


def test_a_branch_gets_the_rows_of_the_snapshot_it_copies(store: Store) -> None:
    sid = new_session(store)
    store.add_message(sid, "user", "hello", [1])
    store.save_turn(sid, [], 1, {}, [{} for _ in range(LAYERS)], cold_rows=cold_layers(LAYERS, 40))
    made = store.branch_session(sid, 1)
    assert made.snapshot
    copied, original = read_back(store, made.session_id), read_back(store, sid)
    assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in copied)
    store.delete_session(sid)  # the branch's rows are its own
    assert read_back(store, made.session_id)[0].shape[0] == 40


def test_damaged_rows_are_a_store_error_naming_the_layer(store: Store, db_path: Path) -> None:
    sid = new_session(store)
    store.save_turn(sid, [], 1, {}, [{}, {}], cold_rows=cold_layers(2, 30))
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE cold_rows SET blob = x'00ff' WHERE layer = 1")
    with pytest.raises(StoreError, match="recall tier of session .* unreadable at layer 1, row 0"):
        read_back(store, sid)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM cold_rows WHERE layer = 1")
        conn.execute("INSERT INTO cold_rows SELECT session_id, 1, 10, rows, blob FROM cold_rows WHERE layer = 0")
    with pytest.raises(StoreError, match="misses rows 0-10 of layer 1"):
        read_back(store, sid)


def test_a_kill_while_rows_are_appended_leaves_the_previous_turns_rows(db_path: Path) -> None:
    with Store(db_path) as s:
        sid = new_session(s)
        s.save_turn(sid, [], 1, {"rows": 300}, [{} for _ in range(LAYERS)], cold_rows=cold_layers(LAYERS, 300))
    done = subprocess.run(
        [sys.executable, str(HELPER), "crash-mid-cold", str(db_path), str(sid), "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -9, done.stderr  # killed with two layers' new rows in the transaction
    with Store(db_path) as s:
        snap = s.load_snapshot(sid)
        assert (snap.turn, snap.meta) == (1, {"rows": 300})
        assert cold_table(db_path, sid) == [(layer, 0, 300) for layer in range(LAYERS)]
        for layer, rows in read_back(s, sid).items():
            assert torch.equal(rows, cold_layers(LAYERS, 300)[layer][0][2])
