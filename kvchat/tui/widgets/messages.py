"""The conversation: user messages (literal text), assistant answers (Markdown,
streamed), and notices."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream


class UserMessage(Vertical):
    """What the user sent. The text is shown literally (markup=False): a question
    such as `[bold red]x[/]` must appear as typed, not styled."""

    def __init__(self, text: str, document_labels: Sequence[str] = ()) -> None:
        super().__init__(classes="message user-message")
        self.text = text
        self.document_labels = list(document_labels)

    def compose(self) -> ComposeResult:
        yield Static("You", classes="message-author", markup=False)
        for label in self.document_labels:
            yield Static(label, classes="message-document", markup=False)
        if self.text:
            yield Static(self.text, classes="message-body", markup=False)


class AssistantMessage(Vertical, can_focus=True):
    """The model's answer. While generating, pieces are appended through a
    MarkdownStream: Markdown.append parses only the new tail (never the whole
    answer per token), and the stream coalesces pieces when rendering lags.

    An answer takes focus (click, Tab) so that F4/F5 copy it or its code; while one
    has focus, Up and Down move to the answer before or after it."""

    BINDINGS = [
        Binding("up", "neighbour(-1)", "Previous answer", show=False, tooltip="focus the answer before this one"),
        Binding("down", "neighbour(1)", "Next answer", show=False, tooltip="focus the answer after this one"),
    ]

    def __init__(self, text: str = "", author: str = "kvchat") -> None:
        super().__init__(classes="message assistant-message")
        self._initial = text
        self.author = author
        self.text = text  # the answer as received so far (raw markdown)
        self.pieces_received = 0
        self.stopped = False
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.author, classes="message-author", markup=False)
        yield Markdown(self._initial, classes="message-body")
        yield Static("", classes="message-note", markup=False)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def start_stream(self) -> None:
        self.add_class("streaming")
        self._stream = Markdown.get_stream(self.markdown)

    async def append(self, piece: str) -> None:
        if not piece:
            return
        if self._stream is None:
            self.start_stream()
        assert self._stream is not None
        self.text += piece
        self.pieces_received += 1
        await self._stream.write(piece)

    async def finish(self, note: str = "", stopped: bool = False) -> None:
        """Flush the stream; `note` goes under the answer (e.g. why it stopped)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.remove_class("streaming")
        self.stopped = stopped
        self.set_class(stopped, "stopped")
        self.set_note(note)

    def action_neighbour(self, step: int) -> None:
        answers = list(self.screen.query(AssistantMessage))
        index = answers.index(self) + step
        if 0 <= index < len(answers):
            answers[index].focus()  # Textual scrolls a newly focused widget into view

    def set_note(self, note: str) -> None:
        note_widget = self.query_one(".message-note", Static)
        note_widget.update(note)
        note_widget.display = bool(note)


class NoticeMessage(Static):
    """A line in the conversation from kvchat itself (resume, errors, switches)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, classes="message notice-message", markup=False)


class MessageList(VerticalScroll):
    """The scrolling conversation; it stays anchored to the bottom while an answer
    streams, unless the user scrolls up."""

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str, document_labels: Sequence[str] = ()) -> UserMessage:
        message = UserMessage(text, document_labels)
        await self.mount(message)
        return message

    async def add_assistant(self, text: str = "", author: str = "kvchat") -> AssistantMessage:
        message = AssistantMessage(text, author)
        await self.mount(message)
        return message

    async def add_notice(self, text: str) -> NoticeMessage:
        notice = NoticeMessage(text)
        await self.mount(notice)
        return notice

    async def clear(self) -> None:
        await self.remove_children()

    def assistant_messages(self) -> list[AssistantMessage]:
        return list(self.query(AssistantMessage))

    def user_messages(self) -> list[UserMessage]:
        return list(self.query(UserMessage))
