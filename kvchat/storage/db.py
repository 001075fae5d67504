"""Persistence: sessions, messages and cache snapshots in one SQLite file (sqlite-utils).

`Store` is the database API; the schema and its migrations are in `migrations`, the bytes
of a snapshot (layer codec, incremental deltas) in `codec`, transcript export in `export`.
The store sees plain data only: JSON-able dicts and flat per-layer dicts of tensors
and scalars. It never imports the engine, the cache or a compressor.

Crash safety. A snapshot and all its layer blobs are written in one transaction; the
session's older snapshots are deleted in a second transaction, after the first has
committed. A kill at any point therefore leaves the old or the new snapshot complete
(WAL journal: uncommitted frames are discarded when the file is next opened). A delta
is written the same way, so a kill leaves its chain ending at the previous snapshot.

Sharing. WAL mode plus a busy timeout let two kvchat processes use one file; every
write starts with BEGIN IMMEDIATE (takes the write lock up front, so a transaction
never fails half-way on a lock) and waits up to `timeout_s` for it.

Threads. One Store may be used from several threads: one connection opened with
check_same_thread=False and every public method run under one re-entrant lock. SQLite
serialises writers anyway, and one connection keeps the row-hash memory and the
transactions in one place (a connection per thread would need the hashes shared too).

Errors that a user can meet (a foreign file, a newer schema, a locked or full
database) come out as a one-line `StoreError` saying the cause and the way out.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlite_utils import Database

from kvchat.errors import StoreError
from kvchat.paths import sessions_db
from kvchat.storage import branch, cold, disk, export, migrations, search
from kvchat.storage.migrations import table_of
from kvchat.storage.rows import Branch, MessageRow, SessionMatch, SessionRow, Snapshot, TierDrop

if TYPE_CHECKING:
    from kvchat.storage import codec

# The snapshot meta key whose value SessionRow.tokens reports (tokens seen so far).
TOKENS_META_KEY = "tokens_seen"

T = TypeVar("T")

# Compaction of a session's snapshot chain: a full snapshot after this many deltas, or
# when the deltas' bytes pass this share of the base's bytes (a resume then reads at
# most base * (1 + share)).
MAX_DELTAS = 16
COMPACT_SHARE = 0.5


def default_db_path() -> Path:
    """Where the database lives unless --db says otherwise: $KVCHAT_DB, else under the
    data home (see kvchat.paths); never relative to the current folder."""
    return sessions_db()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _guarded(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn sqlite3 errors escaping a Store method into a one-line StoreError."""

    @functools.wraps(fn)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> T:
        try:
            with self._lock:
                return fn(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    return wrapper


def _check_sqlite_utils() -> None:
    """sqlite-utils 3.x commits the caller's transaction inside .insert(); we need 4.x."""
    try:
        version = importlib.metadata.version("sqlite-utils")
    except importlib.metadata.PackageNotFoundError:
        return
    if int(version.split(".")[0]) < 4:
        raise StoreError(
            f"sqlite-utils {version} is too old; kvchat needs sqlite-utils>=4 (pip install -U 'sqlite-utils>=4')"
        )


def _no_session(session_id: int) -> StoreError:
    return StoreError(f"no session {session_id}; `kvchat sessions list` shows the saved ones")


def _is_locked(exc: sqlite3.Error) -> bool:
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


class Store:
    """The session database: one SQLite file, opened once per kvchat process."""

    def __init__(
        self,
        path: str | Path,
        *,
        timeout_s: float = 10.0,
        max_deltas: int = MAX_DELTAS,
        compact_share: float = COMPACT_SHARE,
        disk_budget: int | None = None,
        on_rewrite: Callable[[int], None] | None = None,
    ) -> None:
        """Open (or create) the database, refusing foreign or newer files without touching them.
        max_deltas/compact_share: when a snapshot chain is compacted into a full snapshot.
        disk_budget: the bytes the sessions may take (`fit_disk_budget`); None: no bound.
        on_rewrite(bytes): told before a file older than migration m006 is rewritten once
        (`disk.use_incremental_vacuum`), which takes a while for a big one."""
        _check_sqlite_utils()
        self.path = Path(path).expanduser()
        self.timeout_s = float(timeout_s)
        self.disk_budget = disk_budget
        self.max_deltas = int(max_deltas)
        self.compact_share = float(compact_share)
        self._db: Database | None = None
        self._lock = threading.RLock()
        self._chains: dict[int, codec.Chain] = {}
        self._cold = cold.ColdRows()  # which recall-tier rows each session has saved
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create the folder {parent} for the database "
                f"({exc.strerror or exc}); pass --db with a writable path"
            ) from None
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a database file; pass --db FILE")
        try:
            conn = sqlite3.connect(str(self.path), timeout=self.timeout_s, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.path} ({_one_line(exc)}); pass --db with a writable path") from None
        try:
            self._db = Database(conn)
            # Checks first: nothing is written to a file we are going to refuse.
            self._check_existing()
            ms = max(0, int(self.timeout_s * 1000))
            conn.execute(f"PRAGMA busy_timeout = {ms}")
            # Before WAL, whose header write fixes the mode of a new file: deletes give
            # their space back (kvchat/storage/disk.py). Nothing for an existing file.
            conn.execute(f"PRAGMA auto_vacuum = {disk.INCREMENTAL}")
            self._wait_for(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
            conn.execute("PRAGMA foreign_keys = ON")
            # Keep the WAL from staying at the size of the largest snapshot ever written.
            conn.execute("PRAGMA journal_size_limit = 67108864")
            self._migrate()
            disk.use_incremental_vacuum(conn, on_rewrite)  # a file older than migration m006: once
        except sqlite3.Error as exc:
            err = self._error(exc)
            self._abandon()
            raise err from None
        except BaseException:
            self._abandon()
            raise

    # -- opening --------------------------------------------------------------------

    def _abandon(self) -> None:
        if self._db is not None:
            try:
                self._db.conn.close()
            finally:
                self._db = None

    def _check_existing(self) -> None:
        """Refuse (read-only) a file that is not ours or whose schema is newer."""
        try:
            tables = set(self.db.table_names())
        except sqlite3.DatabaseError as exc:
            raise migrations.not_kvchat(self.path, _one_line(exc)) from None
        if tables:  # else a new or empty file
            migrations.check_existing(self.db, tables, self.path)

    def _migrate(self) -> None:
        """Apply missing migrations in order, under the write lock (two processes may race)."""
        with self._write() as db:
            migrations.apply(db, self.path, _now)

    @property
    def db(self) -> Database:
        """The sqlite-utils Database (for tests and tools); raises once closed."""
        if self._db is None:
            raise StoreError(f"the store for {self.path} is closed; open it again")
        return self._db

    @_guarded
    def schema_version(self) -> int:
        """Number of migrations applied to this file."""
        return len(migrations.applied(self.db))

    def close(self) -> None:
        """Close the connection (WAL is checkpointed by SQLite when the last one closes)."""
        with self._lock:
            self._abandon()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions and errors ------------------------------------------------------

    def _error(self, exc: sqlite3.Error) -> StoreError:
        msg = _one_line(exc)
        low = msg.lower()
        if _is_locked(exc):
            return StoreError(
                f"database {self.path} is locked by another process; close the other "
                "kvchat or pass --db to use another file"
            )
        if "not a database" in low:
            return migrations.not_kvchat(self.path, msg)
        if "malformed" in low or "corrupt" in low:
            return StoreError(f"{self.path} is damaged ({msg}); move it away or pass --db NEWFILE")
        if "full" in low:
            return StoreError(f"cannot write {self.path} ({msg}); free some disk space or pass --db")
        if "readonly" in low or "read-only" in low:
            return StoreError(f"cannot write {self.path} ({msg}); check its permissions or pass --db")
        if "closed" in low:
            return StoreError(f"the store for {self.path} is closed; open it again")
        return StoreError(f"database {self.path} failed ({msg}); pass --db NEWFILE to use another file")

    def _wait_for(self, op: Callable[[], T]) -> T:
        """Run op, retrying on 'database is locked' until timeout_s has passed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return op()
            except sqlite3.OperationalError as exc:
                if not _is_locked(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    @contextmanager
    def _write(self) -> Iterator[Database]:
        """One write transaction: BEGIN IMMEDIATE (waiting for the lock), COMMIT or ROLLBACK."""
        db = self.db
        conn = db.conn
        self._wait_for(lambda: conn.execute("BEGIN IMMEDIATE"))
        try:
            yield db
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        try:
            self._wait_for(lambda: conn.execute("COMMIT"))
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _read(self) -> Iterator[Database]:
        """One read transaction, so multi-query reads see one consistent state."""
        db = self.db
        conn = db.conn
        if conn.in_transaction:  # nested in another read or write: share it
            yield db
            return
        self._wait_for(lambda: conn.execute("BEGIN"))
        try:
            yield db
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    def _require_session(self, session_id: int) -> None:
        row = self.db.execute("SELECT 1 FROM sessions WHERE id = ?", [int(session_id)]).fetchone()
        if row is None:
            raise _no_session(session_id)

    def _touch(self, session_id: int) -> None:
        table_of(self.db, "sessions").update(int(session_id), {"updated": _now()})

    # -- sessions -----------------------------------------------------------------

    @_guarded
    def create_session(self, title: str, model_fingerprint: str, method: str, params: dict) -> int:
        """A new, empty session; returns its id."""
        now = _now()
        with self._write() as db:
            table = table_of(db, "sessions").insert(
                {
                    "title": title,
                    "model_fingerprint": model_fingerprint,
                    "method": method,
                    "params": json.dumps(params),
                    "created": now,
                    "updated": now,
                }
            )
            return int(table.last_pk)  # type: ignore[arg-type]  # last_pk: set by the insert

    def _session_rows(self, where: str = "", args: Sequence[Any] = ()) -> list[SessionRow]:
        sql = f"""
            SELECT s.id, s.title, s.model_fingerprint, s.method, s.params, s.created, s.updated,
                   s.origin_session_id, s.origin_turn,
                   (SELECT count(*) FROM messages m WHERE m.session_id = s.id),
                   (SELECT sn.meta FROM snapshots sn WHERE sn.session_id = s.id
                    ORDER BY sn.id DESC LIMIT 1),
                   {disk.SESSION_BYTES}, {disk.COLD_BYTES}, s.tier_dropped
            FROM sessions s {where}
            ORDER BY s.updated DESC, s.id DESC
        """
        out = []
        for row in self.db.execute(sql, list(args)):
            sid, title, fp, method, params, created, updated, origin_id, origin_turn, count, meta, *sizes = row
            tokens = 0
            if meta is not None:
                value = json.loads(meta).get(TOKENS_META_KEY, 0)
                tokens = int(value) if isinstance(value, (int, float)) else 0
            params = json.loads(params)
            size, cold_size, dropped = sizes
            out.append(
                SessionRow(
                    sid,
                    title,
                    fp,
                    method,
                    params,
                    created,
                    updated,
                    tokens,
                    count,
                    origin_id,
                    origin_turn,
                    int(size),
                    int(cold_size),
                    dropped,
                )
            )
        return out

    @_guarded
    def list_sessions(self) -> list[SessionRow]:
        """All sessions, most recently updated first."""
        with self._read():
            return self._session_rows()

    @_guarded
    def search(self, text: str, limit: int = 100) -> list[SessionMatch]:
        """Sessions with a message holding every word of `text` (plain words, never query
        syntax; the last word also as a prefix), newest first, at most `limit`, each with
        the snippet of its best-ranked match (see kvchat.storage.search)."""
        query = search.match_query(text)
        if not query:
            return []
        with self._read() as db:
            best = search.best_messages(db, query)
            where = "WHERE s.id IN (SELECT value FROM json_each(?))"
            rows = self._session_rows(where, [json.dumps(list(best))])[: max(0, int(limit))]
            raw = search.snippets(db, query, [best[r.id][0] for r in rows])
        found = []
        for row in rows:
            message_id, count = best[row.id]
            snippet, marks = search.shape_snippet(raw.get(message_id, ""))
            found.append(SessionMatch(**vars(row), snippet=snippet, marks=marks, matches=count))
        return found

    @_guarded
    def get_session(self, session_id: int) -> SessionRow:
        """One session, or StoreError naming the way to list the saved ones."""
        with self._read():
            rows = self._session_rows("WHERE s.id = ?", [int(session_id)])
        if not rows:
            raise _no_session(session_id)
        return rows[0]

    @_guarded
    def update_session(
        self,
        session_id: int,
        *,
        title: str | None = None,
        method: str | None = None,
        params: dict | None = None,
    ) -> None:
        """Change the given fields (None = keep) and bump `updated`."""
        changes: dict[str, Any] = {"updated": _now()}
        if title is not None:
            changes["title"] = title
        if method is not None:
            changes["method"] = method
        if params is not None:
            changes["params"] = json.dumps(params)
        with self._write() as db:
            self._require_session(session_id)
            table_of(db, "sessions").update(int(session_id), changes)

    @_guarded
    def delete_session(self, session_id: int) -> None:
        """Remove a session with its messages and snapshots, in one transaction (a trigger
        takes the messages out of the search index: plain DELETEs, no FK cascade), then
        give the space back to the file system (kvchat/storage/disk.py)."""
        sid = int(session_id)
        with self._write() as db:
            self._require_session(sid)
            table_of(db, "snapshot_tensors").delete_where(
                "snapshot_id IN (SELECT id FROM snapshots WHERE session_id = ?)", [sid]
            )
            table_of(db, "snapshots").delete_where("session_id = ?", [sid])
            cold.delete(db, sid)
            table_of(db, "messages").delete_where("session_id = ?", [sid])
            table_of(db, "sessions").delete(sid)
            # Its branches stay, as branches of a deleted session (an id SQLite may reuse
            # must not name a stranger as their origin).
            db.execute("UPDATE sessions SET origin_session_id = NULL WHERE origin_session_id = ?", [sid])
        self._chains.pop(sid, None)
        self._cold.forget(sid)
        disk.give_back(self.db.conn)

    @_guarded
    def fit_disk_budget(self, keep: int) -> TierDrop | None:
        """After a save of session `keep`: when the sessions take more than the disk budget,
        drop the recall tiers of the least recently used others, in one transaction, and
        give their space back (`disk.fit`). None without a budget or when nothing was dropped."""
        if self.disk_budget is None:
            return None
        with self._write() as db:
            dropped = disk.fit(db, self.disk_budget, int(keep), _now())
        if dropped is not None:
            for sid in dropped.sessions:
                self._cold.forget(sid)
            disk.give_back(self.db.conn)
        return dropped

    @_guarded
    def file_bytes(self) -> int:
        """The database's size (`disk.file_bytes`)."""
        return disk.file_bytes(self.db)

    @_guarded
    def branch_session(self, session_id: int, at: int) -> Branch:
        """A new session sharing the first `at` turns of `session_id` (a turn: a user
        message and its answer; 0 = none), with the original's title and settings and its
        origin recorded; the original is not changed. The branch gets a copy of the
        original's snapshot when that is of turn `at`, else none (rebuild it from the
        transcript). One transaction. StoreError for an unknown id or turn."""
        with self._write() as db:
            return branch.make_branch(db, session_id, at, _now, lambda sid: self._chain_ids(db, sid))

    @_guarded
    def last_session_id(self) -> int | None:
        """The most recently updated session (what `--resume` with no id picks)."""
        row = self.db.execute("SELECT id FROM sessions ORDER BY updated DESC, id DESC LIMIT 1").fetchone()
        return None if row is None else int(row[0])

    # -- messages -----------------------------------------------------------------

    @_guarded
    def add_message(
        self,
        session_id: int,
        role: str,
        text: str,
        token_ids: list[int],
        metrics: dict | None = None,
    ) -> int:
        """Append one message (and bump the session's `updated`); returns its id."""
        with self._write() as db:
            self._require_session(session_id)
            message_id = self._insert_message(db, session_id, role, text, token_ids, metrics)
            self._touch(session_id)
        return message_id

    def _insert_message(
        self,
        db: Database,
        session_id: int,
        role: str,
        text: str,
        token_ids: list[int],
        metrics: dict | None,
    ) -> int:
        row = {
            "session_id": int(session_id),
            "role": role,
            "text": text,
            "token_ids": json.dumps([int(t) for t in token_ids]),
            "metrics": json.dumps(metrics or {}),
            "created": _now(),
        }
        return int(table_of(db, "messages").insert(row).last_pk)  # type: ignore[arg-type]  # last_pk: set by the insert

    @_guarded
    def messages(self, session_id: int) -> list[MessageRow]:
        """The transcript of a session, oldest first."""
        with self._read() as db:
            self._require_session(session_id)
            rows = db.execute(
                "SELECT id, session_id, role, text, token_ids, metrics, created "
                "FROM messages WHERE session_id = ? ORDER BY id",
                [int(session_id)],
            ).fetchall()
        return [
            MessageRow(mid, sid, role, text, json.loads(ids), json.loads(metrics), created)
            for mid, sid, role, text, ids, metrics, created in rows
        ]

    # -- snapshots ----------------------------------------------------------------

    @_guarded
    def save_snapshot(self, session_id: int, turn: int, meta: dict, layers: list[dict]) -> int:
        """Write a snapshot atomically (a delta on the session's newest one when this
        Store knows it, else full), then drop what it replaced; returns its id."""
        return self.save_turn(session_id, [], turn, meta, layers)

    @_guarded
    def save_turn(
        self,
        session_id: int,
        messages: Sequence[Mapping[str, Any]],
        turn: int,
        meta: dict,
        layers: list[dict],
        session_changes: Mapping[str, Any] | None = None,
        cold_rows: Sequence[Sequence[cold.Segment]] | None = None,
        whole_tier: bool = False,
    ) -> int:
        """One turn in one transaction: its messages (dicts with role, text, token_ids and
        optionally metrics), its snapshot, its recall tier's rows (per layer, as segments;
        None: no tier, see kvchat/storage/cold.py) and the session row's changes (title,
        method, params). A kill at any point leaves all of it or none. Returns the snapshot id.
        `whole_tier`: the cache was read again from the transcript, so its recall tier is
        whole again: the mark of a tier the disk budget dropped goes.

        Layers are serialised one at a time inside the transaction, so peak extra
        memory is one layer's blob, not the whole cache."""
        from kvchat.storage import codec  # torch: loaded with the first snapshot, not with the store

        sid = int(session_id)
        try:
            meta_json = json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"snapshot meta must be JSON-able ({exc})") from None
        changes: dict[str, Any] = {"updated": _now()}
        for name, value in (session_changes or {}).items():
            if value is not None:
                changes[name] = json.dumps(value) if name == "params" else value
        if whole_tier:
            changes["tier_dropped"] = None
        with self._write() as db:
            self._require_session(sid)
            for m in messages:
                self._insert_message(db, sid, m["role"], m["text"], m["token_ids"], m.get("metrics"))
            chain = self._chains.get(sid)
            newest = db.execute("SELECT max(id) FROM snapshots WHERE session_id = ?", [sid]).fetchone()[0]
            if chain is not None and (
                chain.snapshot_id != newest  # another Store wrote since
                or chain.deltas >= self.max_deltas
                or chain.delta_bytes > self.compact_share * chain.base_bytes
                or len(chain.layers) != len(layers)
            ):
                chain = None
            row = {
                "session_id": sid,
                "turn": int(turn),
                "meta": meta_json,
                "created": _now(),
                "parent_id": None if chain is None else chain.snapshot_id,
            }
            snapshot_id = int(table_of(db, "snapshots").insert(row).last_pk)  # type: ignore[arg-type]  # last_pk: set by the insert
            written, remembered = 0, []
            for index, layer in enumerate(layers):
                old = None if chain is None else chain.layers[index]
                hints = {k: v.dim for k, v in old.items()} if old else {}
                part, extra, remember = codec.plan_layer(layer, old, hints)
                blob = codec.encode_layer(part, extra)
                written += len(blob)
                table_of(db, "snapshot_tensors").insert({"snapshot_id": snapshot_id, "layer": index, "blob": blob})
                remembered.append(remember)
                del blob, part
            _, cold_saved = self._cold.write(db, sid, newest, cold_rows)
            table_of(db, "sessions").update(sid, changes)
        # Committed: only now may what it replaces be dropped and the hashes move on.
        self._cold.commit(sid, snapshot_id, cold_saved)
        if chain is None:
            self._chains[sid] = codec.Chain(snapshot_id, snapshot_id, written, 0, 0, remembered)
        else:
            self._chains[sid] = codec.Chain(
                snapshot_id,
                chain.base_id,
                chain.base_bytes,
                chain.delta_bytes + written,
                chain.deltas + 1,
                remembered,
            )
        # Everything before the chain's base (an old chain, or one a kill left behind).
        self._drop_older_snapshots(sid, self._chains[sid].base_id)
        return snapshot_id

    def _drop_older_snapshots(self, session_id: int, keep_id: int) -> None:
        with self._write() as db:
            table_of(db, "snapshot_tensors").delete_where(
                "snapshot_id IN (SELECT id FROM snapshots WHERE session_id = ? AND id < ?)",
                [session_id, keep_id],
            )
            table_of(db, "snapshots").delete_where("session_id = ? AND id < ?", [session_id, keep_id])

    def _chain_ids(self, db: Database, snapshot_id: int) -> list[int]:
        """Ids from the full snapshot to `snapshot_id`, oldest first."""
        ids: list[int] = []
        current: int | None = snapshot_id
        while current is not None:
            ids.append(current)
            row = db.execute("SELECT parent_id FROM snapshots WHERE id = ?", [current]).fetchone()
            if row is None:
                raise StoreError(
                    f"{self.path}: snapshot {ids[-2] if len(ids) > 1 else current} misses its base "
                    f"{current}; rebuild the cache from the transcript"
                )
            current = row[0]
        return ids[::-1]

    def _read_layer(self, db: Database, snapshot_id: int, index: int, parent: dict | None) -> tuple[dict, dict]:
        from kvchat.storage import codec  # torch: loaded with the first snapshot, not with the store

        row = db.execute(
            "SELECT blob FROM snapshot_tensors WHERE snapshot_id = ? AND layer = ?", [snapshot_id, index]
        ).fetchone()
        if row is None:
            raise StoreError(
                f"{self.path}: snapshot {snapshot_id} misses layer {index}; rebuild the cache from the transcript"
            )
        try:
            return codec.decode_layer(row[0], parent), codec.layer_dims(row[0])
        except Exception as exc:  # safetensors/json errors on a damaged blob
            raise StoreError(
                f"{self.path}: snapshot {snapshot_id} layer {index} is unreadable "
                f"({_one_line(exc)}); rebuild the cache from the transcript"
            ) from None

    @_guarded
    def load_snapshot(self, session_id: int) -> Snapshot | None:
        """The session's newest complete snapshot (tensors on CPU), or None if it has none.
        A delta is applied to its chain layer by layer, so peak memory is the result plus
        one layer."""
        from kvchat.storage import codec  # torch: loaded with the first snapshot, not with the store

        with self._read() as db:
            self._require_session(session_id)
            row = db.execute(
                "SELECT id, session_id, turn, meta, created FROM snapshots "
                "WHERE session_id = ? ORDER BY id DESC LIMIT 1",
                [int(session_id)],
            ).fetchone()
            if row is None:
                return None
            snapshot_id, sid, turn, meta, created = row
            ids = self._chain_ids(db, snapshot_id)
            count = db.execute("SELECT count(*) FROM snapshot_tensors WHERE snapshot_id = ?", [snapshot_id]).fetchone()[
                0
            ]
            layers: list[dict[str, codec.LayerValue]] = []
            remembered: list[dict[str, codec.Stored]] = []
            for index in range(count):
                layer: dict | None = None
                for link in ids:
                    layer, dims = self._read_layer(db, link, index, layer)
                assert layer is not None
                layers.append(layer)
                remembered.append(codec.remember_layer(layer, dims))
            sizes = db.execute(
                "SELECT snapshot_id, sum(length(blob)) FROM snapshot_tensors WHERE snapshot_id IN "
                f"({','.join('?' * len(ids))}) GROUP BY snapshot_id",
                ids,
            ).fetchall()
        by_id = dict(sizes)
        base = int(by_id.get(ids[0], 0))
        self._chains[int(sid)] = codec.Chain(
            snapshot_id, ids[0], base, sum(int(by_id.get(i, 0)) for i in ids[1:]), len(ids) - 1, remembered
        )
        return Snapshot(snapshot_id, sid, turn, json.loads(meta), layers, created)

    @_guarded
    def load_cold(
        self,
        session_id: int,
        snapshot_id: int,
        sink: Callable[[int, Any], None],
        held: Callable[[], Sequence[Sequence[cold.Segment]] | None],
    ) -> None:
        """Hand the saved recall-tier rows of snapshot `snapshot_id` (the newest) to
        `sink(layer, rows)`, then remember `held()` as them (`cold.ColdRows.load`)."""
        with self._read() as db:
            self._require_session(session_id)
            self._cold.load(db, session_id, snapshot_id, sink, held)

    @_guarded
    def snapshot_meta(self, session_id: int) -> dict | None:
        """The meta of the session's newest snapshot without its tensors (None without one)."""
        with self._read() as db:
            self._require_session(session_id)
            row = db.execute(
                "SELECT meta FROM snapshots WHERE session_id = ? ORDER BY id DESC LIMIT 1", [int(session_id)]
            ).fetchone()
        return None if row is None else json.loads(row[0])

    @_guarded
    def snapshot_bytes(self, session_id: int) -> int:
        """Bytes on disk of the session's snapshot chain (base + deltas; 0 without one)."""
        row = self.db.execute(
            "SELECT coalesce(sum(length(t.blob)), 0) FROM snapshot_tensors t "
            "JOIN snapshots s ON s.id = t.snapshot_id WHERE s.session_id = ?",
            [int(session_id)],
        ).fetchone()
        return int(row[0])

    @_guarded
    def last_write_bytes(self, session_id: int) -> int:
        """Bytes of the newest snapshot's own blobs (a delta's, or the full one's)."""
        row = self.db.execute(
            "SELECT coalesce(sum(length(blob)), 0) FROM snapshot_tensors WHERE snapshot_id = "
            "(SELECT max(id) FROM snapshots WHERE session_id = ?)",
            [int(session_id)],
        ).fetchone()
        return int(row[0])

    # -- export -------------------------------------------------------------------

    @_guarded
    def export_session(self, session_id: int, fmt: str) -> str:
        """The transcript as Markdown ("md") or JSON ("json": session + messages, no tensors)."""
        export.check_format(fmt)
        with self._read():
            session = self.get_session(session_id)
            messages = self.messages(session_id)
        return export.render(session, messages, fmt)
