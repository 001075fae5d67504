"""Pick the compression method: every registered method with its one-line description."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

# Descriptions are wrapped by hand so that continuation lines keep their indent.
DESCRIPTION_WIDTH = 64


class MethodPicker(ModalScreen[str | None]):
    """Dismisses with the chosen method name, or None on Escape."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, methods: Sequence[tuple[str, str]], current: str) -> None:
        """`methods`: (name, description) in picker order."""
        super().__init__(classes="dialog-screen")
        self.methods = list(methods)
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog picker"):
            yield Static(
                "Compression method — Enter switches at once, Esc cancels", classes="dialog-title", markup=False
            )
            options = [self._option(name, description) for name, description in self.methods]
            yield OptionList(*options, id="method-list")

    def _option(self, name: str, description: str) -> Option:
        # Name on its own line, description under it: long descriptions wrap cleanly.
        marker = "● " if name == self.current else "  "
        suffix = "  (current)" if name == self.current else ""
        wrapped = "\n".join("    " + line for line in textwrap.wrap(description, DESCRIPTION_WIDTH))
        label = Text.assemble((marker + name, "bold"), (suffix, "italic"), "\n", (wrapped, "dim"))
        return Option(label, id=name)

    def on_mount(self) -> None:
        option_list = self.query_one(OptionList)
        names = [name for name, _ in self.methods]
        if self.current in names:
            option_list.highlighted = names.index(self.current)
        option_list.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
