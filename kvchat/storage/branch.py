"""Branches: a new session that shares a saved one's history up to a turn.

A turn is one user message and what follows it up to the next user message (its answer;
none when it was stopped before the answer began). Turns are numbered from 1, in the
order of the transcript; a branch "at N" holds the original's first N turns (N = 0: none,
only the session's settings and system prompt). The original is never changed.

Only the newest snapshot of a session is kept, so a saved cache "of turn N" exists only
when N is the original's last turn and its newest snapshot was taken after that turn;
the branch then gets a copy of it (its chain of blobs and its recall tier's rows, copied
inside SQLite: no tensor is decoded). Otherwise the branch has a transcript and no snapshot, and the caller
rebuilds its cache from that transcript (`kvchat.chat.persist.rebuild`).

Plain SQL on the open write transaction of `Store.branch_session`; no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlite_utils import Database

from kvchat.errors import StoreError
from kvchat.storage import cold
from kvchat.storage.migrations import table_of
from kvchat.storage.rows import Branch


def turns_of(roles: list[str]) -> int:
    """How many turns a transcript with these roles (in order) has."""
    return sum(1 for role in roles if role == "user")


def kept_messages(roles: list[str], at: int) -> int:
    """How many messages, from the first, make up the first `at` turns."""
    seen = 0
    for index, role in enumerate(roles):
        if role == "user":
            if seen == at:
                return index
            seen += 1
    return len(roles)


def check_turn(session_id: int, turns: int, at: int) -> None:
    """Refuse a turn the session does not have, naming the ones it does."""
    if not 0 <= at <= turns:
        has = "no turns yet" if turns == 0 else f"turns 1 to {turns}"
        raise StoreError(
            f"session {session_id} has {has}, so it has no turn {at} to branch at; give a turn from "
            f"0 (before the first message) to {turns}"
        )


def make_branch(
    db: Database, session_id: int, at: int, now: Callable[[], str], chain: Callable[[int], list[int]]
) -> Branch:
    """Inside a write transaction: the branch's session row (the original's title, model,
    method and saved settings, with its origin), its first `at` turns of messages, and
    the snapshot when the original's newest one is of exactly that turn. `chain(id)`
    gives a snapshot's chain ids, oldest (the full one) first."""
    sid = int(session_id)
    source = db.execute("SELECT title, model_fingerprint, method, params FROM sessions WHERE id = ?", [sid]).fetchone()
    if source is None:
        raise StoreError(f"no session {sid}; `kvchat sessions list` shows the saved ones")
    rows = db.execute("SELECT id, role FROM messages WHERE session_id = ? ORDER BY id", [sid]).fetchall()
    roles = [role for _, role in rows]
    turns = turns_of(roles)
    check_turn(sid, turns, int(at))
    title, fingerprint, method, params = source
    stamp = now()
    new_id = int(
        table_of(db, "sessions")  # type: ignore[arg-type]  # last_pk: set by the insert
        .insert(
            {
                "title": title,
                "model_fingerprint": fingerprint,
                "method": method,
                "params": params,
                "created": stamp,
                "updated": stamp,
                "origin_session_id": sid,
                "origin_turn": int(at),
            }
        )
        .last_pk
    )
    kept = kept_messages(roles, int(at))
    if kept:
        # The copies keep their text, token ids, metrics and times; ids follow the
        # original's order (the FTS triggers index them like any insert).
        db.execute(
            "INSERT INTO messages (session_id, role, text, token_ids, metrics, created) "
            "SELECT ?, role, text, token_ids, metrics, created FROM messages "
            "WHERE session_id = ? AND id <= ? ORDER BY id",
            [new_id, sid, rows[kept - 1][0]],
        )
    copied = at == turns and _copy_snapshot(db, sid, new_id, int(at), chain)
    return Branch(new_id, sid, int(at), copied)


def _copy_snapshot(db: Database, source_id: int, new_id: int, at: int, chain: Callable[[int], list[int]]) -> bool:
    """Copy the source's newest snapshot chain to the branch when it is of turn `at`;
    False when there is none to copy (then the branch is rebuilt from its transcript)."""
    newest = db.execute(
        "SELECT id, turn FROM snapshots WHERE session_id = ? ORDER BY id DESC LIMIT 1", [source_id]
    ).fetchone()
    if newest is None or int(newest[1]) != at:
        return False
    try:
        ids = chain(int(newest[0]))
    except StoreError:  # a chain missing its base: the transcript is the way
        return False
    copies: dict[int, int] = {}
    for old in ids:
        turn, meta, created, parent = db.execute(
            "SELECT turn, meta, created, parent_id FROM snapshots WHERE id = ?", [old]
        ).fetchone()
        copies[old] = int(
            table_of(db, "snapshots")  # type: ignore[arg-type]  # last_pk: set by the insert
            .insert(
                {
                    "session_id": new_id,
                    "turn": turn,
                    "meta": meta,
                    "created": created,
                    "parent_id": None if parent is None else copies[parent],
                }
            )
            .last_pk
        )
        db.execute(
            "INSERT INTO snapshot_tensors (snapshot_id, layer, blob) "
            "SELECT ?, layer, blob FROM snapshot_tensors WHERE snapshot_id = ?",
            [copies[old], old],
        )
    cold.copy(db, source_id, new_id)  # the recall tier's rows go with the snapshot they belong to
    # A tier the disk budget dropped is missing from the copy too.
    db.execute(
        "UPDATE sessions SET tier_dropped = (SELECT tier_dropped FROM sessions WHERE id = ?) WHERE id = ?",
        [source_id, new_id],
    )
    return True
