"""The rows the store gives back, as plain data: sessions, messages, snapshots.

Apart from `kvchat.storage.db` so that front ends can name them without importing the
store's tensor codec (and torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvchat.storage.codec import LayerValue


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
    tokens: int = 0  # meta["tokens_seen"] of the newest snapshot, 0 without one
    message_count: int = 0
    # A branch: the session it was branched from (None once that one is deleted) and
    # how many of its turns it shares; both None for a session that is no branch.
    origin_id: int | None = None
    origin_turn: int | None = None
    # What its rows take in the database (kvchat/storage/disk.py), its recall tier's
    # cold rows among them, and when the disk budget dropped that tier (None: never).
    disk_bytes: int = 0
    cold_bytes: int = 0
    tier_dropped: str | None = None

    def origin(self) -> str:
        """Where a branch came from, as the session lists show it ("" for no branch)."""
        if self.origin_turn is None:
            return ""
        source = f"#{self.origin_id}" if self.origin_id is not None else "a deleted session"
        return f"branch of {source} at turn {self.origin_turn}"


@dataclass
class SessionMatch(SessionRow):
    """A session found by `Store.search`: a line around its best match, the matched
    words' (start, end) offsets in that line, how many of its messages match."""

    snippet: str = ""
    marks: tuple[tuple[int, int], ...] = ()
    matches: int = 0


@dataclass(frozen=True)
class TierDrop:
    """What the disk budget did after a save: the sessions whose recall tiers it
    dropped (least recently used first), the bytes those held, and what the sessions
    take now (still over the budget when transcripts and caches alone pass it)."""

    budget: int
    sessions: tuple[int, ...]
    freed: int
    total: int


@dataclass(frozen=True)
class Branch:
    """What `Store.branch_session` made: the new session, where it came from, and
    whether the original's snapshot was copied with it (it was of that very turn) or
    the cache still has to be rebuilt from the copied transcript."""

    session_id: int
    origin_id: int
    at: int  # turns shared with the original (user messages, with their answers)
    snapshot: bool


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
