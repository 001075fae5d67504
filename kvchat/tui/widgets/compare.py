"""One column of the compare view: a method's answer, streamed, under its figures.

The column shows what it is given (pieces of text, then the figures) and reports a
click as `CompareColumn.Chosen`; it never calls the model."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from kvchat.tui.status import megabytes


@dataclass(frozen=True)
class AnswerFigures:
    """A finished (or stopped) answer's figures, as the column shows them."""

    kv_bytes: int
    ttft_s: float
    decode_tokens_per_s: float
    stopped: bool = False

    def line(self) -> str:
        """Two short lines, so that they fit a narrow column."""
        speed = f"decode {self.decode_tokens_per_s:.1f} tok/s" if self.decode_tokens_per_s else "decode – tok/s"
        ttft = f"TTFT {self.ttft_s:.2f} s" if self.ttft_s else "TTFT –"
        return f"KV {megabytes(self.kv_bytes)} · {ttft}\n{speed}" + (" · stopped" if self.stopped else "")


class CompareColumn(Vertical, can_focus=True):
    """States: waiting → answering → done (figures shown); `chosen_ok` once the answer
    can be continued (it started)."""

    @dataclass
    class Chosen(Message):
        """The user clicked the column (or pressed Enter on it)."""

        method: str

    def __init__(self, method: str, current: bool = False) -> None:
        super().__init__(classes="compare-column", id=f"column-{method}")
        self.method = method
        self.current = current
        self.state = "waiting"
        self.text = ""  # the answer as received so far
        self.figures: AnswerFigures | None = None
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        title = f"{self.method} (current)" if self.current else self.method
        yield Static(title, classes="compare-title", markup=False)
        yield Static("waiting\n", classes="compare-figures", markup=False)
        yield Markdown("", classes="compare-answer")

    @property
    def figures_text(self) -> str:
        return str(self.query_one(".compare-figures", Static).render())

    @property
    def can_continue(self) -> bool:
        return self.state in ("answering", "done")

    def start(self) -> None:
        self.state = "answering"
        self.add_class("answering")
        self.query_one(".compare-figures", Static).update("answering…\n")
        # Pieces go through a MarkdownStream: only the new tail is parsed, never the whole answer.
        self._stream = Markdown.get_stream(self.query_one(Markdown))

    async def append(self, piece: str) -> None:
        if not piece:
            return
        if self._stream is None:
            self.start()
        assert self._stream is not None
        self.text += piece
        await self._stream.write(piece)

    async def finish(self, figures: AnswerFigures) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.state = "done"
        self.figures = figures
        self.remove_class("answering")
        self.set_class(figures.stopped, "stopped")
        if not self.text:
            await self.query_one(Markdown).update("*(no answer)*")
        self.query_one(".compare-figures", Static).update(figures.line())

    async def stop_waiting(self) -> None:
        """The comparison stopped before this method began."""
        if self.state == "waiting":
            self.state = "skipped"
            self.add_class("skipped")
            self.query_one(".compare-figures", Static).update("not run (stopped)\n")

    def on_click(self, event: events.Click) -> None:
        event.stop()
        if self.can_continue:
            self.post_message(self.Chosen(self.method))
