"""Persistence: sessions, messages and cache snapshots in one SQLite file (sqlite-utils).

The store sees plain data only: JSON-able dicts and flat per-layer dicts of tensors
and scalars. It never imports the engine, the cache or a compressor.

Crash safety. A snapshot and all its layer blobs are written in one transaction; the
session's older snapshots are deleted in a second transaction, after the first has
committed. A kill at any point therefore leaves the old or the new snapshot complete
(WAL journal: uncommitted frames are discarded when the file is next opened).

Sharing. WAL mode plus a busy timeout let two kvchat processes use one file; every
write starts with BEGIN IMMEDIATE (takes the write lock up front, so a transaction
never fails half-way on a lock) and waits up to `timeout_s` for it.

Incremental snapshots. A snapshot is either full (`parent_id` NULL) or a delta on its
parent. For every tensor of a layer the store remembers, in memory, one 64-bit hash per
row along the tensor's row dimension (the one that grows: a cache's sequence axis). The
next snapshot of that session compares row hashes instead of tensors, so no second copy
of the cache is kept: a tensor whose leading rows equal a contiguous run of the stored
rows (unchanged, appended to, or a sliding window that shifted) is written as that run's
offset + the new rows; one whose rows were dropped, moved or partly replaced (eviction,
merges) as a source row index per row + the rows not found; anything else is written whole. After `MAX_DELTAS` deltas, or when
the chain's delta bytes pass `COMPACT_SHARE` of its base, the next save is full again and
the chain is dropped once it has committed. A delta is one transaction like a full one,
so a kill while it is written leaves the chain ending at the previous complete state.

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
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import safetensors.torch
import torch
from sqlite_utils import Database
from torch import Tensor

from .paths import ENV_DB, sessions_db  # noqa: F401 (ENV_DB: re-exported for existing importers)

# The snapshot meta key whose value SessionRow.tokens reports (tokens seen so far).
TOKENS_META_KEY = "tokens_seen"

# Key in a layer blob's safetensors metadata holding the scalars and the key order.
_LAYER_META_KEY = "kvchat"
_LAYER_FORMAT = 1

# Compaction: a full snapshot after this many deltas, or when the deltas' bytes pass
# this share of the base's bytes (a resume then reads at most base * (1 + share)).
MAX_DELTAS = 16
COMPACT_SHARE = 0.5

Scalar = int | float | str | bool
LayerValue = Tensor | int | float | str | bool
T = TypeVar("T")


class StoreError(Exception):
    """A problem with the session database that the user can act on (one-line message)."""


def default_db_path() -> Path:
    """Where the database lives unless --db says otherwise: $KVCHAT_DB, else under the
    data home (see kvchat.paths); never relative to the current folder."""
    return sessions_db()


@dataclass
class SessionRow:
    """One saved conversation, with what the session list shows."""

    id: int
    title: str
    model_fingerprint: str
    method: str
    params: dict
    created: str
    updated: str
    tokens: int = 0  # meta[TOKENS_META_KEY] of the newest snapshot, 0 without one
    message_count: int = 0


@dataclass
class MessageRow:
    """One turn of the transcript; token ids are kept so the cache can be rebuilt."""

    id: int
    session_id: int
    role: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    created: str = ""


@dataclass
class Snapshot:
    """A saved cache state: JSON meta plus one flat dict of tensors/scalars per layer."""

    id: int
    session_id: int
    turn: int
    meta: dict
    layers: list[dict[str, LayerValue]]
    created: str


# ---------------------------------------------------------------------------------
# Schema migrations (simonw/llm style): applied once each, in order, recorded by name.
# The schema version is the number of migrations applied. Never edit a released
# migration; append a new one.


def m001_initial(db: Database) -> None:
    """Sessions, their messages, their snapshots and the snapshots' per-layer blobs."""
    db["sessions"].create(
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
    db["messages"].create(
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
    db["messages"].create_index(["session_id"])
    db["snapshots"].create(
        {"id": int, "session_id": int, "turn": int, "meta": str, "created": str},
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
        not_null=["session_id", "turn", "meta", "created"],
    )
    db["snapshots"].create_index(["session_id"])
    # The compound primary key's index starts with snapshot_id, so it serves the
    # foreign key too; no separate index.
    db["snapshot_tensors"].create(
        {"snapshot_id": int, "layer": int, "blob": bytes},
        pk=("snapshot_id", "layer"),
        foreign_keys=[("snapshot_id", "snapshots", "id")],
        not_null=["snapshot_id", "layer", "blob"],
    )


def m002_snapshot_parent(db: Database) -> None:
    """Incremental snapshots: a delta names the snapshot it applies to (NULL = full)."""
    db["snapshots"].add_column("parent_id", int)


MIGRATIONS: list[Callable[[Database], None]] = [m001_initial, m002_snapshot_parent]
SCHEMA_VERSION = len(MIGRATIONS)
_MIGRATIONS_TABLE = "_migrations"


# ---------------------------------------------------------------------------------
# Layer (de)serialisation: safetensors bytes, scalars JSON-encoded in the metadata.


def encode_layer(layer: Mapping[str, LayerValue], extra: Mapping[str, Any] | None = None) -> bytes:
    """One layer dict -> safetensors bytes (tensors on CPU, dtype kept; scalars typed).

    `extra` goes into the blob's metadata beside the key order (row dims, delta runs)."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Scalar | None] = {}
    storages: set[int] = set()
    for key, value in layer.items():
        if not isinstance(key, str):
            raise TypeError(f"layer keys must be str, got {key!r}")
        if isinstance(value, Tensor):
            t = value.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in storages:
                t = t.clone()  # safetensors refuses tensors that share memory
            elif t.numel():
                storages.add(ptr)
            tensors[key] = t
        elif value is None or isinstance(value, (bool, int, float, str)):
            scalars[key] = value
        else:
            raise TypeError(
                f"layer value {key!r} is {type(value).__name__}; "
                "the store takes tensors, int, float, str or bool"
            )
    order = [key for key in layer if not key.startswith(_SRC)]  # source indices are not layer keys
    meta = {"format": _LAYER_FORMAT, "order": order, "scalars": scalars, **(extra or {})}
    return safetensors.torch.save(tensors, metadata={_LAYER_META_KEY: json.dumps(meta)})


def _layer_meta(blob: bytes) -> dict[str, Any]:
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    return json.loads(header.get("__metadata__", {}).get(_LAYER_META_KEY, "{}"))


def decode_layer(blob: bytes, parent: Mapping[str, LayerValue] | None = None) -> dict[str, LayerValue]:
    """safetensors bytes written by encode_layer -> the layer dict, in its original key order.

    A delta blob names, per tensor, the run [start, start + count) of the parent's rows
    along its row dim that precedes the rows it stores; `parent` is that decoded layer."""
    meta = _layer_meta(blob)
    tensors = safetensors.torch.load(blob)
    runs = meta.get("runs", {})
    gathers = meta.get("gathers", {})
    if (runs or gathers) and parent is None:
        raise ValueError("a delta layer needs the layer it applies to")
    for key in [*runs, *gathers]:
        if not isinstance(parent.get(key), Tensor):  # type: ignore[union-attr]
            raise ValueError(f"delta key {key!r} has no tensor to apply to")
    for key, (dim, start, count) in runs.items():
        base = parent[key]  # type: ignore[index]
        tensors[key] = torch.cat([base.narrow(dim, start, count), tensors[key]], dim)
    for key, (dim, shape) in gathers.items():
        tensors[key] = _apply_gather(parent[key], dim, shape, tensors.pop(_SRC + key), tensors[key])  # type: ignore[index, arg-type]
    scalars = meta.get("scalars", {})
    values: dict[str, Any] = {**tensors, **scalars}
    order = meta.get("order", list(values))
    return {key: values[key] for key in order}


# ---------------------------------------------------------------------------------
# Row hashes: what the store remembers of a written tensor, instead of the tensor.

_HASH_SEED = 0x6B766368


@functools.lru_cache(maxsize=64)
def _hash_weights(words: int) -> Tensor:
    """Fixed odd 64-bit weights: a row's hash is its words' weighted sum mod 2**64."""
    gen = torch.Generator().manual_seed(_HASH_SEED + words)
    return torch.randint(-(2**62), 2**62, (words,), generator=gen, dtype=torch.int64) * 2 + 1


def row_hashes(t: Tensor, dim: int) -> Tensor:
    """int64 [lead, rows]: one hash per row of `t` along `dim`, per index of the dims before it.

    A linear hash with random odd weights: rows that differ collide with probability about
    2**-64 (more only for rows differing solely in high bits of every word). It costs one
    pass over the tensor and keeps 8 bytes per row instead of the row."""
    t = t.detach().to("cpu").contiguous()
    lead = 1
    for size in t.shape[:dim]:
        lead *= size
    rows = t.shape[dim]
    if t.numel() == 0:
        return torch.zeros(lead, rows, dtype=torch.int64)
    raw = t.reshape(-1).view(torch.uint8).reshape(lead, rows, -1)
    words = raw.view(torch.int64) if raw.shape[-1] % 8 == 0 else raw.to(torch.int64)
    return (words * _hash_weights(words.shape[-1])).sum(-1)


@dataclass
class _Stored:
    """What the store keeps of one written tensor: its layout and its row hashes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    hashes: Tensor


@dataclass
class _Chain:
    """The newest snapshot of a session as this Store wrote or read it."""

    snapshot_id: int
    base_id: int
    base_bytes: int
    delta_bytes: int
    deltas: int
    layers: list[dict[str, _Stored]]


def _row_dim(t: Tensor, old: _Stored | None, hint: int | None) -> int:
    """The dim that grows: the one whose size changed, else the remembered one, else the longest."""
    if old is not None and old.dtype == t.dtype and len(old.shape) == t.ndim:
        changed = [i for i in range(t.ndim) if old.shape[i] != t.shape[i]]
        if len(changed) == 1:
            return changed[0]
        if not changed:
            return old.dim
    if hint is not None and 0 <= hint < t.ndim:
        return hint
    return max(range(t.ndim), key=lambda i: t.shape[i])


def _longest_run(new: Tensor, old: Tensor) -> tuple[int, int]:
    """(start, count): the most leading rows of `new` equal to old[:, start:start+count]
    for every lead index, with the run reaching the end of old or of new (unchanged,
    appended, or a window shifted left)."""
    if new.shape[0] != old.shape[0] or new.shape[1] == 0 or old.shape[1] == 0:
        return 0, 0
    first = new[:, 0:1]
    candidates = torch.nonzero((old == first).all(0)).flatten().tolist()
    best = (0, 0)
    for start in candidates[:8]:
        count = min(old.shape[1] - start, new.shape[1])
        if count > best[1] and torch.equal(new[:, :count], old[:, start : start + count]):
            best = (start, count)
    return best


_SRC = "#src#"  # blob key prefix of a gathered tensor's source-row indices


def _match_rows(new: Tensor, old: Tensor) -> Tensor:
    """int32 [lead, n_new]: for each new row the index of an old row with the same hash
    (same lead index), -1 where there is none."""
    if old.shape[1] == 0:
        return torch.full(new.shape, -1, dtype=torch.int32)
    ordered, order = old.sort(dim=1)
    at = torch.searchsorted(ordered, new.contiguous()).clamp(max=old.shape[1] - 1)
    found = ordered.gather(1, at) == new
    return torch.where(found, order.gather(1, at), -1).to(torch.int32)


def _apply_gather(base: Tensor, dim: int, shape: list[int], src: Tensor, fresh: Tensor) -> Tensor:
    """Rebuild a tensor from the parent's rows named by `src` and the stored fresh rows."""
    lead, rows = src.shape
    old = base.contiguous().reshape(lead, base.shape[dim], -1)
    out = torch.empty(lead, rows, old.shape[-1], dtype=base.dtype)
    found = src >= 0
    heads = torch.arange(lead).unsqueeze(1).expand(lead, rows)
    out[found] = old[heads[found], src[found].long()]
    out[~found] = fresh.to(base.dtype)
    return out.reshape(shape)


def _plan_layer(
    layer: Mapping[str, LayerValue], old: dict[str, _Stored] | None, hints: Mapping[str, int]
) -> tuple[dict[str, LayerValue], dict[str, Any], dict[str, _Stored]]:
    """(what to write, blob metadata, what to remember) for one layer; old=None: whole."""
    write: dict[str, LayerValue] = {}
    dims: dict[str, int] = {}
    runs: dict[str, list[int]] = {}
    gathers: dict[str, list[Any]] = {}
    remember: dict[str, _Stored] = {}
    for key, value in layer.items():
        if not isinstance(value, Tensor) or value.ndim == 0:
            write[key] = value
            continue
        previous = old.get(key) if old is not None else None
        dim = _row_dim(value, previous, hints.get(key))
        hashes = row_hashes(value, dim)
        dims[key] = dim
        remember[key] = _Stored(tuple(value.shape), value.dtype, dim, hashes)
        comparable = (
            previous is not None
            and previous.dim == dim
            and previous.dtype == value.dtype
            and len(previous.shape) == value.ndim
            and all(previous.shape[i] == value.shape[i] for i in range(value.ndim) if i != dim)
        )
        if not comparable:
            write[key] = value
            continue
        assert previous is not None
        start, count = _longest_run(hashes, previous.hashes)
        src = _match_rows(hashes[:, count:], previous.hashes)
        if count and bool((src < 0).all()):  # unchanged, appended, or a shifted window
            runs[key] = [dim, start, count]
            write[key] = value.narrow(dim, count, value.shape[dim] - count)
            continue
        src = _match_rows(hashes, previous.hashes)
        found = src >= 0
        if bool(found.any()):  # rows dropped, moved or replaced (eviction, merges)
            gathers[key] = [dim, list(value.shape)]
            lead = hashes.shape[0]
            write[key] = value.detach().to("cpu").contiguous().reshape(lead, hashes.shape[1], -1)[~found]
            write[_SRC + key] = src
        else:
            write[key] = value
    extra: dict[str, Any] = {"dims": dims}
    if runs:
        extra["runs"] = runs
    if gathers:
        extra["gathers"] = gathers
    return write, extra, remember


def _remember_layer(layer: Mapping[str, LayerValue], dims: Mapping[str, int]) -> dict[str, _Stored]:
    return {
        key: _Stored(tuple(v.shape), v.dtype, dims[key], row_hashes(v, dims[key]))
        for key, v in layer.items()
        if isinstance(v, Tensor) and v.ndim > 0 and key in dims
    }


# ---------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _one_line(text: str) -> str:
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
            f"sqlite-utils {version} is too old; kvchat needs sqlite-utils>=4 "
            "(pip install -U 'sqlite-utils>=4')"
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
    ) -> None:
        """Open (or create) the database, refusing foreign or newer files without touching them.
        max_deltas/compact_share: when a snapshot chain is compacted into a full snapshot."""
        _check_sqlite_utils()
        self.path = Path(path).expanduser()
        self.timeout_s = float(timeout_s)
        self.max_deltas = int(max_deltas)
        self.compact_share = float(compact_share)
        self._db: Database | None = None
        self._lock = threading.RLock()
        self._chains: dict[int, _Chain] = {}
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
            raise StoreError(
                f"cannot open {self.path} ({_one_line(exc)}); pass --db with a writable path"
            ) from None
        try:
            self._db = Database(conn)
            # Checks first: nothing is written to a file we are going to refuse.
            self._check_existing()
            ms = max(0, int(self.timeout_s * 1000))
            conn.execute(f"PRAGMA busy_timeout = {ms}")
            self._wait_for(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
            conn.execute("PRAGMA foreign_keys = ON")
            # Keep the WAL from staying at the size of the largest snapshot ever written.
            conn.execute("PRAGMA journal_size_limit = 67108864")
            self._migrate()
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

    def _not_kvchat(self, why: str) -> StoreError:
        return StoreError(
            f"{self.path} is not a kvchat database ({why}); move it away or pass --db NEWFILE"
        )

    def _newer(self, version: int) -> StoreError:
        return StoreError(
            f"{self.path} was written by a newer kvchat (schema {version} > "
            f"{SCHEMA_VERSION}); upgrade kvchat or use another --db"
        )

    def _check_existing(self) -> None:
        """Refuse (read-only) a file that is not ours or whose schema is newer."""
        try:
            tables = set(self.db.table_names())
        except sqlite3.DatabaseError as exc:
            raise self._not_kvchat(_one_line(exc)) from None
        if not tables:
            return  # new or empty file
        if _MIGRATIONS_TABLE not in tables:
            names = ", ".join(sorted(tables))
            raise self._not_kvchat(f"it has tables {names} and no kvchat schema")
        self._check_versions(self._applied())

    def _applied(self) -> list[str]:
        rows = self.db.execute(f"SELECT name FROM [{_MIGRATIONS_TABLE}]").fetchall()
        return [r[0] for r in rows]

    def _check_versions(self, applied: Sequence[str]) -> None:
        if len(applied) > SCHEMA_VERSION:
            raise self._newer(len(applied))
        known = {m.__name__ for m in MIGRATIONS}
        unknown = [name for name in applied if name not in known]
        if unknown:
            raise StoreError(
                f"{self.path} has schema migration {unknown[0]!r} that this kvchat does not "
                "know; upgrade kvchat or use another --db"
            )

    def _migrate(self) -> None:
        """Apply missing migrations in order, under the write lock (two processes may race)."""
        with self._write() as db:
            if _MIGRATIONS_TABLE not in db.table_names():
                db[_MIGRATIONS_TABLE].create({"name": str, "applied_at": str}, pk="name")
            applied = self._applied()
            self._check_versions(applied)
            for migration in MIGRATIONS:
                if migration.__name__ not in applied:
                    migration(db)
                    db[_MIGRATIONS_TABLE].insert(
                        {"name": migration.__name__, "applied_at": _now()}
                    )

    @property
    def db(self) -> Database:
        """The sqlite-utils Database (for tests and tools); raises once closed."""
        if self._db is None:
            raise StoreError(f"the store for {self.path} is closed; open it again")
        return self._db

    @_guarded
    def schema_version(self) -> int:
        """Number of migrations applied to this file."""
        return len(self._applied())

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
            return self._not_kvchat(msg)
        if "malformed" in low or "corrupt" in low:
            return StoreError(f"{self.path} is damaged ({msg}); move it away or pass --db NEWFILE")
        if "full" in low:
            return StoreError(
                f"cannot write {self.path} ({msg}); free some disk space or pass --db"
            )
        if "readonly" in low or "read-only" in low:
            return StoreError(
                f"cannot write {self.path} ({msg}); check its permissions or pass --db"
            )
        if "closed" in low:
            return StoreError(f"the store for {self.path} is closed; open it again")
        return StoreError(
            f"database {self.path} failed ({msg}); pass --db NEWFILE to use another file"
        )

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
        self.db["sessions"].update(int(session_id), {"updated": _now()})

    # -- sessions -----------------------------------------------------------------

    @_guarded
    def create_session(self, title: str, model_fingerprint: str, method: str, params: dict) -> int:
        """A new, empty session; returns its id."""
        now = _now()
        with self._write() as db:
            table = db["sessions"].insert(
                {
                    "title": title,
                    "model_fingerprint": model_fingerprint,
                    "method": method,
                    "params": json.dumps(params),
                    "created": now,
                    "updated": now,
                }
            )
            return int(table.last_pk)

    def _session_rows(self, where: str = "", args: Sequence[Any] = ()) -> list[SessionRow]:
        sql = f"""
            SELECT s.id, s.title, s.model_fingerprint, s.method, s.params, s.created, s.updated,
                   (SELECT count(*) FROM messages m WHERE m.session_id = s.id),
                   (SELECT sn.meta FROM snapshots sn WHERE sn.session_id = s.id
                    ORDER BY sn.id DESC LIMIT 1)
            FROM sessions s {where}
            ORDER BY s.updated DESC, s.id DESC
        """
        out = []
        for row in self.db.execute(sql, list(args)):
            sid, title, fp, method, params, created, updated, count, meta = row
            tokens = 0
            if meta is not None:
                value = json.loads(meta).get(TOKENS_META_KEY, 0)
                tokens = int(value) if isinstance(value, (int, float)) else 0
            params = json.loads(params)
            out.append(
                SessionRow(sid, title, fp, method, params, created, updated, tokens, count)
            )
        return out

    @_guarded
    def list_sessions(self) -> list[SessionRow]:
        """All sessions, most recently updated first."""
        with self._read():
            return self._session_rows()

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
            db["sessions"].update(int(session_id), changes)

    @_guarded
    def delete_session(self, session_id: int) -> None:
        """Remove a session with its messages and snapshots, in one transaction."""
        sid = int(session_id)
        with self._write() as db:
            self._require_session(sid)
            db["snapshot_tensors"].delete_where(
                "snapshot_id IN (SELECT id FROM snapshots WHERE session_id = ?)", [sid]
            )
            db["snapshots"].delete_where("session_id = ?", [sid])
            db["messages"].delete_where("session_id = ?", [sid])
            db["sessions"].delete(sid)
        self._chains.pop(sid, None)

    @_guarded
    def last_session_id(self) -> int | None:
        """The most recently updated session (what `--resume` with no id picks)."""
        row = self.db.execute(
            "SELECT id FROM sessions ORDER BY updated DESC, id DESC LIMIT 1"
        ).fetchone()
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
        self, db: Database, session_id: int, role: str, text: str, token_ids: list[int],
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
        return int(db["messages"].insert(row).last_pk)

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
    ) -> int:
        """One turn in one transaction: its messages (dicts with role, text, token_ids and
        optionally metrics), its snapshot and the session row's changes (title, method,
        params). A kill at any point leaves all of it or none. Returns the snapshot id.

        Layers are serialised one at a time inside the transaction, so peak extra
        memory is one layer's blob, not the whole cache."""
        sid = int(session_id)
        try:
            meta_json = json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"snapshot meta must be JSON-able ({exc})") from None
        changes: dict[str, Any] = {"updated": _now()}
        for name, value in (session_changes or {}).items():
            if value is not None:
                changes[name] = json.dumps(value) if name == "params" else value
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
                "session_id": sid, "turn": int(turn), "meta": meta_json, "created": _now(),
                "parent_id": None if chain is None else chain.snapshot_id,
            }
            snapshot_id = int(db["snapshots"].insert(row).last_pk)
            written, remembered = 0, []
            for index, layer in enumerate(layers):
                old = None if chain is None else chain.layers[index]
                hints = {k: v.dim for k, v in old.items()} if old else {}
                part, extra, remember = _plan_layer(layer, old, hints)
                blob = encode_layer(part, extra)
                written += len(blob)
                db["snapshot_tensors"].insert({"snapshot_id": snapshot_id, "layer": index, "blob": blob})
                remembered.append(remember)
                del blob, part
            db["sessions"].update(sid, changes)
        # Committed: only now may what it replaces be dropped and the hashes move on.
        if chain is None:
            self._chains[sid] = _Chain(snapshot_id, snapshot_id, written, 0, 0, remembered)
        else:
            self._chains[sid] = _Chain(
                snapshot_id, chain.base_id, chain.base_bytes, chain.delta_bytes + written, chain.deltas + 1,
                remembered,
            )
        # Everything before the chain's base (an old chain, or one a kill left behind).
        self._drop_older_snapshots(sid, self._chains[sid].base_id)
        return snapshot_id

    def _drop_older_snapshots(self, session_id: int, keep_id: int) -> None:
        with self._write() as db:
            db["snapshot_tensors"].delete_where(
                "snapshot_id IN (SELECT id FROM snapshots WHERE session_id = ? AND id < ?)",
                [session_id, keep_id],
            )
            db["snapshots"].delete_where("session_id = ? AND id < ?", [session_id, keep_id])

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
        row = db.execute(
            "SELECT blob FROM snapshot_tensors WHERE snapshot_id = ? AND layer = ?", [snapshot_id, index]
        ).fetchone()
        if row is None:
            raise StoreError(
                f"{self.path}: snapshot {snapshot_id} misses layer {index}; "
                "rebuild the cache from the transcript"
            )
        try:
            return decode_layer(row[0], parent), _layer_meta(row[0]).get("dims", {})
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
            count = db.execute(
                "SELECT count(*) FROM snapshot_tensors WHERE snapshot_id = ?", [snapshot_id]
            ).fetchone()[0]
            layers: list[dict[str, LayerValue]] = []
            remembered: list[dict[str, _Stored]] = []
            for index in range(count):
                layer: dict | None = None
                for link in ids:
                    layer, dims = self._read_layer(db, link, index, layer)
                assert layer is not None
                layers.append(layer)
                remembered.append(_remember_layer(layer, dims))
            sizes = db.execute(
                "SELECT snapshot_id, sum(length(blob)) FROM snapshot_tensors WHERE snapshot_id IN "
                f"({','.join('?' * len(ids))}) GROUP BY snapshot_id", ids
            ).fetchall()
        by_id = dict(sizes)
        base = int(by_id.get(ids[0], 0))
        self._chains[int(sid)] = _Chain(
            snapshot_id, ids[0], base, sum(int(by_id.get(i, 0)) for i in ids[1:]), len(ids) - 1, remembered
        )
        return Snapshot(snapshot_id, sid, turn, json.loads(meta), layers, created)

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
        if fmt not in ("md", "json"):
            raise StoreError(f"unknown export format {fmt!r}; use md or json")
        with self._read():
            session = self.get_session(session_id)
            messages = self.messages(session_id)
        if fmt == "json":
            doc = {
                "session": asdict(session),
                "messages": [asdict(m) for m in messages],
            }
            return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
        lines = [
            f"# {session.title}",
            "",
            f"- session: {session.id}",
            f"- model: {session.model_fingerprint}",
            f"- method: {session.method} {json.dumps(session.params)}",
            f"- created: {session.created}",
            f"- updated: {session.updated}",
            "",
        ]
        for m in messages:
            lines += [f"## {m.role}", "", m.text, ""]
        return "\n".join(lines)
