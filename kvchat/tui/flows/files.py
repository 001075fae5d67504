"""Attaching files: `/file PATH [QUESTION]`, a pasted path, and a folder.

A file is read in a thread worker (not the model's: reading needs no model), with its
pages or chapters as progress and Esc to stop; once read it becomes a chip whose tokens
the turns flow counts. A folder's readable files are read in name order and counted, and
attached as one chip only after a confirmation that shows the token count. What cannot
be attached is one notification naming the cause and the way out; the editor then keeps
what was typed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.documents import Document, Folder, checked_path, read_document, read_folder
from kvchat.errors import Cancelled, DocumentError
from kvchat.optional import MissingPackage
from kvchat.tui.flows.runner import run_thread
from kvchat.tui.screens import ConfirmDialog
from kvchat.turns import plural

if TYPE_CHECKING:
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.widgets import ChatInput

# The progress bar follows the reading at most this often (each update waits for the UI).
PROGRESS_EVERY_S = 0.1
# How often the token counter retries when the tokenizer is busy in another thread.
TOKEN_COUNT_TRIES = 5


@dataclass
class Reading:
    """A file or folder being read: Esc sets `cancel`."""

    path: Path
    question: str  # typed after the path, left in the editor once attached
    typed: str  # the editor's text when reading began: replaced only if still there
    cancel: threading.Event = field(default_factory=threading.Event)
    shown_at: float = 0.0


class FilesFlow:
    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self.runner = app.runner
        self.reading: Reading | None = None

    # -- starting ------------------------------------------------------------------------
    def attach(self, path_text: str, question: str = "") -> None:
        """Read the file or folder at `path_text` and attach it (`/file`)."""
        app = self.app
        if self.reading is not None:
            app.notify(f"Still reading {self.reading.path.name}; Esc stops it.", severity="warning", markup=False)
            return
        try:
            path = checked_path(path_text)
        except DocumentError as err:
            self.refused(err)
            return
        self.reading = Reading(path, question, app.chat.chat_input.question)
        what = f"{path.name}/" if path.is_dir() else path.name
        app.chat.show_progress(f"Reading {what} · Esc stops")
        run_thread(app, self.read, self.reading, group="documents")

    def start_command(self) -> None:
        """The palette's "Attach a file": `/file ` in the editor, ready for the path."""
        prompt = self.app.chat.chat_input.prompt_area
        prompt.text = "/file "
        prompt.move_cursor(prompt.document.end)
        prompt.focus()

    def path_pasted(self, event: ChatInput.PathPasted) -> None:
        """A pasted path: attach that file or folder, or paste the path as text."""
        path = event.path
        size = "a folder" if path.is_dir() else f"{path.stat().st_size / 1e6:,.1f} MB"
        question = f"Attach {path.name} ({size})?\n{path}"

        def answered(attach: bool | None) -> None:
            if attach:
                self.attach(str(path))
            else:
                self.app.chat.chat_input.prompt_area.paste_as_text(event.text)

        self.app.push_screen(ConfirmDialog(question, "Attach", "Paste the path"), answered)

    # -- stopping --------------------------------------------------------------------------
    def can_stop(self) -> bool:
        return self.reading is not None and not self.reading.cancel.is_set()

    def stop(self) -> bool:
        """Esc: stop the reading under way; False when none is."""
        if not self.can_stop():
            return False
        assert self.reading is not None
        self.reading.cancel.set()
        return True

    # -- the worker --------------------------------------------------------------------------
    def read(self, reading: Reading) -> None:
        """In a worker: read, count a folder's tokens, and hand the result to the UI."""
        from_worker = self.runner.from_worker
        unit = "file" if reading.path.is_dir() else "part"

        def progress(done: int, total: int) -> None:
            now = time.perf_counter()
            if done == total or now - reading.shown_at >= PROGRESS_EVERY_S:
                reading.shown_at = now
                from_worker(self.show_progress, reading, unit, done, total)

        try:
            if reading.path.is_dir():
                folder = read_folder(reading.path, progress, reading.cancel)
                from_worker(self.app.chat.show_progress, f"Counting the tokens of {reading.path.name}/ · Esc stops")
                tokens = self.count_tokens(folder.text)
                if reading.cancel.is_set():
                    raise Cancelled()
                from_worker(self.confirm_folder, reading, folder, tokens)
                return
            document = read_document(reading.path, progress, reading.cancel)
        except Cancelled:
            from_worker(self.stopped, reading)
        except (DocumentError, MissingPackage) as err:
            from_worker(self.failed, reading, err)
        except Exception as err:  # a reader's own bug on an odd file: one line, never a traceback
            from_worker(
                self.failed, reading, DocumentError(f"{reading.path}: cannot read it ({type(err).__name__}: {err})")
            )
        else:
            from_worker(self.read_done, reading, document)

    def count_tokens(self, text: str) -> int | None:
        """The tokens of `text` (waits for the model while it loads); None when no model."""
        for attempt in range(TOKEN_COUNT_TRIES):
            try:
                return self.app.controller.count_tokens(text)
            except RuntimeError:  # fast tokenizers refuse concurrent use ("Already borrowed")
                time.sleep(0.1 * (attempt + 1))
            except Exception:
                return None
        return None

    # -- back on the UI ------------------------------------------------------------------------
    def show_progress(self, reading: Reading, unit: str, done: int, total: int) -> None:
        name = f"{reading.path.name}/" if unit == "file" else reading.path.name
        of = f"{unit} {done:,} of {total:,}" if unit == "file" else f"{done:,} of {total:,}"
        self.app.chat.show_progress(f"Reading {name}: {of} · Esc stops", done, total)

    def finish(self) -> None:
        self.reading = None
        if self.runner.activity is None:  # (a turn's reading shows its own progress)
            self.app.chat.hide_progress()
        self.app.refresh_bindings()

    async def read_done(self, reading: Reading, document: Document) -> None:
        self.finish()
        await self.attach_text(reading, document.text, document.summary)

    def confirm_folder(self, reading: Reading, folder: Folder, tokens: int | None) -> None:
        self.finish()
        count = f"{tokens:,} tokens" if tokens is not None else f"{len(folder.text):,} characters"
        lines = [f"Attach {plural(len(folder.documents), 'file')} from {folder.path.name}/ ({count}), in this order?"]
        names = [document.name for document in folder.documents]
        lines.append(", ".join(names[:8]) + (f", and {len(names) - 8} more" if len(names) > 8 else ""))
        if folder.skipped:
            lines.append(folder.skipped_note())
        summary = plural(len(folder.documents), "file")

        async def answered(attach: bool | None) -> None:
            if attach:
                await self.attach_text(reading, folder.text, summary, tokens)

        self.app.push_screen(ConfirmDialog("\n".join(lines), "Attach", "Cancel"), answered)

    async def attach_text(self, reading: Reading, text: str, summary: str, tokens: int | None = None) -> None:
        chat_input = self.app.chat.chat_input
        if chat_input.question == reading.typed:  # the editor still holds the command
            chat_input.prompt_area.clear()
            if reading.question:
                chat_input.prompt_area.text = reading.question
                chat_input.prompt_area.move_cursor(chat_input.prompt_area.document.end)
        await chat_input.attach(text, source=str(reading.path), summary=summary, tokens=tokens)

    def stopped(self, reading: Reading) -> None:
        self.finish()
        self.app.notify(f"Stopped reading {reading.path.name}; nothing attached.", markup=False)

    def failed(self, reading: Reading, err: Exception) -> None:
        self.finish()
        self.refused(err)

    def refused(self, err: Exception) -> None:
        self.app.notify(str(err), title="Cannot attach the file", severity="error", timeout=10, markup=False)
