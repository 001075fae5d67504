"""Compare methods: pick the methods (a modal list), then watch the last question
answered under each, side by side (stacked on a narrow terminal), and pick one to
continue the conversation with.

The screens do not touch the model: the app runs the comparison in a worker and calls
`method_started`, `append`, `method_finished` and `finished` here; the compare screen
reports Esc while it runs as `StopRequested` and dismisses with the method chosen to
continue with (None: keep the conversation as it was)."""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, SelectionList, Static
from textual.widgets.selection_list import Selection

from kvchat.tui.widgets.compare import AnswerFigures, CompareColumn

# Below this width the columns are stacked.
NARROW_WIDTH = 100


class CompareMethodsPicker(ModalScreen[list[str] | None]):
    """Dismisses with the methods to compare (in the list's order), or None on Escape."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("c", "compare", "Compare"),
    ]

    def __init__(self, methods: Sequence[tuple[str, str]], preselected: Sequence[str], current: str) -> None:
        """`methods`: (name, description) in picker order."""
        super().__init__(classes="dialog-screen")
        self.methods = list(methods)
        self.preselected = set(preselected)
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog compare-picker"):
            yield Static(
                "Ask the last question again under these methods — Space toggles, C compares, Esc cancels",
                classes="dialog-title",
                markup=False,
            )
            yield SelectionList[str](
                *(
                    Selection(self._label(name, description), name, name in self.preselected, id=name)
                    for name, description in self.methods
                ),
                id="compare-methods",
            )
            yield Static("", id="compare-picker-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Compare", id="compare", variant="primary")
                yield Button("Cancel", id="cancel")

    def _label(self, name: str, description: str) -> str:
        suffix = " (current)" if name == self.current else ""
        short = description if len(description) <= 60 else description[:59] + "…"
        return f"{name}{suffix} — {short}"

    def on_mount(self) -> None:
        self.query_one(SelectionList).focus()

    @property
    def selected(self) -> list[str]:
        chosen = set(self.query_one(SelectionList).selected)
        return [name for name, _ in self.methods if name in chosen]

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "compare":
            self.action_compare()
        else:
            self.action_cancel()

    def action_compare(self) -> None:
        if not self.selected:
            self.query_one("#compare-picker-error", Static).update("Pick at least one method (Space toggles).")
            return
        self.dismiss(self.selected)

    def action_cancel(self) -> None:
        self.dismiss(None)


class CompareScreen(Screen[str | None]):
    BINDINGS = [
        Binding(
            "escape",
            "stop_or_close",
            "Stop / close",
            tooltip="stop the comparison; once done, close it and keep the conversation as it was",
        ),
        Binding(
            "enter",
            "choose",
            "Continue with it",
            tooltip="continue the conversation with the focused "
            "answer's method (a new session; the old one stays saved). A click does the same",
        ),
        Binding("left,up", "previous_column", "Previous", show=False, tooltip="the previous answer"),
        Binding("right,down", "next_column", "Next", show=False, tooltip="the next answer"),
    ]

    class StopRequested(Message):
        """Esc while the comparison runs."""

    def __init__(self, question: str, methods: Sequence[str], current: str) -> None:
        super().__init__()
        self.question = question
        self.methods = list(methods)
        self.current = current
        self.running = True

    def compose(self) -> ComposeResult:
        short = " ".join(self.question.split())
        short = short if len(short) <= 90 else short[:89] + "…"
        yield Static(f"Compare · “{short}”", id="compare-heading", markup=False)
        yield Static("reading the prompt…", id="compare-status", markup=False)
        with Horizontal(id="compare-columns"):
            for method in self.methods:
                yield CompareColumn(method, current=method == self.current)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._fit(self.size.width)

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size.width)

    def _fit(self, width: int) -> None:
        self.set_class(width < NARROW_WIDTH, "narrow")

    @property
    def narrow(self) -> bool:
        return self.has_class("narrow")

    def column(self, method: str) -> CompareColumn:
        return self.query_one(f"#column-{method}", CompareColumn)

    @property
    def columns(self) -> list[CompareColumn]:
        return list(self.query(CompareColumn))

    def show_status(self, text: str) -> None:
        self.query_one("#compare-status", Static).update(text)

    @property
    def status_text(self) -> str:
        return str(self.query_one("#compare-status", Static).render())

    # -- what the app reports -------------------------------------------------------
    def method_started(self, method: str) -> None:
        self.column(method).start()
        self.show_status(f"answering under {method} ({self.methods.index(method) + 1}/{len(self.methods)})…")

    async def append(self, method: str, piece: str) -> None:
        await self.column(method).append(piece)

    async def method_finished(self, method: str, figures: AnswerFigures) -> None:
        await self.column(method).finish(figures)

    async def finished(self, summary: str, stopped: bool) -> None:
        self.running = False
        for column in self.columns:
            await column.stop_waiting()
        self.show_status(("stopped · " if stopped else "") + summary)
        choices = [c for c in self.columns if c.can_continue]
        if choices:
            choices[0].focus()
        self.refresh_bindings()

    # -- keys ---------------------------------------------------------------------------
    def action_stop_or_close(self) -> None:
        if self.running:
            self.show_status("stopping…")
            self.post_message(self.StopRequested())
        else:
            self.dismiss(None)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "choose":
            return not self.running
        return True

    def action_previous_column(self) -> None:
        self.focus_previous(CompareColumn)

    def action_next_column(self) -> None:
        self.focus_next(CompareColumn)

    def action_choose(self) -> None:
        focused = self.focused
        if isinstance(focused, CompareColumn):
            self._chose(focused.method)

    def on_compare_column_chosen(self, event: CompareColumn.Chosen) -> None:
        event.stop()
        self._chose(event.method)

    def _chose(self, method: str) -> None:
        if not self.running and self.column(method).can_continue:
            self.dismiss(method)
