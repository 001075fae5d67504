"""The recall tier of a saved session: its cold rows in SQLite, beside its snapshot.

A recall tier (kvchat/recall/tier.py) keeps the key and value of every token that left
the window, one quantised row per token and layer (uint8 `[H, unit]`,
kvchat/recall/row_codec.py), in memory-mapped temporary files.
A saved session keeps those rows in the table `cold_rows`: per session and layer, runs
of consecutive rows `[start, start + rows)` as safetensors blobs of at most `CHUNK_ROWS`
rows. The tier's other state (the token of row 0, its row count, its positions after a
compaction) is in the layer's snapshot blob, so the two are saved together.

Why SQLite and not a file beside the database
(docs/decisions/0009-cold-rows-in-sqlite.md): the rows are written in the same
transaction as the turn's snapshot, so a kill at any moment leaves the rows of the
snapshot that survives (no count to reconcile with a file); a branch copies them with one
INSERT ... SELECT; a delete is one DELETE; a second process sees them with the snapshot.
A turn writes only the rows that went cold since the last save, so a save costs what that
turn added.

Which rows are already saved is known without reading a row: a tier's rows live in files
that are only appended to, so (file identity, row range) names their content
(`kvchat.recall.cold_store.Segment`). Per session, the store remembers in memory the names of the
rows it wrote or read back (`ColdRows`), and the next save writes only the rows past
them when the tier still holds those same rows; otherwise (a rebuild, a compaction that
re-rotated every key, another process that wrote since) it writes them all again, in the
same transaction.

Plain data only: tensors, strings and numbers; the store never sees a tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlite_utils import Database

from kvchat.errors import StoreError

if TYPE_CHECKING:  # torch comes with the first snapshot, not with the store (as in db.py)
    from torch import Tensor

# Rows per blob at most: bounds the bytes one blob copies in and out.
CHUNK_ROWS = 2048
_KEY = "rows"

# (file identity, the layer's row of its first row, rows [n, ...]): kvchat.recall.cold_store.Segment.
Segment = tuple[str, int, "Tensor"]
# What names a layer's saved rows: (file identity, first row, end row) runs, in order.
Names = list[tuple[str, int, int]]


def names(segments: Sequence[Segment], upto: int | None = None) -> Names:
    """The names of `segments`' rows, the first `upto` only (None: all)."""
    out: Names = []
    for ident, start, rows in segments:
        stop = start + rows.shape[0]
        if upto is not None:
            stop = min(stop, upto)
        if stop > start:
            out.append((ident, start, stop))
    return out


def _rows(saved: Names) -> int:
    return saved[-1][2] if saved else 0


@dataclass
class _Saved:
    """The rows of a session's newest snapshot, as one Store wrote or read them."""

    snapshot_id: int
    layers: list[Names]


