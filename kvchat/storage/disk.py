"""The disk the saved sessions take: each session's bytes, giving freed space back, and
the disk budget.

Sizes. A session's bytes are the lengths of what its rows hold: its messages (text,
token ids, metrics), its snapshots (meta and per-layer blobs) and its recall tier's cold
rows. They are summed in SQL, each table reached through an index that starts with the
session, so SQLite reads the length from each row's header and never the blob's pages:
listing costs milliseconds however big the sessions are. Not counted: the full-text
index, the b-trees' own pages and free pages (`kvchat sessions list` prints the file's
size beside the sum).

Giving space back. SQLite keeps the pages a delete frees for its later writes; the file
does not shrink by itself. A kvchat database runs in incremental auto-vacuum mode
(docs/decisions/0013-giving-disk-back.md): after a delete has committed, `give_back`
moves the pages at the end of the file into the freed ones and cuts the end off, in a
transaction of its own, then checkpoints the WAL so that the file shrinks at once. A
kill in between loses nothing: the delete is committed, and the next `give_back` frees
what this one did not.

The disk budget (`disk_budget`). After a save, when the sessions take more than the
budget, `fit` drops the recall tiers (cold rows only) of the least recently used
sessions first, never the one just saved, until they fit or no tier is left. Their
transcripts and snapshots stay, so they still resume, with an empty tier, as a session
whose rows cannot be read does. Their rows say when (`sessions.tier_dropped`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from sqlite_utils import Database

from kvchat.storage import cold
from kvchat.storage.rows import TierDrop

# `PRAGMA auto_vacuum` values.
INCREMENTAL = 2

# A session's bytes and its recall tier's, as SQL expressions on the row `s` of `sessions`.
COLD_BYTES = "(SELECT coalesce(sum(length(c.blob)), 0) FROM cold_rows c WHERE c.session_id = s.id)"
SESSION_BYTES = f"""(
    (SELECT coalesce(sum(length(CAST(m.text AS BLOB)) + length(m.token_ids) + length(m.metrics)), 0)
     FROM messages m WHERE m.session_id = s.id)
    + (SELECT coalesce(sum(length(sn.meta)), 0) FROM snapshots sn WHERE sn.session_id = s.id)
    + (SELECT coalesce(sum(length(t.blob)), 0) FROM snapshots sn
       JOIN snapshot_tensors t ON t.snapshot_id = sn.id WHERE sn.session_id = s.id)
    + {COLD_BYTES})"""


def file_bytes(db: Database) -> int:
    """The database's size as SQLite sees it (its pages, the WAL's newer ones included)."""
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    return int(pages) * int(db.execute("PRAGMA page_size").fetchone()[0])


def use_incremental_vacuum(conn: sqlite3.Connection, announce: Callable[[int], None] | None = None) -> bool:
    """Move a file made before migration m006 to incremental auto-vacuum: one VACUUM,
    outside any transaction (SQLite refuses one inside), which rewrites the whole file
    (tens of seconds for a GB: `announce(bytes)` is told first). VACUUM is atomic: a kill
    leaves the file as it was, and the next open tries again. False when it could not
    run now (another process kept the file busy, or the disk has no room for the copy
    VACUUM writes): the file works as before, and the next open or delete tries again."""
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == INCREMENTAL:
        return True
    if announce is not None:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        announce(int(pages) * int(conn.execute("PRAGMA page_size").fetchone()[0]))
    conn.execute(f"PRAGMA auto_vacuum = {INCREMENTAL}")  # takes effect with the VACUUM
    try:
        conn.execute("VACUUM")
    except sqlite3.OperationalError:
        return False
    _checkpoint(conn)
    return True


def give_back(conn: sqlite3.Connection) -> None:
    """After a delete has committed: hand the pages it freed back to the file system.
    When that cannot be done now (another process kept the file busy past the timeout,
    or the disk has no room for the WAL frames the move writes), the delete stands and
    the next `give_back` frees these pages too."""
    if not use_incremental_vacuum(conn):
        return
    try:
        # executescript steps the pragma to its end; execute would free one page per call.
        conn.executescript("PRAGMA incremental_vacuum;")
        _checkpoint(conn)
    except sqlite3.OperationalError:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def _checkpoint(conn: sqlite3.Connection) -> None:
    """Copy the WAL into the file and empty it, so that a shorter file is cut now. While
    another process reads, SQLite leaves the rest to a later checkpoint."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


def fit(db: Database, budget: int, keep: int, now: str) -> TierDrop | None:
    """Inside a write transaction: drop the recall tiers of the least recently used
    sessions (never `keep`'s) until the sessions take at most `budget` bytes, marking
    each row with `now`. None when nothing was dropped."""
    rows = db.execute(f"SELECT s.id, {SESSION_BYTES}, {COLD_BYTES} FROM sessions s ORDER BY s.updated, s.id").fetchall()
    total = sum(int(size) for _, size, _ in rows)
    dropped: list[int] = []
    freed = 0
    for sid, _, tier in rows:
        if total <= budget:
            break
        if sid == keep or not tier:
            continue
        cold.delete(db, sid)
        db.execute("UPDATE sessions SET tier_dropped = ? WHERE id = ?", [now, sid])
        dropped.append(int(sid))
        freed += int(tier)
        total -= int(tier)
    return TierDrop(budget, tuple(dropped), freed, total) if dropped else None
