"""The message editor: a multi-line TextArea plus chips for attached documents.

Enter sends, Ctrl+J / Alt+Enter insert a newline. A long paste becomes a document
chip ("Document 1 · 12,345 tokens") instead of a wall of text in the editor; the
token count is filled in by the app (widgets never touch the model or tokenizer). A
pasted path of a file or folder (what a terminal pastes when one is dropped on it) is
handed to the app, which offers to attach it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Static, TextArea

from kvchat.tui.documents import AttachedDocument, is_long_paste, pasted_path


class PromptArea(TextArea):
    """The text editor. Enter is a priority binding so that it sends instead of
    TextArea inserting a newline; the editor keeps its own keys (ctrl+a/e/w/k/z...)."""

    BINDINGS = [
        Binding("enter", "submit", "Send", priority=True),
        Binding("ctrl+j,alt+enter,shift+enter", "newline", "Newline", key_display="^j"),
    ]

    class SubmitRequested(Message):
        """Enter was pressed."""

    class LongPaste(Message):
        """A paste long enough to become a document chip."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class PathPasted(Message):
        """A paste that names a file or folder on this machine."""

        def __init__(self, path: Path, text: str) -> None:
            super().__init__()
            self.path = path
            self.text = text

    class RemoveLastDocument(Message):
        """Backspace in an empty editor: take back the last chip."""

    def paste_as_text(self, text: str) -> None:
        """What the editor does with a paste of its own (the app declined to attach it)."""
        result = self.replace(text, *self.selection)
        self.move_cursor(result.end_location)

    def action_submit(self) -> None:
        self.post_message(self.SubmitRequested())

    def action_newline(self) -> None:
        self.insert("\n")

    def _taken(self, text: str) -> bool:
        """Whether a paste goes to the app instead of the editor: a long one, or a path."""
        if is_long_paste(text):
            self.post_message(self.LongPaste(text))
            return True
        path = pasted_path(text)
        if path is not None:
            self.post_message(self.PathPasted(path, text))
            return True
        return False

    async def _on_paste(self, event: events.Paste) -> None:
        # Replaces TextArea's handler: a long paste or a path must not land in the editor.
        if self._taken(event.text):
            event.stop()
            event.prevent_default()
            return
        await super()._on_paste(event)

    def action_paste(self) -> None:
        # Ctrl+V pastes the app's clipboard: same rule as a terminal paste.
        text = self.app.clipboard
        if text and self._taken(text):
            return
        super().action_paste()

    def action_delete_left(self) -> None:
        if not self.text and self.selection.is_empty:
            self.post_message(self.RemoveLastDocument())
            return
        super().action_delete_left()


class DocumentChip(Static, can_focus=True):
    """One attached document. Click it, or focus it and press Delete, to remove it."""

    BINDINGS = [Binding("delete,backspace", "remove_document", "Remove document")]

    class RemoveRequested(Message):
        def __init__(self, number: int) -> None:
            super().__init__()
            self.number = number

    def __init__(self, document: AttachedDocument) -> None:
        super().__init__(classes="document-chip", markup=False)
        self.number = document.number
        self.show(document)
        self.tooltip = "Click or press Delete to remove this document"

    def show(self, document: AttachedDocument) -> None:
        self.chip_text = document.label
        self.update(f"{document.label}  ✕")

    def action_remove_document(self) -> None:
        self.post_message(self.RemoveRequested(self.number))

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.action_remove_document()


class ChatInput(Vertical):
    """Editor + document chips. Reports a send as `ChatInput.Submitted`; the app
    decides whether it can be sent (and clears the input only when it was)."""

    @dataclass
    class Submitted(Message):
        question: str
        documents: list[AttachedDocument]

    @dataclass
    class PathPasted(Message):
        """A pasted path of a file or folder; the app asks whether to attach it."""

        path: Path
        text: str

    @dataclass
    class DocumentAttached(Message):
        """A document was added; the app counts its tokens and calls set_tokens."""

        document: AttachedDocument

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.documents: list[AttachedDocument] = []
        self._next_number = 1

    def compose(self) -> ComposeResult:
        yield Horizontal(id="document-chips")
        yield PromptArea(id="prompt", soft_wrap=True, show_line_numbers=False, tab_behavior="focus")

    def on_mount(self) -> None:
        self.query_one("#document-chips").display = False
        self.prompt_area.border_title = "Message · Enter send · Ctrl+J newline · /file PATH attaches"

    @property
    def prompt_area(self) -> PromptArea:
        return self.query_one(PromptArea)

    @property
    def question(self) -> str:
        return self.prompt_area.text

    def chips(self) -> list[DocumentChip]:
        return list(self.query(DocumentChip))

    async def attach(
        self, text: str, source: str = "", summary: str = "", tokens: int | None = None
    ) -> AttachedDocument:
        """A chip for `text`; `tokens` when already counted (else the app counts them)."""
        document = AttachedDocument(self._next_number, text, source, tokens, summary)
        self._next_number += 1
        self.documents.append(document)
        chips = self.query_one("#document-chips")
        chips.display = True
        await chips.mount(DocumentChip(document))
        self.post_message(self.DocumentAttached(document))
        return document

    def set_tokens(self, number: int, tokens: int) -> None:
        for document in self.documents:
            if document.number == number:
                document.tokens = tokens
                for chip in self.chips():
                    if chip.number == number:
                        chip.show(document)

    async def remove_document(self, number: int) -> None:
        self.documents = [d for d in self.documents if d.number != number]
        for chip in self.chips():
            if chip.number == number:
                await chip.remove()
        self.query_one("#document-chips").display = bool(self.documents)
        self.prompt_area.focus()

    async def clear(self) -> None:
        """After a send: empty editor, no chips, numbering from 1 again."""
        self.prompt_area.clear()
        self.documents = []
        self._next_number = 1
        chips = self.query_one("#document-chips")
        await chips.remove_children()
        chips.display = False

    def on_prompt_area_submit_requested(self, event: PromptArea.SubmitRequested) -> None:
        event.stop()
        self.post_message(self.Submitted(self.question, list(self.documents)))

    async def on_prompt_area_long_paste(self, event: PromptArea.LongPaste) -> None:
        event.stop()
        await self.attach(event.text)

    def on_prompt_area_path_pasted(self, event: PromptArea.PathPasted) -> None:
        event.stop()
        self.post_message(self.PathPasted(event.path, event.text))

    async def on_prompt_area_remove_last_document(self, event: PromptArea.RemoveLastDocument) -> None:
        event.stop()
        if self.documents:
            await self.remove_document(self.documents[-1].number)

    async def on_document_chip_remove_requested(self, event: DocumentChip.RemoveRequested) -> None:
        event.stop()
        await self.remove_document(event.number)
