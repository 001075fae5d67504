"""The disk the saved sessions take (kvchat/storage/disk.py), on real SQLite files:
each session's bytes; a delete gives its space back, and loses nothing else, a kill
included; an old file moves to incremental auto-vacuum at its first open; the disk
budget drops the recall tiers of the least recently used sessions, never the one just
saved, and keeps their transcripts and snapshots."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sqlite_utils import Database
from store_helpers import cold_layers

from kvchat.storage import migrations
from kvchat.storage.db import Store
from kvchat.storage.rows import TierDrop

HELPER = Path(__file__).parents[1] / "store_helpers.py"
LAYERS = 4
ROWS = 2000  # 4 layers x 2,000 rows x 768 bytes: about 6 MB of cold rows a session
PAGE = 4096


def layers(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"k": torch.randn(64, 8, generator=gen), "n": i} for i in range(LAYERS)]


def saved_session(store: Store, title: str, rows: int = ROWS, seed: int = 0) -> int:
    """A session with one turn: two messages, a snapshot of LAYERS small layers, and a
    recall tier of `rows` cold rows per layer."""
    sid = store.create_session(title, "fp", "window", {})
    messages = [
        {"role": "user", "text": f"{title}?", "token_ids": [1, 2]},
        {"role": "assistant", "text": "yes", "token_ids": [3]},
    ]
    store.save_turn(sid, messages, 1, {"tokens_seen": rows}, layers(seed), cold_rows=cold_layers(LAYERS, rows, title))
    return sid


def cold_read(store: Store, sid: int) -> dict[int, torch.Tensor]:
    snap = store.load_snapshot(sid)
    got: dict[int, list[torch.Tensor]] = {}
    store.load_cold(sid, snap.id, lambda layer, rows: got.setdefault(layer, []).append(rows), lambda: None)
    return {layer: torch.cat(parts) for layer, parts in got.items()}


def file_size(path: Path) -> int:
    """The main file and its WAL, as the file system counts them."""
    wal = Path(f"{path}-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def empty_size(folder: Path) -> int:
    path = folder / "empty.db"
    Store(path).close()
    return file_size(path)


# -- sizes -----------------------------------------------------------------------------


def test_a_session_s_size_is_what_its_messages_snapshot_and_cold_rows_hold(store: Store, db_path: Path) -> None:
    sid = saved_session(store, "big")
    other = saved_session(store, "other", rows=10)
    row = store.get_session(sid)
    with sqlite3.connect(db_path) as conn:
        (cold,) = conn.execute("SELECT sum(length(blob)) FROM cold_rows WHERE session_id = ?", [sid]).fetchone()
        (meta,) = conn.execute("SELECT sum(length(meta)) FROM snapshots WHERE session_id = ?", [sid]).fetchone()
        (text,) = conn.execute(
            "SELECT sum(length(text) + length(token_ids) + length(metrics)) FROM messages WHERE session_id = ?", [sid]
        ).fetchone()
    assert row.cold_bytes == cold > LAYERS * ROWS * 768
    assert row.disk_bytes == cold + store.snapshot_bytes(sid) + meta + text
    assert store.get_session(other).disk_bytes < row.disk_bytes / 100  # its rows are its own


def test_a_session_without_a_turn_takes_nothing(store: Store) -> None:
    sid = store.create_session("new", "fp", "window", {})
    row = store.get_session(sid)
    assert (row.disk_bytes, row.cold_bytes, row.tier_dropped) == (0, 0, None)


# -- giving space back -----------------------------------------------------------------


def test_deleting_every_session_gives_the_file_back_to_an_empty_database_s_size(tmp_path: Path) -> None:
    path = tmp_path / "kvchat.db"
    with Store(path) as store:
        ids = [saved_session(store, f"s{n}", seed=n) for n in range(3)]
        assert file_size(path) > 3 * LAYERS * ROWS * 768
        for sid in ids:
            store.delete_session(sid)
        assert file_size(path) <= empty_size(tmp_path) + 2 * PAGE


def test_deleting_one_of_two_gives_its_bytes_back_and_the_other_resumes_as_saved(db_path: Path) -> None:
    with Store(db_path) as store:
        first, second = saved_session(store, "first"), saved_session(store, "second", seed=1)
        before, held = file_size(db_path), cold_read(store, second)
        layers = store.load_snapshot(second).layers
        gone = store.get_session(first).disk_bytes
        store.delete_session(first)  # the oldest: its pages lie before the other's, which move
        assert before - file_size(db_path) >= gone * 0.95
    with Store(db_path) as store:  # as a later process finds it
        assert [r.id for r in store.list_sessions()] == [second]
        again = cold_read(store, second)
        assert again.keys() == held.keys() and all(torch.equal(again[k], held[k]) for k in held)
        snap = store.load_snapshot(second)
        assert all(torch.equal(a["k"], b["k"]) for a, b in zip(snap.layers, layers))
        assert [m.text for m in store.messages(second)] == ["second?", "yes"]


def test_a_kill_after_a_delete_commits_loses_nothing_and_the_next_delete_gives_both_back(tmp_path: Path) -> None:
    path = tmp_path / "kvchat.db"
    with Store(path) as store:
        ids = [saved_session(store, f"s{n}", seed=n) for n in range(3)]
    done = subprocess.run(
        [sys.executable, str(HELPER), "crash-before-give-back", str(path), str(ids[0])],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == -9, done.stderr.decode()
    with Store(path) as store:
        assert [r.id for r in store.list_sessions()] == ids[:0:-1]  # the delete committed; the others whole
        assert cold_read(store, ids[1])[0].shape[0] == ROWS
        store.delete_session(ids[1])
        assert file_size(path) <= empty_size(tmp_path) + store.get_session(ids[2]).disk_bytes * 1.05


def test_an_old_database_moves_to_incremental_auto_vacuum_at_its_first_open(db_path: Path) -> None:
    # A file as kvchat made it before migration m006: no auto-vacuum, five migrations, and
    # the pages of a deleted session's rows still in it.
    db = Database(sqlite3.connect(db_path, isolation_level=None))
    db.execute("PRAGMA journal_mode = WAL")
    db.conn.execute("BEGIN")
    migrations.table_of(db, migrations.MIGRATIONS_TABLE).create({"name": str, "applied_at": str}, pk="name")
    for migration in migrations.MIGRATIONS[:5]:
        migration(db)
        migrations.table_of(db, migrations.MIGRATIONS_TABLE).insert({"name": migration.__name__, "applied_at": "x"})
    for sid in (1, 2):
        db.execute(
            "INSERT INTO sessions (id, title, model_fingerprint, method, params, created, updated) "
            "VALUES (?, 't', 'fp', 'window', '{}', 'x', 'x')",
            [sid],
        )
        db.execute("INSERT INTO cold_rows VALUES (?, 0, 0, 1, randomblob(4000000))", [sid])
    db.conn.execute("COMMIT")
    db.execute("DELETE FROM cold_rows WHERE session_id = 2")
    (kept,) = db.execute("SELECT blob FROM cold_rows WHERE session_id = 1").fetchone()
    assert db.execute("PRAGMA auto_vacuum").fetchone() == (0,)
    assert db.execute("PRAGMA freelist_count").fetchone()[0] > 900
    db.conn.close()
    told: list[int] = []
    with Store(db_path, on_rewrite=told.append) as store:
        assert told and told[0] > 8_000_000  # the user hears of the rewrite before it starts
        assert store.schema_version() == migrations.SCHEMA_VERSION
        assert store.db.execute("PRAGMA auto_vacuum").fetchone() == (2,)
        assert store.db.execute("PRAGMA freelist_count").fetchone() == (0,)
        assert store.db.execute("SELECT blob FROM cold_rows WHERE session_id = 1").fetchone() == (kept,)
        assert store.get_session(1).disk_bytes == 4_000_000
    assert file_size(db_path) < 4_500_000
    with Store(db_path, on_rewrite=told.append):
        assert len(told) == 1  # once


def test_a_new_database_is_born_in_incremental_auto_vacuum(store: Store) -> None:
    assert store.db.execute("PRAGMA auto_vacuum").fetchone() == (2,)
    assert store.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


# -- the disk budget -------------------------------------------------------------------


def three_sessions(store: Store) -> list[int]:
    """Three saved sessions, the least recently used first."""
    return [saved_session(store, name, seed=n) for n, name in enumerate(("oldest", "middle", "newest"))]


def test_within_the_budget_nothing_is_dropped(store: Store) -> None:
    ids = three_sessions(store)
    store.disk_budget = sum(r.disk_bytes for r in store.list_sessions())
    assert store.fit_disk_budget(keep=ids[-1]) is None
    assert all(r.cold_bytes > 0 and r.tier_dropped is None for r in store.list_sessions())


def test_without_a_budget_nothing_is_dropped(store: Store) -> None:
    ids = three_sessions(store)
    assert store.disk_budget is None and store.fit_disk_budget(keep=ids[-1]) is None


def test_past_the_budget_the_least_recently_used_tiers_go_first(store: Store, db_path: Path) -> None:
    oldest, middle, newest = three_sessions(store)
    rows = {r.id: r for r in store.list_sessions()}
    total = sum(r.disk_bytes for r in rows.values())
    store.disk_budget = total - 1  # one tier is enough
    before = file_size(db_path)
    dropped = store.fit_disk_budget(keep=newest)
    assert dropped == TierDrop(total - 1, (oldest,), rows[oldest].cold_bytes, total - rows[oldest].cold_bytes)
    after = {r.id: r for r in store.list_sessions()}
    assert after[oldest].cold_bytes == 0 and after[oldest].tier_dropped is not None
    assert after[oldest].disk_bytes == rows[oldest].disk_bytes - rows[oldest].cold_bytes
    assert all(after[s].cold_bytes == rows[s].cold_bytes and after[s].tier_dropped is None for s in (middle, newest))
    assert [r.id for r in store.list_sessions()] == [newest, middle, oldest]  # the drop is no use: order kept
    assert before - file_size(db_path) >= rows[oldest].cold_bytes * 0.95  # and its space went back


def test_the_session_just_saved_keeps_its_tier_even_when_it_is_the_oldest(store: Store) -> None:
    oldest, middle, newest = three_sessions(store)
    store.disk_budget = 1
    dropped = store.fit_disk_budget(keep=oldest)
    assert dropped is not None and dropped.sessions == (middle, newest)
    assert store.get_session(oldest).cold_bytes > 0


def test_a_dropped_tier_leaves_the_transcript_and_snapshot_to_resume_from(store: Store) -> None:
    oldest, _, newest = three_sessions(store)
    layers = store.load_snapshot(oldest).layers
    store.disk_budget = 1
    store.fit_disk_budget(keep=newest)
    assert [m.text for m in store.messages(oldest)] == ["oldest?", "yes"]
    snap = store.load_snapshot(oldest)
    assert all(torch.equal(a["k"], b["k"]) for a, b in zip(snap.layers, layers))
    assert cold_read(store, oldest) == {}  # the resume's tier starts empty (kvchat/chat/persist.py)


def test_transcripts_and_caches_past_the_budget_drop_every_other_tier(store: Store) -> None:
    _, _, newest = three_sessions(store)
    store.disk_budget = 1000
    dropped = store.fit_disk_budget(keep=newest)
    assert dropped is not None and len(dropped.sessions) == 2 and dropped.total > 1000
    assert store.fit_disk_budget(keep=newest) is None  # nothing left to drop: nothing said


def test_a_save_that_reads_the_transcript_again_clears_the_mark(store: Store) -> None:
    oldest, _, newest = three_sessions(store)
    store.disk_budget = 1
    store.fit_disk_budget(keep=newest)
    store.save_turn(oldest, [], 2, {}, layers(0), cold_rows=cold_layers(LAYERS, 10))
    assert store.get_session(oldest).tier_dropped is not None  # a turn after a resume: the old tier is still gone
    store.save_turn(oldest, [], 2, {}, layers(0), cold_rows=cold_layers(LAYERS, 10), whole_tier=True)
    assert store.get_session(oldest).tier_dropped is None


def test_a_branch_of_a_session_whose_tier_was_dropped_has_none_either(store: Store) -> None:
    oldest, _, newest = three_sessions(store)
    store.disk_budget = 1
    store.fit_disk_budget(keep=newest)
    made = store.branch_session(oldest, 1)
    assert made.snapshot and store.get_session(made.session_id).tier_dropped is not None


@pytest.mark.parametrize("budget", [None, 10**12])
def test_a_store_opened_with_a_budget_holds_it(db_path: Path, budget: int | None) -> None:
    with Store(db_path, disk_budget=budget) as store:
        assert store.disk_budget == budget
