"""The saved sessions: list, search, resume, new, rename, delete (with confirmation); a
branch shows, after its title, the session and turn it was branched from, and each
session what it takes on disk (and whether the disk budget dropped its recall tier).

The screen does not touch the store: it shows the rows it is given and reports what
the user asked for; the app does the work and calls `show_rows` again. The search box
(/) hands what is typed, after a short pause, to the `search` callback the app gives
it; the app searches in a worker and answers with `show_matches`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Input, Static

from kvchat.settings import human_size
from kvchat.tui.screens.dialogs import ConfirmDialog, TextPrompt

if TYPE_CHECKING:
    from kvchat.storage.rows import SessionRow  # annotations only: the app reaches the store through the controller


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
        when = when.replace(tzinfo=UTC)
    seconds = ((now or datetime.now(UTC)) - when).total_seconds()
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return when.astimezone().strftime("%Y-%m-%d %H:%M")


# Typing pauses this long before a search starts, so one runs per word rather than per key.
SEARCH_DELAY_S = 0.25
EMPTY_LIST = "No saved sessions yet: a session is saved after its first answer."
LIST_COLUMNS = ("", "Title", "Method", "Tokens", "Messages", "Disk", "Last used")
# A match is two lines in one column: the title, then the text around the match.
MATCH_COLUMNS = ("", "Session · match", "Last used")
MATCH_OTHER_CELLS = 25  # what the other columns, the cells' padding and a scrollbar take


def found_cell(title: str, snippet: str, marks: Sequence[tuple[int, int]]) -> Text:
    """The title in bold above the snippet, its matched words underlined; long lines end
    in "…" (and nothing in them is read as markup)."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" ".join(title.split()), style="bold")
    text.append("\n")
    start = len(text)
    text.append(snippet)
    for a, b in marks:
        text.stylize("bold underline", start + a, start + b)
    return text


def title_cell(row: SessionRow) -> str | Text:
    """The title, and for a branch where it came from ("↳ branch of #3 at turn 2"), dim."""
    origin = row.origin()
    if not origin:
        return row.title
    return Text.assemble(row.title, (f"  ↳ {origin}", "dim italic"), no_wrap=True, overflow="ellipsis")


def disk_cell(row: SessionRow) -> str | Text:
    """Its bytes on disk, and, dim, "tier dropped" when the disk budget dropped its recall tier."""
    size = human_size(row.disk_bytes)
    return Text.assemble(size, (" tier dropped", "dim italic")) if row.tier_dropped else size


class SearchBox(Input):
    """The search box; Up/Down/PageUp/PageDown move the list's cursor while typing."""

    DEFAULT_CSS = "SearchBox { margin-bottom: 1; }"

    BINDINGS = [
        Binding("down", "move_cursor('cursor_down')", show=False),
        Binding("up", "move_cursor('cursor_up')", show=False),
        Binding("pagedown", "move_cursor('page_down')", show=False),
        Binding("pageup", "move_cursor('page_up')", show=False),
    ]

    def action_move_cursor(self, action: str) -> None:
        getattr(self.screen.query_one(DataTable), f"action_{action}")()


