"""A saved session's transcript as text: Markdown or JSON (session + messages, no tensors).

Pure formatting of the rows the database returns (`Store.export_session` reads them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from kvchat.errors import StoreError

if TYPE_CHECKING:
    from kvchat.storage.rows import MessageRow, SessionRow

FORMATS = ("md", "json")


def check_format(fmt: str) -> None:
    """Refuse an unknown format before anything is read."""
    if fmt not in FORMATS:
        raise StoreError(f"unknown export format {fmt!r}; use md or json")


def render(session: SessionRow, messages: Sequence[MessageRow], fmt: str) -> str:
    """The transcript as Markdown ("md") or JSON ("json")."""
    check_format(fmt)
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
        *([f"- {session.origin()}"] if session.origin() else []),
        "",
    ]
    turn = 0
    for m in messages:
        # Turns are numbered as `kvchat sessions branch ID --at N` counts them.
        turn += m.role == "user"
        heading = f"## user (turn {turn})" if m.role == "user" else f"## {m.role}"
        lines += [heading, "", m.text, ""]
    return "\n".join(lines)