class ColdRows:
    """What one Store knows of each session's saved cold rows (like its snapshot chains)."""

    def __init__(self) -> None:
        self._saved: dict[int, _Saved] = {}

    def write(
        self, db: Database, session_id: int, newest: int | None, cold: Sequence[Sequence[Segment]] | None
    ) -> tuple[int, list[Names] | None]:
        """Inside the transaction of a snapshot that follows `newest` (the session's newest
        before it): make the saved rows those of `cold` (per layer, its segments; None:
        no tier, nothing kept). Returns (bytes written, what to `commit` once committed)."""
        sid = int(session_id)
        if cold is None:
            delete(db, sid)
            return 0, None
        known = self._saved.get(sid)
        if known is not None and known.snapshot_id != newest:
            known = None  # another Store wrote since: nothing is known
        stored = dict(
            db.execute(
                "SELECT layer, max(start + rows) FROM cold_rows WHERE session_id = ? GROUP BY layer", [sid]
            ).fetchall()
        )
        written = 0
        for layer, segments in enumerate(cold):
            have = 0
            if known is not None and layer < len(known.layers):
                saved = known.layers[layer]
                if saved and names(segments, _rows(saved)) == saved and stored.get(layer, 0) == _rows(saved):
                    have = _rows(saved)
            if not have and layer in stored:
                db.execute("DELETE FROM cold_rows WHERE session_id = ? AND layer = ?", [sid, layer])
            written += _insert(db, sid, layer, segments, have)
        db.execute("DELETE FROM cold_rows WHERE session_id = ? AND layer >= ?", [sid, len(cold)])
        return written, [names(segments) for segments in cold]

    def commit(self, session_id: int, snapshot_id: int, saved: list[Names] | None) -> None:
        """The snapshot `snapshot_id` and the rows `saved` (from `write`) are committed."""
        if saved is None:
            self._saved.pop(int(session_id), None)
        else:
            self._saved[int(session_id)] = _Saved(int(snapshot_id), saved)

    def load(
        self,
        db: Database,
        session_id: int,
        snapshot_id: int,
        sink: Callable[[int, Tensor], None],
        held: Callable[[], Sequence[Sequence[Segment]] | None],
    ) -> None:
        """Inside a read transaction: hand every saved row of the session to `sink(layer,
        rows [n, ...])`, in order per layer (the tier checks their shape), then remember what `held()` names as
        those rows (the tier that took them). StoreError when the session moved on past
        `snapshot_id` meanwhile, or its rows are damaged or missing."""
        import safetensors.torch

        sid = int(session_id)
        newest = db.execute("SELECT max(id) FROM snapshots WHERE session_id = ?", [sid]).fetchone()[0]
        if newest != snapshot_id:
            raise StoreError(f"session {sid} was saved again while it was being resumed; resume it again")
        expected: dict[int, int] = {}
        cursor = db.execute(
            "SELECT layer, start, rows, blob FROM cold_rows WHERE session_id = ? ORDER BY layer, start", [sid]
        )
        for layer, start, count, blob in cursor:
            if start != expected.get(layer, 0):
                raise StoreError(
                    f"the saved recall tier of session {sid} misses rows {expected.get(layer, 0)}"
                    f"-{start} of layer {layer}"
                )
            try:
                rows = safetensors.torch.load(blob)[_KEY]  # KeyError too: no rows in it
            except Exception as exc:  # safetensors/json errors on a damaged blob
                raise StoreError(
                    f"the saved recall tier of session {sid} is unreadable at layer {layer}, "
                    f"row {start} ({' '.join(str(exc).split())})"
                ) from None
            if rows.ndim < 2 or rows.shape[0] != count:
                raise StoreError(f"the saved recall tier of session {sid} is damaged at layer {layer}, row {start}")
            sink(int(layer), rows)
            expected[layer] = start + count
        now = held()
        if now is not None:
            self._saved[sid] = _Saved(int(snapshot_id), [names(segments) for segments in now])

    def forget(self, session_id: int) -> None:
        self._saved.pop(int(session_id), None)


def _insert(db: Database, session_id: int, layer: int, segments: Sequence[Segment], start: int) -> int:
    """Write the rows of `segments` from row `start` on, in blobs of at most CHUNK_ROWS."""
    import safetensors.torch

    written = 0
    for _ident, first, rows in segments:
        stop = first + rows.shape[0]
        at = max(start, first)
        while at < stop:
            end = min(stop, at + CHUNK_ROWS)
            part = rows[at - first : end - first]
            blob = safetensors.torch.save({_KEY: part.contiguous()})
            db.execute(
                "INSERT INTO cold_rows (session_id, layer, start, rows, blob) VALUES (?, ?, ?, ?, ?)",
                [session_id, layer, at, end - at, blob],
            )
            written += len(blob)
            at = end
    return written


def delete(db: Database, session_id: int) -> None:
    """Remove a session's saved rows (inside the caller's transaction)."""
    db.execute("DELETE FROM cold_rows WHERE session_id = ?", [int(session_id)])


def copy(db: Database, source_id: int, new_id: int) -> None:
    """Give a branch the saved rows of the session whose snapshot it copied."""
    db.execute(
        "INSERT INTO cold_rows (session_id, layer, start, rows, blob) "
        "SELECT ?, layer, start, rows, blob FROM cold_rows WHERE session_id = ?",
        [int(new_id), int(source_id)],
    )


def saved_bytes(db: Database, session_id: int) -> int:
    """Bytes of a session's saved cold rows."""
    row = db.execute(
        "SELECT coalesce(sum(length(blob)), 0) FROM cold_rows WHERE session_id = ?", [int(session_id)]
    ).fetchone()
    return int(row[0])