class SessionsScreen(ModalScreen[SessionChoice | None]):
    BINDINGS = [
        Binding("enter", "resume", "Resume", priority=True),
        Binding("n", "new", "New"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding(
            "slash",
            "search",
            "Search",
            tooltip="filter the list to the sessions whose messages hold the words typed; Esc clears",
        ),
        Binding("escape", "close", "Close", tooltip="clears the search first, if there is one"),
    ]

    @dataclass
    class RenameRequested(Message):
        session_id: int
        title: str

    @dataclass
    class DeleteRequested(Message):
        session_id: int

    def __init__(
        self, rows: Sequence[SessionRow], current_id: int | None, search: Callable[[str], None] | None = None
    ) -> None:
        """`rows`: every saved session; `search(text)`: start a search whose answer comes
        back through `show_matches` (None: no search box)."""
        super().__init__(classes="dialog-screen")
        self.all_rows = list(rows)  # the whole list
        self.rows = list(rows)  # what the table shows: the whole list or the matches
        self.current_id = current_id
        self.search = search
        self.search_text = ""  # the search shown or asked for ("" = the whole list)
        self._columns: tuple[str, ...] = ()
        self._view: str | None = None  # the search whose matches are shown ("" = the whole list)
        self._search_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog sessions"):
            yield Static("Sessions", classes="dialog-title", markup=False)
            if self.search is not None:
                yield SearchBox(
                    placeholder="/ search the messages", id="sessions-search", select_on_focus=False, compact=True
                )
            yield DataTable(id="sessions-table", cursor_type="row", zebra_stripes=True)
            yield Static(EMPTY_LIST, id="sessions-empty", markup=False)
            yield Footer(compact=True)

    def on_mount(self) -> None:
        self.show_rows(self.all_rows, self.current_id)
        self.query_one(DataTable).focus()

    def show_rows(self, rows: Sequence[SessionRow], current_id: int | None) -> None:
        """The whole list changed (read again after a rename or delete): show it, or,
        while a search is on, search again so the matches follow."""
        self.all_rows, self.current_id = list(rows), current_id
        if self.search_text and self.search is not None:
            self.search(self.search_text)
        else:
            self._fill(self.all_rows, matches=False)

    def show_matches(self, text: str, rows: Sequence[SessionRow], current_id: int | None = None) -> None:
        """The answer to `search(text)`; dropped when the box has moved on since."""
        if text != self.search_text or not text:
            return
        if current_id is not None:
            self.current_id = current_id
        self._fill(list(rows), matches=True)

    def _fill(self, rows: list[SessionRow], *, matches: bool) -> None:
        table = self.query_one(DataTable)
        columns = MATCH_COLUMNS if matches else LIST_COLUMNS
        # The same view read again (after a rename or delete) keeps the cursor on its
        # session, or its row; another search starts at the top.
        view = self.search_text if matches else ""
        chosen = self.selected()
        keep = table.cursor_row if view == self._view else 0
        if view == self._view and chosen is not None:
            keep = next((i for i, row in enumerate(rows) if row.id == chosen.id), keep)
        self._view = view
        if matches:  # the match column takes the width the others leave
            width = max(24, (table.size.width or 84) - MATCH_OTHER_CELLS)
            table.clear(columns=True)
            mark, session, used = MATCH_COLUMNS
            table.add_column(mark)
            table.add_column(session, width=width)
            table.add_column(used)
        elif columns != self._columns:
            table.clear(columns=True)
            table.add_columns(*columns)
        else:
            table.clear()
        self._columns = columns
        self.rows = rows
        for row in rows:
            mark = "●" if row.id == self.current_id else ""
            if matches:
                cell = found_cell(row.title, getattr(row, "snippet", ""), getattr(row, "marks", ()))
                table.add_row(mark, cell, last_used(row.updated), key=str(row.id), height=2)
            else:
                table.add_row(
                    mark,
                    title_cell(row),
                    row.method,
                    f"{row.tokens:,}",
                    str(row.message_count),
                    disk_cell(row),
                    last_used(row.updated),
                    key=str(row.id),
                )
        if rows:
            table.move_cursor(row=min(keep, len(rows) - 1))
        empty = self.query_one("#sessions-empty", Static)
        empty.update(
            f"No saved session has a message matching “{self.search_text}”. Esc clears the search."
            if matches
            else EMPTY_LIST
        )
        empty.display = not rows

    # -- search ------------------------------------------------------------------------
    def action_search(self) -> None:
        if self.search is not None:
            self.query_one(SearchBox).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        text = " ".join(event.value.split())
        if text == self.search_text:
            return
        self.search_text = text
        if self._search_timer is not None:
            self._search_timer.stop()
            self._search_timer = None
        if not text:
            self._fill(self.all_rows, matches=False)
        else:
            self._search_timer = self.set_timer(SEARCH_DELAY_S, self._start_search)

    def _start_search(self) -> None:
        self._search_timer = None
        if self.search_text and self.search is not None:
            self.search(self.search_text)

    def clear_search(self) -> None:
        """Back to the whole list, the cursor in it."""
        self.search_text = ""  # first: the box's Changed message then finds nothing to do
        self.query_one(SearchBox).value = ""
        if self._search_timer is not None:
            self._search_timer.stop()
            self._search_timer = None
        self._fill(self.all_rows, matches=False)
        self.query_one(DataTable).focus()

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
            f"Delete session {row.id} “{row.title}” ({row.message_count} messages, {row.tokens:,} tokens, "
            f"{human_size(row.disk_bytes)} on disk)? This cannot be undone."
        )
        self.app.push_screen(ConfirmDialog(question, "Delete", "Keep"), confirmed)

    def action_close(self) -> None:
        if self.search is not None and (self.search_text or self.query_one(SearchBox).value):
            self.clear_search()
        else:
            self.dismiss(None)
