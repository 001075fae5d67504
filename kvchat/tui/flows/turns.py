"""What is typed in the editor: slash commands (`/file` goes to the files flow), attached
documents' token counts, and sending a message, whose answer streams from the model worker.

A message sent while the model loads is shown at once and waits (`PendingTurn`); the
runner hands it back here once the model is loaded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat.chat.controller import methods
from kvchat.errors import CommandError
from kvchat.settings import PREFILL_CHUNK
from kvchat.tui.documents import AttachedDocument, joined_documents, split_file_argument
from kvchat.tui.flows.runner import LOADING, STREAM_FLUSH_S, run_thread
from kvchat.tui.slash import SlashCommand, parse_input
from kvchat.tui.status import LiveTurn, Speeds

if TYPE_CHECKING:
    from kvchat.chat.controller import TurnOutcome
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.widgets import AssistantMessage, ChatInput
    from kvchat.turns import TurnResult

# How often the token counter retries when the tokenizer is busy in another thread.
TOKEN_COUNT_TRIES = 5


@dataclass
class PendingTurn:
    """A message sent while the model loads: shown at once, answered once it is loaded."""

    question: str
    documents: list[AttachedDocument]
    answer: AssistantMessage


class TurnsFlow:
    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self.runner = app.runner
        self.pending: PendingTurn | None = None  # a message sent while the model loads
        self.last_result: TurnResult | None = None  # the last turn's result

    # -- the editor --------------------------------------------------------------------
    async def submitted(self, event: ChatInput.Submitted) -> None:
        app = self.app
        try:
            parsed = parse_input(event.question, [name for name, _ in methods()])
        except CommandError as err:
            app.notify(str(err), severity="warning", markup=False)
            return
        if isinstance(parsed, SlashCommand):
            await self.run_slash_command(parsed)
            return
        if not parsed:
            if event.documents:
                app.notify("Type a question about the document, then press Enter.", severity="warning")
            return
        activity = self.runner.activity
        if activity == LOADING and self.pending is not None:
            app.notify(
                "One message already waits for the model; send this one when it is answered.", severity="warning"
            )
            return
        if activity != LOADING and not self.runner.ensure_idle():
            return
        await self.send_message(parsed, event.documents)

    async def run_slash_command(self, command: SlashCommand) -> None:
        if command.action == "file":
            self.app.files.attach(*split_file_argument(command.argument))
            return
        self.app.chat.chat_input.prompt_area.clear()
        if command.action == "method":
            self.app.methods.switch(command.argument)
        elif command.action == "system":
            self.app.methods.system(command.argument)
        elif command.action == "recall":
            self.app.methods.recall(command.argument)
        else:
            await self.app.run_action(command.action)

    def document_attached(self, event: ChatInput.DocumentAttached) -> None:
        if event.document.tokens is not None:  # (a folder's, counted before it was confirmed)
            return
        run_thread(self.app, self.count_document_tokens, event.document.number, event.document.text, group="tokens")

    def count_document_tokens(self, number: int, text: str) -> None:
        """In a worker: the chip's token count."""
        for attempt in range(TOKEN_COUNT_TRIES):
            try:
                tokens = self.app.controller.count_tokens(text)  # waits for the model while it loads
                break
            except RuntimeError:  # fast tokenizers refuse concurrent use ("Already borrowed")
                time.sleep(0.1 * (attempt + 1))
            except Exception:  # no model: the chip simply shows no count
                return
        else:
            return
        self.runner.from_worker(self.app.chat.chat_input.set_tokens, number, tokens)

    # -- sending -----------------------------------------------------------------------
    async def send_message(self, question: str, documents: list[AttachedDocument]) -> None:
        await self.app.chat.chat_input.clear()
        answer = await self.show_question(question, documents)
        if self.runner.activity == LOADING:
            self.pending = PendingTurn(question, documents, answer)  # sent once the model is loaded
            self.app.notify("The model is loading; your message is sent as soon as it is ready.")
        else:
            self.start_turn(question, documents, answer)

    async def show_question(self, question: str, documents: list[AttachedDocument]) -> AssistantMessage:
        """The question in the list, and the (empty, streaming) answer below it."""
        messages = self.app.chat.message_list
        await messages.add_user(question, [doc.sent_label for doc in documents])
        answer = await messages.add_assistant(author=f"kvchat · {self.app.controller.method}")
        answer.start_stream()
        return answer

    async def send_pending(self, *, after_transcript: bool) -> bool:
        """Once the model is loaded: answer the message that waited for it, if any
        (shown again after a resumed transcript, which replaced the list). True when
        one waited."""
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        answer = await self.show_question(pending.question, pending.documents) if after_transcript else pending.answer
        self.start_turn(pending.question, pending.documents, answer)
        return True

    async def drop_pending(self, note: str) -> None:
        """The model did not load: the waiting message gets no answer."""
        pending, self.pending = self.pending, None
        if pending is not None:
            await pending.answer.finish(note, stopped=True)

    def start_turn(self, question: str, documents: list[AttachedDocument], answer: AssistantMessage) -> None:
        cancel = threading.Event()
        live = self.runner.live = LiveTurn()
        self.runner.set_activity("generating", cancel)
        if documents:
            self.app.chat.show_progress("Reading the document…")
        self.runner.run(self.run_turn, question, joined_documents(documents), answer, live, cancel)

    def run_turn(
        self,
        question: str,
        document: str | None,
        answer: AssistantMessage,
        live: LiveTurn,
        cancel: threading.Event,
    ) -> None:
        """The model worker of a turn."""
        from_worker = self.runner.from_worker
        # Pieces are coalesced so the UI is called at most ~30 times a second: the
        # decode thread waits for each call, and a fast GPU makes 100+ tokens/s.
        pending: list[str] = []
        last_flush = 0.0

        def flush() -> None:
            nonlocal last_flush
            if pending:
                text = "".join(pending)
                pending.clear()
                from_worker(answer.append, text)
            last_flush = time.perf_counter()

        def on_token(piece: str) -> None:
            live.on_piece()
            pending.append(piece)
            if time.perf_counter() - last_flush >= STREAM_FLUSH_S:
                flush()

        def on_progress(done: int, total: int) -> None:
            live.on_progress(done, total)
            if total > PREFILL_CHUNK:
                from_worker(self.show_reading_progress, done, total)

        # The turn is saved here, in the worker, before the UI hears of it: quitting
        # waits for this worker, so whatever was said is on disk before the app exits.
        try:
            outcome = self.app.controller.send(
                question, document, on_token=on_token, on_progress=on_progress, cancel=cancel
            )
        except Exception as err:
            flush()
            from_worker(self.turn_failed, answer, err)
            return
        flush()
        from_worker(self.turn_finished, answer, outcome)

    def show_reading_progress(self, done: int, total: int) -> None:
        if done >= total:
            self.app.chat.hide_progress()
        else:
            self.app.chat.show_progress(f"Reading {done:,} / {total:,} tokens", done, total)

    async def turn_finished(self, answer: AssistantMessage, outcome: TurnOutcome) -> None:
        result, save_error = outcome.result, outcome.save_error
        if result.stop_reason == "cancelled":
            note = "stopped — the partial answer is kept" if result.text else "stopped before the answer began"
        elif result.stop_reason == "length":
            note = f"cut at {self.app.sampling.max_new_tokens} new tokens (--max-new-tokens)"
        else:
            note = ""
        await answer.finish(note, stopped=result.cancelled)
        self.last_result = result
        self.runner.last_speeds = Speeds.from_metrics(result.metrics)
        self.runner.end_activity()
        self.app.update_title()
        if save_error is not None:
            self.runner.report_error("This turn was not saved", save_error)

    async def turn_failed(self, answer: AssistantMessage, err: Exception) -> None:
        await answer.finish("no answer: generation failed", stopped=True)
        self.runner.end_activity()
        self.runner.report_error("Generation failed", err)
