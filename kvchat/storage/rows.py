"""The rows the store gives back, as plain data: sessions, messages, snapshots.

Apart from `kvchat.storage.db` so that front ends can name them without importing the
store's tensor codec (and torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .codec import LayerValue


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


@dataclass
class SessionMatch(SessionRow):
    """A session found by `Store.search`: a line around its best match, the matched
    words' (start, end) offsets in that line, how many of its messages match."""

    snippet: str = ""
    marks: tuple[tuple[int, int], ...] = ()
    matches: int = 0


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


