"""The database schema as numbered migrations (simonw/llm style), and the code that
records, applies and checks them.

Each migration is a function applied once, in order, inside the write transaction that
opens the file, and recorded by name in the `_migrations` table. The schema version is the
number of migrations applied. A file with migrations this kvchat does not know (a newer
schema) or with no `_migrations` table (not a kvchat database) is refused untouched.
Never edit a released migration; append a new one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from sqlite_utils import Database
from sqlite_utils.db import Table

from kvchat.errors import StoreError

MIGRATIONS_TABLE = "_migrations"


def table_of(db: Database, name: str) -> Table:
    """`db[name]` as the table it is: sqlite-utils types it as a table or a view, and the
    schema has no views (a cast; it checks nothing)."""
    return cast(Table, db[name])


def m001_initial(db: Database) -> None:
    """Sessions, their messages, their snapshots and the snapshots' per-layer blobs."""
    table_of(db, "sessions").create(
        {
            "id": int,
            "title": str,
            "model_fingerprint": str,
            "method": str,
            "params": str,  # JSON
            "created": str,
            "updated": str,
        },
        pk="id",
        not_null=["title", "model_fingerprint", "method", "params", "created", "updated"],
    )
    table_of(db, "messages").create(
        {
            "id": int,
            "session_id": int,
            "role": str,
            "text": str,
            "token_ids": str,  # JSON list
            "metrics": str,  # JSON object
            "created": str,
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
        not_null=["session_id", "role", "text", "token_ids", "metrics", "created"],
    )
    table_of(db, "messages").create_index(["session_id"])
    table_of(db, "snapshots").create(
        {"id": int, "session_id": int, "turn": int, "meta": str, "created": str},
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
        not_null=["session_id", "turn", "meta", "created"],
    )
    table_of(db, "snapshots").create_index(["session_id"])
    # The compound primary key's index starts with snapshot_id, so it serves the
    # foreign key too; no separate index.
    table_of(db, "snapshot_tensors").create(
        {"snapshot_id": int, "layer": int, "blob": bytes},
        pk=("snapshot_id", "layer"),
        foreign_keys=[("snapshot_id", "snapshots", "id")],
        not_null=["snapshot_id", "layer", "blob"],
    )


def m002_snapshot_parent(db: Database) -> None:
    """Incremental snapshots: a delta names the snapshot it applies to (NULL = full)."""
    table_of(db, "snapshots").add_column("parent_id", int)


def m003_message_search(db: Database) -> None:
    """Full-text search over the messages: an FTS5 index on `messages.text` (external
    content, so the text is stored once), filled with the messages already saved and kept
    in step by triggers on insert, update and delete."""
    try:
        table_of(db, "messages").enable_fts(["text"], fts_version="FTS5", create_triggers=True)
    except sqlite3.OperationalError as exc:
        if "fts5" not in str(exc).lower():
            raise
        raise StoreError(
            f"this Python's SQLite {sqlite3.sqlite_version} has no FTS5 full-text search, which "
            "kvchat's sessions need; use a Python whose sqlite3 module has FTS5"
        ) from None


def m004_session_origin(db: Database) -> None:
    """Branches: the session (and the turn of it) a session was branched from; NULL for
    a session that is no branch. No foreign key: deleting the original must not be
    blocked by its branches (`Store.delete_session` clears their id, keeps the turn)."""
    table_of(db, "sessions").add_column("origin_session_id", int)
    table_of(db, "sessions").add_column("origin_turn", int)


def m005_cold_rows(db: Database) -> None:
    """The recall tier of a saved session (kvchat/storage/cold.py): per session and layer,
    runs of its exact cold rows [start, start + rows) as safetensors blobs, written in the
    transaction of the snapshot they belong to. The primary key's index starts with the
    session, so it serves the foreign key and every query too."""
    table_of(db, "cold_rows").create(
        {"session_id": int, "layer": int, "start": int, "rows": int, "blob": bytes},
        pk=("session_id", "layer", "start"),
        foreign_keys=[("session_id", "sessions", "id")],
        not_null=["session_id", "layer", "start", "rows", "blob"],
    )


def m006_disk_budget(db: Database) -> None:
    """The disk budget (kvchat/storage/disk.py): when a session's recall tier was dropped
    to keep the saved sessions under it (NULL: never). A file this migration finds also
    moves to incremental auto-vacuum, so that a delete gives its space back; that takes
    one VACUUM, which SQLite refuses inside a transaction, so the Store runs it right
    after the transaction that applied this one commits (`disk.use_incremental_vacuum`)."""
    table_of(db, "sessions").add_column("tier_dropped", str)


MIGRATIONS: list[Callable[[Database], None]] = [
    m001_initial,
    m002_snapshot_parent,
    m003_message_search,
    m004_session_origin,
    m005_cold_rows,
    m006_disk_budget,
]
SCHEMA_VERSION = len(MIGRATIONS)


def not_kvchat(path: Path, why: str) -> StoreError:
    """The error for a file that is not a kvchat database."""
    return StoreError(f"{path} is not a kvchat database ({why}); move it away or pass --db NEWFILE")


def applied(db: Database) -> list[str]:
    """Names of the migrations recorded in this file, in the table's order."""
    rows = db.execute(f"SELECT name FROM [{MIGRATIONS_TABLE}]").fetchall()
    return [r[0] for r in rows]


def check_existing(db: Database, tables: set[str], path: Path) -> None:
    """Refuse a non-empty file (with these `tables`) that is not ours or whose schema is
    newer than this kvchat's. Reads only."""
    if MIGRATIONS_TABLE not in tables:
        names = ", ".join(sorted(tables))
        raise not_kvchat(path, f"it has tables {names} and no kvchat schema")
    check_versions(applied(db), path)


def check_versions(done: Sequence[str], path: Path) -> None:
    """Refuse a file with more migrations than this kvchat has, or one it does not know."""
    if len(done) > SCHEMA_VERSION:
        raise StoreError(
            f"{path} was written by a newer kvchat (schema {len(done)} > "
            f"{SCHEMA_VERSION}); upgrade kvchat or use another --db"
        )
    known = {m.__name__ for m in MIGRATIONS}
    unknown = [name for name in done if name not in known]
    if unknown:
        raise StoreError(
            f"{path} has schema migration {unknown[0]!r} that this kvchat does not "
            "know; upgrade kvchat or use another --db"
        )


def apply(db: Database, path: Path, now: Callable[[], str]) -> None:
    """Apply the missing migrations in order, recording each with the time `now()` gives.
    Run it inside one write transaction: two processes may open a new file at once."""
    if MIGRATIONS_TABLE not in db.table_names():
        table_of(db, MIGRATIONS_TABLE).create({"name": str, "applied_at": str}, pk="name")
    done = applied(db)
    check_versions(done, path)
    for migration in MIGRATIONS:
        if migration.__name__ not in done:
            migration(db)
            table_of(db, MIGRATIONS_TABLE).insert({"name": migration.__name__, "applied_at": now()})
