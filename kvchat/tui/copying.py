"""Copying answers and their code blocks to the clipboard (F4, F5).

Textual's `App.copy_to_clipboard` sends the text to the terminal as an OSC 52 escape,
which most terminals (and tmux with `set-clipboard on`) put on the system clipboard,
over SSH too; macOS Terminal ignores it. The app keeps its own copy either way.

Which answer: the focused one (click it, or Tab to it; Up and Down then move between
answers), else the last one. Which code block: the answer's last; pressing F5 again on
the same answer steps to the block before it, round to the last again, so any block is
a few presses away without a picker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from markdown_it import MarkdownIt

from kvchat.tui.widgets import AssistantMessage

if TYPE_CHECKING:
    from textual.dom import DOMNode

    from kvchat.tui.app import KvchatApp


@dataclass(frozen=True)
class CodeBlock:
    language: str  # the fence's info word ("" when none)
    text: str

    def describe(self) -> str:
        return f"{self.language or 'code'}, {line_count(self.text)}"


def code_blocks(markdown: str) -> list[CodeBlock]:
    """The fenced and indented code blocks of `markdown`, in order, as the Markdown
    widget renders them (the same parser: markdown-it, CommonMark). A fence still open
    (an answer mid-stream) runs to the end, as it is shown."""
    blocks = []
    for token in MarkdownIt("commonmark").parse(markdown):
        if token.type in ("fence", "code_block"):
            info = token.info.strip().split()
            blocks.append(CodeBlock(info[0] if info else "", token.content))
    return blocks


def line_count(text: str) -> str:
    """ "3 lines": the lines `text` shows (a last newline ends a line, it starts none)."""
    count = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    return f"{count} line{'s' if count != 1 else ''}"


class Copier:
    """The app's copy actions. Not a DOM node: it reads the chat screen's answers."""

    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self._last_code: tuple[AssistantMessage, int] | None = None  # (answer, block index) copied last

    def target(self) -> AssistantMessage | None:
        """The focused answer (or the answer around the focused widget), else the last."""
        node: DOMNode | None = self.app.focused
        while node is not None:
            if isinstance(node, AssistantMessage):
                return node
            node = node.parent
        answers = [a for a in self.app.chat.message_list.assistant_messages() if a.text.strip()]
        return answers[-1] if answers else None

    def copy_answer(self) -> None:
        answer = self.target()
        if answer is None:
            self.app.notify("There is no answer to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(answer.text)
        self.app.notify(f"Copied the answer ({line_count(answer.text)}, {len(answer.text):,} characters).")

    def copy_code(self) -> None:
        answer = self.target()
        if answer is None:
            self.app.notify("There is no answer to copy from yet.", severity="warning")
            return
        blocks = code_blocks(answer.text)
        if not blocks:
            self._last_code = None
            self.app.notify("This answer has no code block; F4 copies the whole answer.", severity="warning")
            return
        index = len(blocks) - 1
        if self._last_code is not None and self._last_code[0] is answer:
            index = (self._last_code[1] - 1) % len(blocks)  # again: the block before, round to the last
        self._last_code = (answer, index)
        block = blocks[index]
        self.app.copy_to_clipboard(block.text)
        more = f" (F5 again: block {index if index else len(blocks)})" if len(blocks) > 1 else ""
        self.app.notify(f"Copied code block {index + 1} of {len(blocks)} ({block.describe()}){more}.")
