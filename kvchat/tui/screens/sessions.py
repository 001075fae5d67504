"""The saved sessions: list, resume, new, rename, delete (with confirmation).

The screen does not touch the store: it shows the rows it is given and reports what
the user asked for; the app does the work and calls `show_rows` again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Literal

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Static

from .dialogs import ConfirmDialog, TextPrompt

if TYPE_CHECKING:
    from ...storage.db import SessionRow  # annotations only: importing the store pulls in torch


@dataclass
class SessionChoice:
    action: Literal["resume", "new"]
    session_id: int | None = None


def last_used(iso: str, now: datetime | None = None) -> str:
    """'3 min ago' style for recent times, the date for older ones."""
    try:
        when = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    seconds = ((now or datetime.now(timezone.utc)) - when).total_seconds()
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return when.astimezone().strftime("%Y-%m-%d %H:%M")


class SessionsScreen(ModalScreen[SessionChoice | None]):
    BINDINGS = [
        Binding("enter", "resume", "Resume", priority=True),
        Binding("n", "new", "New"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("escape", "close", "Close"),
    ]

    @dataclass
    class RenameRequested(Message):
        session_id: int
        title: str

    @dataclass
    class DeleteRequested(Message):
        session_id: int

    def __init__(self, rows: Sequence[SessionRow], current_id: int | None) -> None:
        super().__init__(classes="dialog-screen")
        self.rows = list(rows)
        self.current_id = current_id

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog sessions"):
            yield Static("Sessions", classes="dialog-title", markup=False)
            yield DataTable(id="sessions-table", cursor_type="row", zebra_stripes=True)
            yield Static(
                "No saved sessions yet: a session is saved after its first answer.", id="sessions-empty", markup=False
            )
            yield Footer(compact=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("", "Title", "Method", "Tokens", "Messages", "Last used")
        self.show_rows(self.rows, self.current_id)
        table.focus()

    def show_rows(self, rows: Sequence[SessionRow], current_id: int | None) -> None:
        self.rows, self.current_id = list(rows), current_id
        table = self.query_one(DataTable)
        keep = table.cursor_row
        table.clear()
        for row in self.rows:
            table.add_row(
                "●" if row.id == current_id else "",
                row.title,
                row.method,
                f"{row.tokens:,}",
                str(row.message_count),
                last_used(row.updated),
                key=str(row.id),
            )
        if self.rows:
            table.move_cursor(row=min(keep, len(self.rows) - 1))
        self.query_one("#sessions-empty").display = not self.rows

    def selected(self) -> SessionRow | None:
        table = self.query_one(DataTable)
        if not self.rows or table.cursor_row < 0 or table.cursor_row >= len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def action_resume(self) -> None:
        row = self.selected()
        if row is not None:
            self.dismiss(SessionChoice("resume", row.id))

    def action_new(self) -> None:
        self.dismiss(SessionChoice("new"))

    def action_rename(self) -> None:
        row = self.selected()
        if row is None:
            return

        def renamed(title: str | None) -> None:
            if title and title != row.title:
                self.post_message(self.RenameRequested(row.id, title))

        self.app.push_screen(TextPrompt(f"New title for session {row.id}:", row.title), renamed)

    def action_delete(self) -> None:
        row = self.selected()
        if row is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.post_message(self.DeleteRequested(row.id))

        question = (
            f"Delete session {row.id} “{row.title}” ({row.message_count} messages, {row.tokens:,} tokens)? "
            "This cannot be undone."
        )
        self.app.push_screen(ConfirmDialog(question, "Delete", "Keep"), confirmed)

    def action_close(self) -> None:
        self.dismiss(None)
