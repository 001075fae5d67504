"""Branch (F3): pick one of your earlier messages, then edit and resend it, or regenerate
the answer after it. Either one is done in a new session, a branch that shares the
conversation up to that message; the app does the work (`SessionsFlow`), these screens
only show the messages and report the choice.

`BranchPicker` lists your messages, turn 1 first, and dismisses with a `BranchChoice`;
`EditMessage` is an editor prefilled with the message, dismissed with the edited text.
A message sent with a document is shown, and edited, as its question: the document
goes with it unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from kvchat.tui.documents import split_long_user_text
from kvchat.tui.widgets import PromptArea

# A message's first line is cut to this many characters in the list.
PREVIEW_CHARS = 76


@dataclass(frozen=True)
class BranchChoice:
    """Edit and resend, or regenerate, turn `turn` (1-based): its question, and the
    document sent before it (None when there was none)."""

    action: Literal["edit", "regenerate"]
    turn: int
    question: str
    document: str | None = None


def split_message(text: str) -> tuple[str, str | None]:
    """A stored user message as (question, document before it or None)."""
    question, document_chars = split_long_user_text(text)
    return question, (text.rstrip()[:document_chars] if document_chars else None)


def preview(turn: int, text: str) -> Text:
    """One line of the list: the turn number, the question's first line, a document note."""
    question, document = split_message(text)
    lines = question.strip().splitlines() or [""]
    line = lines[0] if len(lines[0]) <= PREVIEW_CHARS else lines[0][: PREVIEW_CHARS - 1] + "…"
    more = " …" if len(lines) > 1 and len(lines[0]) <= PREVIEW_CHARS else ""
    label = Text.assemble((f"{turn:>3}  ", "bold"), line + more)
    if document is not None:
        label.append(f"  (after a document · {len(document):,} characters)", style="dim italic")
    return label


class BranchPicker(ModalScreen[BranchChoice | None]):
    """Your messages in this conversation; the newest is highlighted."""

    BINDINGS = [
        Binding(
            "enter,e",
            "edit",
            "Edit & resend",
            tooltip="edit the highlighted message, then send it in a new session (a branch) that shares the "
            "conversation before it",
        ),
        Binding(
            "r",
            "regenerate",
            "Regenerate",
            tooltip="answer the highlighted message again, in a branch that shares the conversation before it",
        ),
        Binding("escape", "close", "Close"),
    ]

    def __init__(self, messages: Sequence[str]) -> None:
        """`messages`: the user messages of the open conversation, turn 1 first."""
        super().__init__(classes="dialog-screen")
        self.messages = list(messages)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog picker"):
            yield Static(
                "Branch from one of your messages — the original stays saved", classes="dialog-title", markup=False
            )
            yield OptionList(
                *[Option(preview(i, text), id=str(i)) for i, text in enumerate(self.messages, 1)], id="branch-list"
            )
            yield Footer(compact=True)

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        if self.messages:
            options.highlighted = len(self.messages) - 1
        options.focus()

    def highlighted_turn(self) -> int | None:
        index = self.query_one(OptionList).highlighted
        return None if index is None else index + 1

    def choose(self, action: Literal["edit", "regenerate"]) -> None:
        turn = self.highlighted_turn()
        if turn is not None:
            question, document = split_message(self.messages[turn - 1])
            self.dismiss(BranchChoice(action, turn, question, document))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()  # Enter on the list: the list's own binding comes before the screen's
        self.choose("edit")

    def action_edit(self) -> None:
        self.choose("edit")

    def action_regenerate(self) -> None:
        self.choose("regenerate")

    def action_close(self) -> None:
        self.dismiss(None)


class EditMessage(ModalScreen[str | None]):
    """An editor prefilled with a message: Enter sends the edited text, Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = "EditMessage #edit-prompt { height: auto; min-height: 3; max-height: 16; }"

    def __init__(self, turn: int, text: str, document: str | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.turn = turn
        self.text = text
        self.document = document

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog edit-message"):
            note = " (the document sent before it goes with it)" if self.document else ""
            yield Static(
                f"Edit message {self.turn}{note}; Enter sends it in a new session, Esc cancels",
                classes="dialog-text",
                markup=False,
            )
            yield PromptArea(self.text, id="edit-prompt", soft_wrap=True, show_line_numbers=False, tab_behavior="focus")

    def on_mount(self) -> None:
        editor = self.query_one(PromptArea)
        editor.move_cursor(editor.document.end)
        editor.focus()

    def on_prompt_area_submit_requested(self, event: PromptArea.SubmitRequested) -> None:
        event.stop()
        text = self.query_one(PromptArea).text.strip()
        if not text:
            self.notify("Type the message to send, or press Esc.", severity="warning")
            return
        self.dismiss(text)

    def on_prompt_area_long_paste(self, event: PromptArea.LongPaste) -> None:
        event.stop()  # no document chips here: a long paste is simply text of the message
        self.query_one(PromptArea).insert(event.text)

    def action_cancel(self) -> None:
        self.dismiss(None)
