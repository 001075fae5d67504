"""The main screen: conversation, progress of long work, status bar, editor, footer.

It only arranges widgets and shows progress; the app owns the session and the
workers, and calls the methods here from the UI thread."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, ProgressBar

from kvchat.tui.widgets import ChatInput, MessageList, StatusBar


class ChatScreen(Screen[None]):
    AUTO_FOCUS = "#prompt"

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◈")
        yield MessageList(id="messages")
        with Horizontal(id="progress-panel"):
            yield Label("", id="progress-label", markup=False)
            yield ProgressBar(id="progress-bar", show_eta=False)
        yield StatusBar(id="status-bar")
        yield ChatInput(id="chat-input")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.hide_progress()

    @property
    def message_list(self) -> MessageList:
        return self.query_one(MessageList)

    @property
    def status_bar(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def progress_bar(self) -> ProgressBar:
        return self.query_one("#progress-bar", ProgressBar)

    @property
    def progress_visible(self) -> bool:
        return bool(self.query_one("#progress-panel").display)

    def show_progress(self, label: str, done: int | None = None, total: int | None = None) -> None:
        """`done`/`total` None: indeterminate (e.g. before the first chunk is fed)."""
        self.query_one("#progress-panel").display = True
        self.query_one("#progress-label", Label).update(label)
        self.progress_bar.update(total=total, progress=done or 0)

    def hide_progress(self) -> None:
        self.query_one("#progress-panel").display = False
        # An indeterminate bar refreshes itself 15 times a second even while hidden (a
        # determinate one does not): the idle app's loop would wake 46 times a second
        # instead of 16.
        self.progress_bar.update(total=1, progress=0)
