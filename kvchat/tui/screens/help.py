"""Help: the key bindings, generated from the bindings themselves so it never drifts."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HelpSection = tuple[str, Sequence[Binding]]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self, sections: Sequence[HelpSection], notes: Sequence[str] = ()) -> None:
        super().__init__(classes="dialog-screen")
        self.sections = list(sections)
        self.notes = list(notes)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Static("kvchat keys — Esc closes", classes="dialog-title", markup=False)
            with VerticalScroll():
                yield Static(self.render_help(), id="help-text")

    def key_names(self, binding: Binding) -> str:
        keys = [key.strip() for key in binding.key.split(",")]
        return " / ".join(self.app.get_key_display(Binding(key, binding.action)) for key in keys)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(section, keys, what it does, details) for every binding shown."""
        return [
            (title, self.key_names(binding), binding.description or binding.action, binding.tooltip)
            for title, bindings in self.sections
            for binding in bindings
        ]

    def plain_text(self) -> str:
        lines = [f"{title}: {keys} — {what}. {details}" for title, keys, what, details in self.rows()]
        return "\n".join(lines + self.notes)

    def render_help(self) -> Group:
        parts: list[Table | Text] = []
        for title, _ in self.sections:
            table = Table(
                title=title,
                title_justify="left",
                title_style="bold underline",
                box=None,
                show_header=False,
                padding=(0, 2, 0, 0),
                expand=True,
            )
            table.add_column(style="bold", no_wrap=True)
            table.add_column(no_wrap=True)
            table.add_column(style="dim", ratio=1)
            for section, keys, what, details in self.rows():
                if section == title:
                    table.add_row(keys, what, details)
            parts += [table, Text("")]
        parts += [Text(note, style="dim") for note in self.notes]
        return Group(*parts)

    def action_close(self) -> None:
        self.dismiss(None)
