"""KvchatApp: the Textual chat app, and `run_app`, which the CLI calls.

The app draws, routes keys and starts workers; what the chat does lives in
`kvchat.controller.Controller`. Every controller call that touches the model or the
database runs in a Textual thread worker, never on the UI thread. Model work (a turn,
a method switch, a rebuild, a resume, a comparison) runs one worker at a time (group "model"), so
the screen never freezes and keys echo while the model works. Workers report back
with `call_from_thread`; the status bar is refreshed by a timer, never once per token.

Start-up: the first frame is drawn at once and the model loads in a worker, with
"loading model…" in the status bar; a message sent meanwhile waits for the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.timer import Timer
from textual.worker import Worker, WorkerFailed, get_current_worker

from .. import controller as chat
from ..compare import SHARED, Comparison, MethodAnswer
from ..controller import CommandError, Controller, EngineLoader, ResumeOutcome, SlashCommand, TurnOutcome
from ..engine import PREFILL_CHUNK, CacheSettings, Cancelled, InputTooLong, SamplingSettings
from ..models import ModelError
from ..persist import SnapshotMismatch
from ..store import SessionRow, Store, StoreError
from .commands import KvchatCommands, PaletteCommand, run_action_later
from .documents import AttachedDocument, DocumentError, joined_documents, read_text_file, split_long_user_text
from .screens import (
    ChatScreen, CompareMethodsPicker, CompareScreen, ConfirmDialog, HelpScreen, MemoryScreen, MethodPicker,
    SessionsScreen,
)
from .screens.sessions import SessionChoice
from .status import LiveTurn, Speeds, StatusReport, megabytes
from .widgets import AnswerFigures, AssistantMessage, ChatInput, PromptArea

# The status bar is refreshed this often while the model works (and once after).
STATUS_INTERVAL_S = 0.25
# The answer is handed to the UI at most this often (pieces in between are joined).
STREAM_FLUSH_S = 1 / 30
# How often the token counter retries when the tokenizer is busy in another thread.
TOKEN_COUNT_TRIES = 5
# How often a waiting worker looks whether the app is closing.
WAIT_POLL_S = 0.1
LOADING = "loading model…"
NO_MODEL = "no model loaded"

EDITOR_NOTES = [
    "Editor: Enter sends, Ctrl+J (or Alt+Enter) inserts a newline; the editor keeps its own keys:",
    "  ctrl+a/e line start/end · ctrl+w/u/k delete word/to start/to end · ctrl+z/y undo/redo",
    "  ctrl+x/c/v cut/copy/paste.",
    "Documents: a long paste becomes a chip (“Document 1 · 12,345 tokens”) put before your question;",
    "  /file PATH attaches a text file; Backspace in an empty editor removes the last chip.",
    "Commands typed in the editor: /file PATH · /method NAME · /new · /sessions · /rebuild · /help.",
]


@dataclass
class PendingTurn:
    """A message sent while the model loads: shown at once, answered once it is loaded."""

    question: str
    documents: list[AttachedDocument]
    answer: AssistantMessage


class KvchatApp(App[None]):
    # Absolute, so that subclasses defined elsewhere (tests) still find it.
    CSS_PATH = Path(__file__).with_name("styles.tcss")
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {KvchatCommands}

    # The help screen and the command palette are built from this list.
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="stop generating (the partial answer is kept) or stop a rebuild"),
        Binding("ctrl+c", "interrupt", "Stop", show=False, priority=True,
                tooltip="same as Esc while the model works; otherwise copies in the editor"),
        Binding("ctrl+t", "cycle_method", "Next method", tooltip="cycle the compression method; takes effect at once"),
        Binding("ctrl+o", "pick_method", "Methods", tooltip="choose the method from a list with descriptions"),
        Binding("ctrl+r", "rebuild", "Rebuild", show=False,
                tooltip="re-read the whole transcript through the current method (faithful state; Esc stops)"),
        Binding("ctrl+g", "compare", "Compare", show=False,
                tooltip="ask the last question again under methods you pick, answers side by side; continue with one"),
        Binding("ctrl+s", "sessions", "Sessions", tooltip="list, resume, rename or delete saved sessions"),
        Binding("ctrl+n", "new_session", "New", tooltip="start a new session (the current one stays saved)"),
        Binding("f2", "memory", "Memory",
                tooltip="the memory map: how much of each message and document the cache still holds, per layer too"),
        Binding("f1", "help", "Help", tooltip="this screen"),
        Binding("ctrl+p", "command_palette", "Palette", show=False, tooltip="search every action"),
        Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="stop the model, save, and quit"),
    ]
    # Actions that only make sense on the chat screen (not under a modal screen).
    CHAT_ACTIONS = {"cycle_method", "pick_method", "rebuild", "sessions", "new_session", "help", "memory", "compare"}
    # Actions the memory map allows too: switching there shows what the new method keeps.
    MEMORY_ACTIONS = {"cycle_method", "pick_method"}

    def __init__(
        self,
        engine: Any | EngineLoader,
        store: Store | None,
        settings: CacheSettings,
        sampling: SamplingSettings,
        resume_id: int | None = None,
        *,
        reopen_last: bool = True,
    ) -> None:
        """`engine`: a kvchat Engine, or a callable that loads one (the CLI passes a
        loader so the first frame need not wait for the model; snapshot tests pass a
        fake engine). `store` None: nothing is saved or listed; otherwise only its path
        is used, each worker opening its own connection. `reopen_last`: open the most
        recent session when `resume_id` is None."""
        super().__init__()
        self.controller = Controller(
            engine, store.path if store is not None else None, settings, sampling,
            store_timeout_s=store.timeout_s if store is not None else 10.0,
        )
        self.resume_id = resume_id
        self.reopen_last = reopen_last
        self.activity: str | None = None  # what the model worker is doing; None when idle
        self.cancel_event: threading.Event | None = None
        self.live: LiveTurn | None = None
        self.last_speeds = Speeds()
        self.last_result = None  # the last turn's engine.TurnResult
        self.model_worker: Worker[None] | None = None
        self.pending: PendingTurn | None = None  # a message sent while the model loads
        self.ui_errors: list[BaseException] = []  # UI callbacks that failed (tests assert none)
        self._shutting_down = False
        self._status_timer: Timer | None = None

    # -- start -------------------------------------------------------------------------
    @property
    def chat(self) -> ChatScreen:
        return self.get_screen("chat")  # type: ignore[return-value]

    @property
    def conversation(self) -> chat.Conversation | None:
        return self.controller.conversation

    @property
    def sampling(self) -> SamplingSettings:
        return self.controller.sampling

    @property
    def has_store(self) -> bool:
        return self.controller.db_path is not None

    async def on_mount(self) -> None:
        self.install_screen(ChatScreen(), "chat")
        await self.push_screen("chat")
        self._status_timer = self.set_interval(STATUS_INTERVAL_S, self.refresh_status, pause=True)
        self.update_title()
        self.set_activity(LOADING)
        self.model_worker = self.run_load()

    @work(thread=True, group="model", exit_on_error=False)
    def run_load(self) -> None:
        """Wait for the model (it loads in its own daemon thread, so quitting now never
        waits for it), then open the session to resume, if any."""
        worker = get_current_worker()
        try:
            while not self.controller.load(timeout=WAIT_POLL_S):
                if worker.is_cancelled or self._shutting_down:
                    return
        except Exception as err:
            self.from_worker(self.load_failed, err)
            return
        target = self.resume_id
        if target is None and self.reopen_last:
            try:
                target = self.controller.last_session_id()
            except StoreError as err:
                self.from_worker(self.report_error, "Could not read the saved sessions", err)
        resumed: ResumeOutcome | None = None
        refused: str | None = None
        if target is not None:
            try:
                resumed = self.controller.resume(target)
            except SnapshotMismatch as err:
                refused = str(err)
            except Exception as err:
                self.from_worker(self.report_error, f"Could not open session {target}", err)
        self.from_worker(self.model_loaded, resumed, target, refused)

    async def model_loaded(self, resumed: ResumeOutcome | None, target: int | None, refused: str | None) -> None:
        if resumed is not None:
            await self.show_resumed(resumed)
        # Idle only once the transcript is shown. The trend starts with the first turn.
        self.end_activity(trend_sample=resumed is not None)
        self.update_title()
        pending, self.pending = self.pending, None
        if pending is not None:
            # The resumed transcript replaced the list: show the waiting message again after it.
            answer = pending.answer if resumed is None else await self.show_question(pending.question, pending.documents)
            self.start_turn(pending.question, pending.documents, answer)
        if refused is not None and target is not None:
            if pending is None:
                self.resume_refused(target, refused)
            else:
                self.notify(f"Session {target} was not restored: {refused}. Your message started a new session.",
                            severity="warning", timeout=12, markup=False)

    async def load_failed(self, err: Exception) -> None:
        self.activity = NO_MODEL  # stays: nothing can run without a model
        self.refresh_bindings()
        self.report_error("Could not load the model", err)
        self.chat.status_bar.show_text(f"{NO_MODEL} │ Ctrl+Q quits")
        pending, self.pending = self.pending, None
        if pending is not None:
            await pending.answer.finish("no answer: the model did not load", stopped=True)

    def update_title(self) -> None:
        conv = self.conversation
        where = f"session {conv.session_id} · {conv.title}" if conv and conv.session_id is not None else "new session"
        self.sub_title = f"{self.controller.model_name} · {where}"

    # -- bindings ----------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("stop", "interrupt"):
            if action == "interrupt" and isinstance(self.screen, CompareScreen):
                return True if self.can_stop() else None  # Ctrl+C stops a comparison like Esc
            if not isinstance(self.screen, ChatScreen):
                return False  # under a dialog, Esc closes the dialog
            if action == "interrupt" and self.activity == LOADING:
                return True  # nothing to stop yet: Ctrl+C quits
            # None: shown dimmed, and the key falls through (ctrl+c then copies).
            return True if self.can_stop() else None
        if action in self.MEMORY_ACTIONS and isinstance(self.screen, MemoryScreen):
            return True
        if action in self.CHAT_ACTIONS and not isinstance(self.screen, ChatScreen):
            return False
        return True

    def can_stop(self) -> bool:
        return self.cancel_event is not None and not self.cancel_event.is_set()

    def set_activity(self, activity: str, cancel: threading.Event | None = None) -> None:
        self.activity = activity
        self.cancel_event = cancel
        if self._status_timer is not None:
            self._status_timer.resume()
        self.refresh_bindings()
        self.refresh_status()

    def end_activity(self, *, trend_sample: bool = True) -> None:
        self.activity = None
        self.cancel_event = None
        self.live = None
        if self._status_timer is not None:
            self._status_timer.pause()
        self.chat.hide_progress()
        self.refresh_bindings()
        self.refresh_status()
        if trend_sample:
            self.add_trend_sample()
        self.refresh_memory()

    # -- worker plumbing ---------------------------------------------------------------
    def from_worker(self, callback: Callable[..., Any], *args: Any) -> Any:
        """Run `callback` on the UI thread and wait for it. While the app is closing
        the UI is skipped: the worker's own work (saving) must still finish."""
        if self._shutting_down:
            return None
        try:
            return self.call_from_thread(callback, *args)
        except Exception as err:  # the app went away, or a UI bug: never kill the worker
            self.ui_errors.append(err)
            self.log.error(f"UI update {getattr(callback, '__name__', callback)} failed: {err!r}")
            return None

    def report_error(self, what: str, err: BaseException) -> None:
        """A notification with the cause and the way out; never a traceback."""
        if isinstance(err, (StoreError, ModelError, DocumentError)):
            message = str(err)  # these messages name the way out already
        elif isinstance(err, SnapshotMismatch):
            message = f"{err}. Rebuild it from the transcript: Ctrl+S, pick the session, confirm Rebuild."
        elif isinstance(err, MemoryError):
            message = "out of memory. Try a smaller --budget or --window, or Ctrl+N for a fresh session."
        else:
            message = (
                f"{type(err).__name__}: {err}. Nothing said so far is lost; "
                "try again, or Ctrl+N for a fresh session."
            )
        self.log.error(f"{what}: {err!r}")
        self.notify(message, title=what, severity="error", timeout=12, markup=False)

    # -- status ------------------------------------------------------------------------
    def activity_label(self) -> str:
        if self.activity is None:
            return "ready"
        live = self.live
        if self.activity == "generating" and live is not None:
            if live.first_token is None and live.prefill_total > PREFILL_CHUNK:
                return f"reading {live.prefill_done:,} / {live.prefill_total:,} tokens"
            return "generating" if live.first_token is not None else "reading the prompt"
        return self.activity

    def current_stats(self) -> dict[str, Any] | None:
        return self.controller.stats()

    def refresh_status(self) -> None:
        if not self.is_screen_installed("chat"):
            return
        stats = self.current_stats()
        if stats is None:
            if self.activity == LOADING:
                note = self.controller.loading.note
                detail = f"{LOADING} ({note})" if note else LOADING
                self.chat.status_bar.show_text(f"{detail} │ {self.controller.method} │ Ctrl+Q quits")
            return
        speeds = self.live.speeds() if self.activity is not None and self.live is not None else self.last_speeds
        self.chat.status_bar.show(StatusReport.from_stats(stats, speeds, self.activity_label()))

    def add_trend_sample(self) -> None:
        stats = self.current_stats()
        if stats is not None:
            self.chat.status_bar.add_trend_sample(int(stats.get("kv_bytes", 0)) / (1 << 20))

    # -- sending -----------------------------------------------------------------------
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        try:
            parsed = chat.parse_input(event.question)
        except CommandError as err:
            self.notify(str(err), severity="warning", markup=False)
            return
        if isinstance(parsed, SlashCommand):
            await self.run_slash_command(parsed)
            return
        if not parsed:
            if event.documents:
                self.notify("Type a question about the document, then press Enter.", severity="warning")
            return
        if self.activity == LOADING and self.pending is not None:
            self.notify("One message already waits for the model; send this one when it is answered.",
                        severity="warning")
            return
        if self.activity != LOADING and not self.ensure_idle():
            return
        await self.send_message(parsed, event.documents)

    def ensure_idle(self) -> bool:
        if self.activity is None:
            return True
        if self.activity == LOADING:
            self.notify("The model is still loading; a message you send now waits for it.", severity="warning")
            return False
        if self.activity == NO_MODEL:
            self.notify("No model is loaded (see the error above); quit with Ctrl+Q and check --model.",
                        severity="error")
            return False
        self.notify(f"The model is busy ({self.activity}); press Esc to stop it, or wait.", severity="warning")
        return False

    async def run_slash_command(self, command: SlashCommand) -> None:
        if command.action == "file":
            await self.attach_file(command.argument)
            return
        self.chat.chat_input.prompt_area.clear()
        if command.action == "method":
            self.switch_method(command.argument)
        else:
            await self.run_action(command.action)

    async def attach_file(self, path_text: str) -> None:
        """`/file PATH`: on any problem the editor keeps what was typed."""
        try:
            text = read_text_file(path_text)
        except DocumentError as err:
            self.notify(str(err), title="Cannot attach the file", severity="error", timeout=10, markup=False)
            return
        if not text.strip():
            self.notify(f"{path_text} is empty; nothing attached.", severity="warning", markup=False)
            return
        chat_input = self.chat.chat_input
        chat_input.prompt_area.clear()
        await chat_input.attach(text, source=path_text)

    def on_chat_input_document_attached(self, event: ChatInput.DocumentAttached) -> None:
        self.count_document_tokens(event.document.number, event.document.text)

    @work(thread=True, group="tokens", exit_on_error=False)
    def count_document_tokens(self, number: int, text: str) -> None:
        for attempt in range(TOKEN_COUNT_TRIES):
            try:
                tokens = self.controller.count_tokens(text)  # waits for the model while it loads
                break
            except RuntimeError:  # fast tokenizers refuse concurrent use ("Already borrowed")
                time.sleep(0.1 * (attempt + 1))
            except Exception:  # no model: the chip simply shows no count
                return
        else:
            return
        self.from_worker(self.chat.chat_input.set_tokens, number, tokens)

    async def send_message(self, question: str, documents: list[AttachedDocument]) -> None:
        await self.chat.chat_input.clear()
        answer = await self.show_question(question, documents)
        if self.activity == LOADING:
            self.pending = PendingTurn(question, documents, answer)  # sent once the model is loaded
            self.notify("The model is loading; your message is sent as soon as it is ready.")
        else:
            self.start_turn(question, documents, answer)

    async def show_question(self, question: str, documents: list[AttachedDocument]) -> AssistantMessage:
        """The question in the list, and the (empty, streaming) answer below it."""
        messages = self.chat.message_list
        await messages.add_user(question, [doc.sent_label for doc in documents])
        answer = await messages.add_assistant(author=f"kvchat · {self.controller.method}")
        answer.start_stream()
        return answer

    def start_turn(self, question: str, documents: list[AttachedDocument], answer: AssistantMessage) -> None:
        cancel = threading.Event()
        self.live = LiveTurn()
        self.set_activity("generating", cancel)
        if documents:
            self.chat.show_progress("Reading the document…")
        self.model_worker = self.run_turn(question, joined_documents(documents), answer, self.live, cancel)

    @work(thread=True, group="model", exit_on_error=False)
    def run_turn(
        self,
        question: str,
        document: str | None,
        answer: AssistantMessage,
        live: LiveTurn,
        cancel: threading.Event,
    ) -> None:
        # Pieces are coalesced so the UI is called at most ~30 times a second: the
        # decode thread waits for each call, and a fast GPU makes 100+ tokens/s.
        pending: list[str] = []
        last_flush = 0.0

        def flush() -> None:
            nonlocal last_flush
            if pending:
                text = "".join(pending)
                pending.clear()
                self.from_worker(answer.append, text)
            last_flush = time.perf_counter()

        def on_token(piece: str) -> None:
            live.on_piece()
            pending.append(piece)
            if time.perf_counter() - last_flush >= STREAM_FLUSH_S:
                flush()

        def on_progress(done: int, total: int) -> None:
            live.on_progress(done, total)
            if total > PREFILL_CHUNK:
                self.from_worker(self.show_reading_progress, done, total)

        # The turn is saved here, in the worker, before the UI hears of it: quitting
        # waits for this worker, so whatever was said is on disk before the app exits.
        try:
            outcome = self.controller.send(
                question, document, on_token=on_token, on_progress=on_progress, cancel=cancel
            )
        except Exception as err:
            flush()
            self.from_worker(self.turn_failed, answer, err)
            return
        flush()
        self.from_worker(self.turn_finished, answer, outcome)

    def show_reading_progress(self, done: int, total: int) -> None:
        if done >= total:
            self.chat.hide_progress()
        else:
            self.chat.show_progress(f"Reading {done:,} / {total:,} tokens", done, total)

    async def turn_finished(self, answer: AssistantMessage, outcome: TurnOutcome) -> None:
        result, save_error = outcome.result, outcome.save_error
        if result.stop_reason == "cancelled":
            note = "stopped — the partial answer is kept" if result.text else "stopped before the answer began"
        elif result.stop_reason == "length":
            note = f"cut at {self.sampling.max_new_tokens} new tokens (--max-new-tokens)"
        else:
            note = ""
        await answer.finish(note, stopped=result.cancelled)
        self.last_result = result
        self.last_speeds = Speeds.from_metrics(result.metrics)
        self.end_activity()
        self.update_title()
        if save_error is not None:
            self.report_error("This turn was not saved", save_error)

    async def turn_failed(self, answer: AssistantMessage, err: Exception) -> None:
        await answer.finish("no answer: generation failed", stopped=True)
        self.end_activity()
        self.report_error("Generation failed", err)

    # -- stop and quit -----------------------------------------------------------------
    def action_stop(self) -> None:
        if self.cancel_event is not None and not self.cancel_event.is_set():
            self.cancel_event.set()
            self.activity = "stopping"
            self.refresh_bindings()
            self.refresh_status()

    async def action_interrupt(self) -> None:
        if self.activity == LOADING:
            await self.action_quit()
        else:
            self.action_stop()

    async def action_quit(self) -> None:
        """Stop the model, let its worker save what was said, then exit."""
        worker = self.model_worker
        if worker is not None and worker.is_running:
            self.action_stop()
            self.notify("Stopping the model and saving…", timeout=30)
            self._shutting_down = True
            try:
                await worker.wait()
            except WorkerFailed:
                pass
        self._shutting_down = True
        self.exit()

    def on_unmount(self) -> None:
        # However the app ends, a running turn must end soon so its thread can finish.
        self._shutting_down = True
        if self.cancel_event is not None:
            self.cancel_event.set()

    # -- method switch and rebuild -----------------------------------------------------
    def current_method(self) -> str:
        return self.controller.method

    def action_cycle_method(self) -> None:
        if self.ensure_idle():
            self.switch_method(self.controller.next_method())

    def action_pick_method(self) -> None:
        def picked(name: str | None) -> None:
            if name:
                self.switch_method(name)

        self.push_screen(MethodPicker(chat.methods(), self.current_method()), picked)

    def switch_method(self, method: str) -> None:
        if not self.ensure_idle():
            return
        if method == self.current_method():
            self.notify(f"Already using {method}.")
            return
        self.set_activity(f"switching to {method}")
        self.model_worker = self.run_switch(method)

    @work(thread=True, group="model", exit_on_error=False)
    def run_switch(self, method: str) -> None:
        try:
            outcome = self.controller.switch_method(method)
        except Exception as err:
            self.from_worker(self.model_work_failed, f"Could not switch to {method}", err)
            return
        self.from_worker(self.switch_finished, outcome)

    def switch_finished(self, outcome: chat.SwitchOutcome) -> None:
        self.end_activity()
        before, after = megabytes(outcome.kv_bytes_before), megabytes(outcome.kv_bytes_after)
        self.notify(f"Now {outcome.method}: KV {before} → {after} (switched in {outcome.seconds:.2f} s)",
                    title="Method switched", markup=False)
        if outcome.save_error is not None:
            self.report_error("The switch was not saved", outcome.save_error)

    def model_work_failed(self, what: str, err: Exception) -> None:
        self.end_activity()
        self.report_error(what, err)

    def action_rebuild(self) -> None:
        if not self.ensure_idle():
            return
        conversation = self.conversation
        if conversation is None or not conversation.session.token_ids:
            self.notify("Nothing to rebuild yet: the conversation is empty.")
            return
        cancel = threading.Event()
        self.set_activity(f"rebuilding through {self.current_method()}", cancel)
        self.chat.show_progress("Rebuilding…")
        self.model_worker = self.run_rebuild(cancel)

    @work(thread=True, group="model", exit_on_error=False)
    def run_rebuild(self, cancel: threading.Event) -> None:
        method = self.controller.method

        def on_progress(done: int, total: int) -> None:
            label = f"Rebuilding through {method}: {done:,} / {total:,} tokens"
            self.from_worker(self.chat.show_progress, label, done, total)

        try:
            outcome = self.controller.rebuild(on_progress, cancel)
        except Cancelled:
            self.from_worker(self.rebuild_finished, None)
            return
        except Exception as err:
            self.from_worker(self.model_work_failed, "Rebuild failed (the previous cache is kept)", err)
            return
        self.from_worker(self.rebuild_finished, outcome)

    def rebuild_finished(self, outcome: chat.RebuildOutcome | None) -> None:
        self.end_activity()
        if outcome is None:
            self.notify("Rebuild stopped; the previous cache is kept.", severity="warning")
            return
        self.notify(f"Rebuilt {outcome.tokens:,} tokens through {self.current_method()} in {outcome.seconds:.1f} s",
                    title="Rebuilt")
        if outcome.save_error is not None:
            self.report_error("The rebuilt cache was not saved", outcome.save_error)

    # -- one question under several methods ----------------------------------------------
    def action_compare(self) -> None:
        if not self.ensure_idle():
            return
        if not self.controller.can_compare():
            self.notify("Nothing to compare yet: ask a question first. Compare asks the last question again "
                        "under the methods you pick.", severity="warning")
            return
        picker = CompareMethodsPicker(chat.methods(), self.controller.default_compare_methods(), self.current_method())
        self.push_screen(picker, lambda methods: self.call_later(self.start_compare, methods))

    async def start_compare(self, methods: list[str] | None) -> None:
        conversation = self.conversation
        if not methods or conversation is None or conversation.last_question is None or not self.ensure_idle():
            return
        screen = CompareScreen(conversation.last_question.question, methods, self.current_method())
        cancel = threading.Event()
        self.set_activity("comparing methods", cancel)
        await self.push_screen(screen, lambda method: self.call_later(self.compare_chosen, method))
        self.model_worker = self.run_compare(screen, methods, cancel)

    @work(thread=True, group="model", exit_on_error=False)
    def run_compare(self, screen: CompareScreen, methods: list[str], cancel: threading.Event) -> None:
        # As in run_turn, pieces are coalesced: the UI is called at most ~30 times a second.
        pending: dict[str, list[str]] = {}
        last_flush = 0.0

        def flush() -> None:
            nonlocal last_flush
            for method, pieces in pending.items():
                if pieces:
                    text = "".join(pieces)
                    pieces.clear()
                    self.from_worker(screen.append, method, text)
            last_flush = time.perf_counter()

        def on_token(method: str, piece: str) -> None:
            pending.setdefault(method, []).append(piece)
            if time.perf_counter() - last_flush >= STREAM_FLUSH_S:
                flush()

        def on_start(method: str) -> None:
            flush()
            self.from_worker(screen.method_started, method)

        def on_progress(done: int, total: int) -> None:
            if total > PREFILL_CHUNK:
                self.from_worker(screen.show_status, f"reading {done:,} / {total:,} tokens…")

        def on_answer(answer: MethodAnswer) -> None:
            flush()
            figures = AnswerFigures(answer.kv_bytes, answer.ttft_s, answer.decode_tokens_per_s,
                                    stopped=answer.stop_reason == "cancelled")
            self.from_worker(screen.method_finished, answer.method, figures)

        try:
            comparison = self.controller.compare(
                methods, on_token=on_token, on_progress=on_progress, on_start=on_start, on_answer=on_answer,
                cancel=cancel,
            )
        except Exception as err:
            flush()
            self.from_worker(self.compare_failed, screen, err)
            return
        flush()
        self.from_worker(self.compare_finished, screen, comparison_summary(comparison), comparison.cancelled)

    async def compare_finished(self, screen: CompareScreen, summary: str, stopped: bool) -> None:
        await screen.finished(summary, stopped)
        self.end_activity(trend_sample=False)

    def compare_failed(self, screen: CompareScreen, err: Exception) -> None:
        self.end_activity(trend_sample=False)
        if self.screen is screen:
            screen.dismiss(None)
        if isinstance(err, InputTooLong):
            self.notify(f"{err.message('prompt', 'a shorter question')} (or leave that method out)",
                        title="Cannot compare", severity="error", timeout=12, markup=False)
        else:
            self.report_error("Compare failed", err)

    async def compare_chosen(self, method: str | None) -> None:
        if method is None:
            self.controller.drop_comparison()  # the forks' caches are let go
            return
        previous = self.conversation.session_id if self.conversation else None
        conversation = self.controller.continue_with(method)  # no model call: the fork exists already
        self.last_speeds = Speeds()
        await self.show_transcript(conversation.session.messages)
        kept = f"session {previous} stays saved as it was; " if previous is not None else ""
        await self.chat.message_list.add_notice(
            f"Continuing with {method}'s answer: {kept}this is a new session, saved with its next turn.")
        self.update_title()
        self.refresh_status()
        self.add_trend_sample()

    def on_compare_screen_stop_requested(self, event: CompareScreen.StopRequested) -> None:
        self.action_stop()

    # -- sessions ----------------------------------------------------------------------
    def action_new_session(self) -> None:
        if not self.ensure_idle():
            return
        self.call_later(self.start_new_session)
        self.notify("New session; the previous one stays saved (Ctrl+S).")

    async def start_new_session(self) -> None:
        self.controller.new_session()  # no model call: an empty cache under the current settings
        await self.show_new_session()

    async def show_new_session(self) -> None:
        self.last_speeds = Speeds()
        await self.chat.message_list.clear()
        self.update_title()
        self.refresh_status()
        self.add_trend_sample()

    def action_sessions(self) -> None:
        if not self.has_store:
            self.notify("Sessions are not saved in this run (no database).", severity="warning")
            return
        self.list_sessions(open_screen=True)

    @work(thread=True, group="store", exit_on_error=False)
    def list_sessions(self, open_screen: bool = False) -> None:
        """Read the list in a worker; open the sessions screen, or refresh the one shown."""
        try:
            rows = self.controller.list_sessions()
        except StoreError as err:
            self.from_worker(self.report_error, "Could not list the sessions", err)
            return
        self.from_worker(self.show_sessions, rows, open_screen)

    def show_sessions(self, rows: list[SessionRow], open_screen: bool) -> None:
        current = self.conversation.session_id if self.conversation else None
        if open_screen:
            self.push_screen(SessionsScreen(rows, current), self.session_chosen)
        elif isinstance(self.screen, SessionsScreen):
            self.screen.show_rows(rows, current)

    def session_chosen(self, choice: SessionChoice | None) -> None:
        if choice is None:
            return
        if choice.action == "new":
            self.action_new_session()
        elif choice.session_id is not None:
            if self.conversation is not None and choice.session_id == self.conversation.session_id:
                self.notify(f"Session {choice.session_id} is already open.")
            else:
                self.resume_session(choice.session_id)

    def on_sessions_screen_rename_requested(self, event: SessionsScreen.RenameRequested) -> None:
        self.rename_session(event.session_id, event.title)

    @work(thread=True, group="store", exit_on_error=False)
    def rename_session(self, session_id: int, title: str) -> None:
        try:
            self.controller.rename_session(session_id, title)
        except StoreError as err:
            self.from_worker(self.report_error, "Could not rename the session", err)
            return
        self.from_worker(self.update_title)
        self.list_sessions()

    def on_sessions_screen_delete_requested(self, event: SessionsScreen.DeleteRequested) -> None:
        is_open = self.conversation is not None and event.session_id == self.conversation.session_id
        if is_open and not self.ensure_idle():
            return
        self.delete_session(event.session_id)

    @work(thread=True, group="store", exit_on_error=False)
    def delete_session(self, session_id: int) -> None:
        try:
            was_open = self.controller.delete_session(session_id)
        except StoreError as err:
            self.from_worker(self.report_error, "Could not delete the session", err)
            return
        self.from_worker(self.session_deleted, session_id, was_open)
        self.list_sessions()

    async def session_deleted(self, session_id: int, was_open: bool) -> None:
        self.notify(f"Session {session_id} deleted.")
        if was_open:
            await self.show_new_session()

    def resume_session(self, session_id: int) -> None:
        if not self.ensure_idle():
            return
        self.set_activity(f"restoring session {session_id}")
        self.model_worker = self.run_resume(session_id)

    @work(thread=True, group="model", exit_on_error=False)
    def run_resume(self, session_id: int) -> None:
        try:
            outcome = self.controller.resume(session_id)
        except SnapshotMismatch as err:
            self.from_worker(self.resume_refused, session_id, str(err))
            return
        except Exception as err:
            self.from_worker(self.model_work_failed, f"Could not open session {session_id}", err)
            return
        self.from_worker(self.resume_finished, outcome)

    async def resume_finished(self, outcome: ResumeOutcome) -> None:
        await self.show_resumed(outcome)
        self.end_activity()

    async def show_resumed(self, outcome: ResumeOutcome) -> None:
        self.last_speeds = Speeds()
        await self.show_transcript(outcome.messages)
        self.update_title()
        self.refresh_status()
        described = outcome.info.describe() if outcome.info else "opened"
        await self.chat.message_list.add_notice(f"Session {outcome.session_id}: {described}")
        self.notify(described.capitalize(), title=f"Session {outcome.session_id}", markup=False)

    async def show_transcript(self, messages: list[dict[str, str]]) -> None:
        message_list = self.chat.message_list
        await message_list.clear()
        for message in messages:
            if message["role"] == "user":
                question, document_chars = split_long_user_text(message["content"])
                labels = [f"Document · {document_chars:,} characters"] if document_chars else []
                await message_list.add_user(question, labels)
            elif message["role"] == "assistant":
                await message_list.add_assistant(message["content"])
        message_list.scroll_end(animate=False)

    def resume_refused(self, session_id: int, reason: str) -> None:
        self.end_activity()
        self.notify(f"Session {session_id} was not restored: {reason}.", title="Cannot restore", severity="warning",
                    timeout=12, markup=False)
        question = (
            f"Session {session_id} cannot be restored from its saved cache: {reason}.\n\n"
            "Rebuild it from the transcript? Every message is read again through the method "
            "(progress shown, Esc stops); the transcript itself is safe either way."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.rebuild_saved_session(session_id, reason)

        self.push_screen(ConfirmDialog(question, "Rebuild", "Not now"), answered)

    def rebuild_saved_session(self, session_id: int, reason: str) -> None:
        if not self.ensure_idle():
            return
        cancel = threading.Event()
        self.set_activity(f"rebuilding session {session_id}", cancel)
        self.chat.show_progress(f"Rebuilding session {session_id}…")
        self.model_worker = self.run_rebuild_saved(session_id, reason, cancel)

    @work(thread=True, group="model", exit_on_error=False)
    def run_rebuild_saved(self, session_id: int, reason: str, cancel: threading.Event) -> None:
        def on_progress(done: int, total: int) -> None:
            label = f"Rebuilding session {session_id}: {done:,} / {total:,} tokens"
            self.from_worker(self.chat.show_progress, label, done, total)

        try:
            outcome = self.controller.rebuild_saved(session_id, reason, on_progress, cancel)
        except Cancelled:
            self.from_worker(self.rebuild_saved_stopped, session_id)
            return
        except Exception as err:
            self.from_worker(self.model_work_failed, f"Could not rebuild session {session_id}", err)
            return
        self.from_worker(self.resume_finished, outcome)

    def rebuild_saved_stopped(self, session_id: int) -> None:
        self.end_activity()
        self.notify(f"Rebuild stopped; session {session_id} stays as it was saved.", severity="warning")

    # -- help and palette --------------------------------------------------------------
    # -- the memory map ----------------------------------------------------------------
    def action_memory(self) -> None:
        self.push_screen(MemoryScreen())
        self.refresh_memory()

    def memory_screen(self) -> MemoryScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, MemoryScreen)), None)

    def refresh_memory(self) -> None:
        """New numbers for the memory map, when it is open (read in a worker)."""
        if self.memory_screen() is not None and not self._shutting_down:
            self.read_memory()

    @work(thread=True, group="memory", exclusive=True, exit_on_error=False)
    def read_memory(self) -> None:
        try:
            report = self.controller.memory_report()
        except Exception as err:
            self.from_worker(self.report_error, "Could not read the memory map", err)
            return
        self.from_worker(self.show_memory, report)

    def show_memory(self, report: dict[str, Any] | None) -> None:
        screen = self.memory_screen()
        if screen is not None:
            screen.show(report)

    def action_help(self) -> None:
        sections = [
            ("Chat", self.BINDINGS),
            ("Editor", PromptArea.BINDINGS),
            ("Sessions list (Ctrl+S)", SessionsScreen.BINDINGS),
            ("Compare view (Ctrl+G)", CompareScreen.BINDINGS),
        ]
        self.push_screen(HelpScreen(sections, EDITOR_NOTES))

    def palette_commands(self) -> Iterator[PaletteCommand]:
        seen: set[str] = set()
        for binding in self.BINDINGS:
            if binding.action in seen or binding.action in ("command_palette", "interrupt"):
                continue
            seen.add(binding.action)
            yield PaletteCommand(binding.description, binding.tooltip, run_action_later(self, binding.action))
        yield PaletteCommand("Attach a file", "type /file PATH in the editor", self.start_file_command)
        for name, description in chat.methods():
            yield PaletteCommand(f"Method: {name}", description, partial(self.switch_method, name))

    def start_file_command(self) -> None:
        prompt = self.chat.chat_input.prompt_area
        prompt.text = "/file "
        prompt.move_cursor(prompt.document.end)
        prompt.focus()


def comparison_summary(comparison: Comparison) -> str:
    """One line on how the answers were made (what their TTFT counts)."""
    if comparison.prefill_mode == SHARED:
        return (f"one exact prefill of {comparison.prompt_tokens:,} tokens ({comparison.prefill_s:.2f} s), forked to "
                "each method · TTFT = prefill + that method's compression of it + its first token")
    return comparison.note


def run_app(
    engine: Any | EngineLoader,
    store: Store | None,
    settings: CacheSettings,
    sampling: SamplingSettings,
    resume_id: int | None,
) -> None:
    """Run the chat app until the user quits (the CLI's default command). `engine`
    may be a loader: the app then draws at once and loads the model in a worker."""
    KvchatApp(engine, store, settings, sampling, resume_id).run()
