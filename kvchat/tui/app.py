"""KvchatApp: the Textual chat app, and `run_app`, which the CLI calls.

Threading. Everything that runs the model (a turn, a method switch, a rebuild, a
resume) runs in one Textual thread worker at a time (group "model"), so the screen
never freezes and keys echo while the model works. Workers report back with
`call_from_thread`; the status bar is refreshed by a timer, never once per token.

The store's SQLite connection belongs to the thread that opened it, so a worker
opens its own connection to the same file for the saves and loads it does (WAL
mode makes that safe; see `worker_store`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.timer import Timer
from textual.worker import Worker, WorkerFailed

from .. import compress, persist
from ..engine import PREFILL_CHUNK, CacheSettings, Cancelled, SamplingSettings, TurnResult
from ..models import ModelError
from ..persist import ResumeInfo, SnapshotMismatch
from ..store import Store, StoreError
from .commands import KvchatCommands, PaletteCommand, run_action_later
from .documents import AttachedDocument, DocumentError, joined_documents, read_text_file, split_long_user_text
from .screens import ChatScreen, ConfirmDialog, HelpScreen, MethodPicker, SessionsScreen
from .screens.sessions import SessionChoice
from .status import LiveTurn, Speeds, StatusReport, megabytes
from .widgets import AssistantMessage, ChatInput, PromptArea

# The status bar is refreshed this often while the model works (and once after).
STATUS_INTERVAL_S = 0.25
# The answer is handed to the UI at most this often (pieces in between are joined).
STREAM_FLUSH_S = 1 / 30
# How often the token counter retries when the tokenizer is busy in another thread.
TOKEN_COUNT_TRIES = 5

EDITOR_NOTES = [
    "Editor: Enter sends, Ctrl+J (or Alt+Enter) inserts a newline; the editor keeps its own keys:",
    "  ctrl+a/e line start/end · ctrl+w/u/k delete word/to start/to end · ctrl+z/y undo/redo",
    "  ctrl+x/c/v cut/copy/paste.",
    "Documents: a long paste becomes a chip (“Document 1 · 12,345 tokens”) put before your question;",
    "  /file PATH attaches a text file; Backspace in an empty editor removes the last chip.",
    "Commands typed in the editor: /file PATH · /method NAME · /new · /sessions · /rebuild · /help.",
]


@dataclass
class Conversation:
    """The open chat: the engine session plus where it is saved (None until its first turn)."""

    session: Any  # kvchat.engine.ChatSession (or an object with the same methods)
    session_id: int | None = None
    title: str = ""


class KvchatApp(App[None]):
    # Absolute, so that subclasses defined elsewhere (tests) still find it.
    CSS_PATH = Path(__file__).with_name("styles.tcss")
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {KvchatCommands}

    # The help screen and the command palette are built from this list.
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="stop generating (the partial answer is kept) or stop a rebuild"),
        Binding("ctrl+c", "stop", "Stop", show=False, priority=True,
                tooltip="same as Esc while the model works; otherwise copies in the editor"),
        Binding("ctrl+t", "cycle_method", "Next method", tooltip="cycle the compression method; takes effect at once"),
        Binding("ctrl+o", "pick_method", "Methods", tooltip="choose the method from a list with descriptions"),
        Binding("ctrl+r", "rebuild", "Rebuild", show=False,
                tooltip="re-read the whole transcript through the current method (faithful state; Esc stops)"),
        Binding("ctrl+s", "sessions", "Sessions", tooltip="list, resume, rename or delete saved sessions"),
        Binding("ctrl+n", "new_session", "New", tooltip="start a new session (the current one stays saved)"),
        Binding("f1", "help", "Help", tooltip="this screen"),
        Binding("ctrl+p", "command_palette", "Palette", show=False, tooltip="search every action"),
        Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="stop the model, save, and quit"),
    ]
    # Actions that only make sense on the chat screen (not under a modal screen).
    CHAT_ACTIONS = {"cycle_method", "pick_method", "rebuild", "sessions", "new_session", "help"}

    def __init__(
        self,
        engine: Any,
        store: Store | None,
        settings: CacheSettings,
        sampling: SamplingSettings,
        resume_id: int | None = None,
        *,
        reopen_last: bool = True,
    ) -> None:
        """`engine`: a kvchat Engine (snapshot tests pass a fake with the same methods).
        `store` None: nothing is saved or listed. `reopen_last`: open the most recent
        session when `resume_id` is None."""
        super().__init__()
        self.engine = engine
        self.store = store
        self.settings = replace(settings, params=dict(settings.params))
        self.sampling = sampling
        self.resume_id = resume_id
        self.reopen_last = reopen_last
        # CLI hyperparameters belong to the method they were given for.
        self.method_params: dict[str, dict[str, Any]] = {settings.method: dict(settings.params)}
        self.conversation = Conversation(engine.new_session(self.settings_for_new_session()))
        self.activity: str | None = None  # what the model worker is doing; None when idle
        self.cancel_event: threading.Event | None = None
        self.live: LiveTurn | None = None
        self.last_speeds = Speeds()
        self.last_result: TurnResult | None = None
        self.model_worker: Worker[None] | None = None
        self.ui_errors: list[BaseException] = []  # UI callbacks that failed (tests assert none)
        self._shutting_down = False
        self._status_timer: Timer | None = None

    # -- start -------------------------------------------------------------------------
    @property
    def chat(self) -> ChatScreen:
        return self.get_screen("chat")  # type: ignore[return-value]

    @property
    def model_name(self) -> str:
        return str(getattr(getattr(self.engine, "loaded", None), "name", "model"))

    async def on_mount(self) -> None:
        self.install_screen(ChatScreen(), "chat")
        await self.push_screen("chat")
        self._status_timer = self.set_interval(STATUS_INTERVAL_S, self.refresh_status, pause=True)
        self.update_title()
        self.refresh_status()
        target = self.resume_id
        if target is None and self.reopen_last and self.store is not None:
            try:
                target = self.store.last_session_id()
            except StoreError as err:
                self.report_error("Could not read the saved sessions", err)
        if target is not None:
            self.resume_session(target)

    def update_title(self) -> None:
        conv = self.conversation
        where = f"session {conv.session_id} · {conv.title}" if conv.session_id is not None else "new session"
        self.sub_title = f"{self.model_name} · {where}"

    # -- bindings ----------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            if not isinstance(self.screen, ChatScreen):
                return False  # under a dialog, Esc closes the dialog
            # None: shown dimmed, and the key falls through (ctrl+c then copies).
            return True if self.can_stop() else None
        if action in self.CHAT_ACTIONS and not isinstance(self.screen, ChatScreen):
            return False
        return True

    def can_stop(self) -> bool:
        return self.cancel_event is not None and not self.cancel_event.is_set()

    def ensure_idle(self) -> bool:
        if self.activity is None:
            return True
        self.notify(f"The model is busy ({self.activity}); press Esc to stop it, or wait.", severity="warning")
        return False

    def set_activity(self, activity: str, cancel: threading.Event | None = None) -> None:
        self.activity = activity
        self.cancel_event = cancel
        if self._status_timer is not None:
            self._status_timer.resume()
        self.refresh_bindings()
        self.refresh_status()

    def end_activity(self) -> None:
        self.activity = None
        self.cancel_event = None
        self.live = None
        if self._status_timer is not None:
            self._status_timer.pause()
        self.chat.hide_progress()
        self.refresh_bindings()
        self.refresh_status()
        self.add_trend_sample()

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

    @contextmanager
    def worker_store(self) -> Iterator[Store | None]:
        """A store connection usable in the calling (worker) thread."""
        if self.store is None:
            yield None
            return
        store = Store(self.store.path, timeout_s=self.store.timeout_s)
        try:
            yield store
        finally:
            store.close()

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
        try:
            return self.conversation.session.stats()
        except Exception:  # the worker is changing the cache right now; next tick will do
            return None

    def refresh_status(self) -> None:
        if not self.is_screen_installed("chat"):
            return
        stats = self.current_stats()
        if stats is None:
            return
        speeds = self.live.speeds() if self.activity is not None and self.live is not None else self.last_speeds
        self.chat.status_bar.show(StatusReport.from_stats(stats, speeds, self.activity_label()))

    def add_trend_sample(self) -> None:
        stats = self.current_stats()
        if stats is not None:
            self.chat.status_bar.add_trend_sample(int(stats.get("kv_bytes", 0)) / (1 << 20))

    # -- sending -----------------------------------------------------------------------
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        question = event.question.strip()
        if question.startswith("/") and not question.startswith("//"):
            await self.run_slash_command(question)
            return
        if question.startswith("//"):
            question = question[1:]  # "//x" sends "/x" literally
        if not question:
            if event.documents:
                self.notify("Type a question about the document, then press Enter.", severity="warning")
            return
        if not self.ensure_idle():
            return
        await self.send_message(question, event.documents)

    async def run_slash_command(self, line: str) -> None:
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        if name == "/file":
            await self.attach_file(argument)
        elif name == "/method":
            if argument in compress.available():
                self.chat.chat_input.prompt_area.clear()
                self.switch_method(argument)
            else:
                self.notify(f"Unknown method {argument!r}; choose one of: {', '.join(compress.available())}",
                            severity="error", markup=False)
        elif name in ("/new", "/sessions", "/rebuild", "/help"):
            self.chat.chat_input.prompt_area.clear()
            action = {"/new": "new_session", "/sessions": "sessions", "/rebuild": "rebuild", "/help": "help"}[name]
            await self.run_action(action)
        else:
            self.notify(
                f"Unknown command {name}; try /file PATH, /method NAME, /new, /sessions, /rebuild, /help "
                "(start with // to send a message beginning with /).",
                severity="warning",
                markup=False,
            )

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
                tokens = self.engine.count_tokens(text)
                break
            except RuntimeError:  # fast tokenizers refuse concurrent use ("Already borrowed")
                time.sleep(0.1 * (attempt + 1))
        else:
            return
        self.from_worker(self.chat.chat_input.set_tokens, number, tokens)

    async def send_message(self, question: str, documents: list[AttachedDocument]) -> None:
        conversation = self.conversation
        session = conversation.session
        user_text = session.user_message(question, joined_documents(documents))
        labels = [doc.sent_label for doc in documents]
        await self.chat.chat_input.clear()
        messages = self.chat.message_list
        await messages.add_user(question, labels)
        answer = await messages.add_assistant(author=f"kvchat · {session.settings.method}")
        answer.start_stream()
        cancel = threading.Event()
        self.live = LiveTurn()
        self.set_activity("generating", cancel)
        if documents:
            self.chat.show_progress("Reading the document…")
        self.model_worker = self.run_turn(conversation, question, user_text, answer, self.live, cancel)

    @work(thread=True, group="model", exit_on_error=False)
    def run_turn(
        self,
        conversation: Conversation,
        question: str,
        user_text: str,
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

        try:
            result = conversation.session.send(
                user_text, self.sampling, on_token=on_token, on_progress=on_progress, cancel=cancel
            )
        except Exception as err:
            flush()
            self.from_worker(self.turn_failed, answer, err)
            return
        flush()
        # Saved here, in the worker, before the UI hears of it: quitting waits for
        # this worker, so whatever was said is on disk before the app exits.
        save_error = self.save_turn(conversation, question, user_text, result)
        self.from_worker(self.turn_finished, answer, result, save_error)

    def save_turn(
        self, conversation: Conversation, question: str, user_text: str, result: TurnResult
    ) -> Exception | None:
        try:
            with self.worker_store() as store:
                if store is None:
                    return None
                if conversation.session_id is None:
                    conversation.title = persist.title_for(question)
                    conversation.session_id = persist.new_session_row(store, conversation.session, conversation.title)
                persist.save_turn(store, conversation.session_id, conversation.session, user_text, result)
        except Exception as err:
            return err
        return None

    def show_reading_progress(self, done: int, total: int) -> None:
        if done >= total:
            self.chat.hide_progress()
        else:
            self.chat.show_progress(f"Reading {done:,} / {total:,} tokens", done, total)

    async def turn_finished(
        self, answer: AssistantMessage, result: TurnResult, save_error: Exception | None
    ) -> None:
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
        return str(self.conversation.session.settings.method)

    def action_cycle_method(self) -> None:
        methods = compress.available()
        current = self.current_method()
        following = methods[(methods.index(current) + 1) % len(methods)] if current in methods else methods[0]
        self.switch_method(following)

    def action_pick_method(self) -> None:
        methods = [(name, compress.get(name).description) for name in compress.available()]

        def picked(name: str | None) -> None:
            if name:
                self.switch_method(name)

        self.push_screen(MethodPicker(methods, self.current_method()), picked)

    def switch_method(self, method: str) -> None:
        if not self.ensure_idle():
            return
        if method == self.current_method():
            self.notify(f"Already using {method}.")
            return
        params = dict(self.method_params.get(method, {}))
        self.set_activity(f"switching to {method}")
        self.model_worker = self.run_switch(self.conversation, method, params)

    @work(thread=True, group="model", exit_on_error=False)
    def run_switch(self, conversation: Conversation, method: str, params: dict[str, Any]) -> None:
        session = conversation.session
        before = int(session.stats()["kv_bytes"])
        start = time.perf_counter()
        try:
            session.switch_method(method, params)
        except Exception as err:
            self.from_worker(self.model_work_failed, f"Could not switch to {method}", err)
            return
        seconds = time.perf_counter() - start
        after = int(session.stats()["kv_bytes"])
        save_error = self.save_snapshot(conversation)
        self.from_worker(self.switch_finished, method, params, before, after, seconds, save_error)

    def save_snapshot(self, conversation: Conversation) -> Exception | None:
        if conversation.session_id is None:
            return None
        try:
            with self.worker_store() as store:
                if store is not None:
                    persist.save_snapshot(store, conversation.session_id, conversation.session)
        except Exception as err:
            return err
        return None

    def switch_finished(
        self, method: str, params: dict[str, Any], before: int, after: int, seconds: float, save_error: Exception | None
    ) -> None:
        self.settings = replace(self.settings, method=method, params=dict(params))
        self.end_activity()
        self.notify(f"Now {method}: KV {megabytes(before)} → {megabytes(after)} (switched in {seconds:.2f} s)",
                    title="Method switched", markup=False)
        if save_error is not None:
            self.report_error("The switch was not saved", save_error)

    def model_work_failed(self, what: str, err: Exception) -> None:
        self.end_activity()
        self.report_error(what, err)

    def action_rebuild(self) -> None:
        if not self.ensure_idle():
            return
        if not self.conversation.session.token_ids:
            self.notify("Nothing to rebuild yet: the conversation is empty.")
            return
        cancel = threading.Event()
        self.set_activity(f"rebuilding through {self.current_method()}", cancel)
        self.chat.show_progress("Rebuilding…")
        self.model_worker = self.run_rebuild(self.conversation, cancel)

    @work(thread=True, group="model", exit_on_error=False)
    def run_rebuild(self, conversation: Conversation, cancel: threading.Event) -> None:
        session = conversation.session
        method = session.settings.method

        def on_progress(done: int, total: int) -> None:
            label = f"Rebuilding through {method}: {done:,} / {total:,} tokens"
            self.from_worker(self.chat.show_progress, label, done, total)

        start = time.perf_counter()
        try:
            session.rebuild(on_progress, cancel)
        except Cancelled:
            self.from_worker(self.rebuild_finished, None, None)
            return
        except Exception as err:
            self.from_worker(self.model_work_failed, "Rebuild failed (the previous cache is kept)", err)
            return
        save_error = self.save_snapshot(conversation)
        self.from_worker(self.rebuild_finished, time.perf_counter() - start, save_error)

    def rebuild_finished(self, seconds: float | None, save_error: Exception | None) -> None:
        self.end_activity()
        if seconds is None:
            self.notify("Rebuild stopped; the previous cache is kept.", severity="warning")
        else:
            tokens = len(self.conversation.session.token_ids)
            self.notify(f"Rebuilt {tokens:,} tokens through {self.current_method()} in {seconds:.1f} s", title="Rebuilt")
        if save_error is not None:
            self.report_error("The rebuilt cache was not saved", save_error)

    # -- sessions ----------------------------------------------------------------------
    def action_new_session(self) -> None:
        if not self.ensure_idle():
            return
        self.call_later(self.start_new_session)
        self.notify("New session; the previous one stays saved (Ctrl+S).")

    def settings_for_new_session(self) -> CacheSettings:
        """A copy: a session changes its own settings when its method is switched."""
        return replace(self.settings, params=dict(self.settings.params))

    async def start_new_session(self) -> None:
        self.conversation = Conversation(self.engine.new_session(self.settings_for_new_session()))
        self.last_speeds = Speeds()
        await self.chat.message_list.clear()
        self.update_title()
        self.refresh_status()
        self.add_trend_sample()

    def list_sessions(self) -> list[Any] | None:
        if self.store is None:
            return None
        try:
            return self.store.list_sessions()
        except StoreError as err:
            self.report_error("Could not list the sessions", err)
            return None

    def action_sessions(self) -> None:
        if self.store is None:
            self.notify("Sessions are not saved in this run (no database).", severity="warning")
            return
        rows = self.list_sessions()
        if rows is not None:
            self.push_screen(SessionsScreen(rows, self.conversation.session_id), self.session_chosen)

    def session_chosen(self, choice: SessionChoice | None) -> None:
        if choice is None:
            return
        if choice.action == "new":
            self.action_new_session()
        elif choice.session_id is not None:
            if choice.session_id == self.conversation.session_id:
                self.notify(f"Session {choice.session_id} is already open.")
            else:
                self.resume_session(choice.session_id)

    def refresh_sessions_screen(self) -> None:
        rows = self.list_sessions()
        if rows is not None and isinstance(self.screen, SessionsScreen):
            self.screen.show_rows(rows, self.conversation.session_id)

    def on_sessions_screen_rename_requested(self, event: SessionsScreen.RenameRequested) -> None:
        assert self.store is not None
        try:
            self.store.update_session(event.session_id, title=event.title)
        except StoreError as err:
            self.report_error("Could not rename the session", err)
            return
        if event.session_id == self.conversation.session_id:
            self.conversation.title = event.title
            self.update_title()
        self.refresh_sessions_screen()

    async def on_sessions_screen_delete_requested(self, event: SessionsScreen.DeleteRequested) -> None:
        assert self.store is not None
        if event.session_id == self.conversation.session_id and not self.ensure_idle():
            return
        try:
            self.store.delete_session(event.session_id)
        except StoreError as err:
            self.report_error("Could not delete the session", err)
            return
        self.notify(f"Session {event.session_id} deleted.")
        if event.session_id == self.conversation.session_id:
            await self.start_new_session()
        self.refresh_sessions_screen()

    def resume_session(self, session_id: int) -> None:
        if not self.ensure_idle():
            return
        self.set_activity(f"restoring session {session_id}")
        self.model_worker = self.run_resume(session_id)

    @work(thread=True, group="model", exit_on_error=False)
    def run_resume(self, session_id: int) -> None:
        try:
            with self.worker_store() as store:
                assert store is not None
                title = store.get_session(session_id).title
                session, info = persist.resume(store, self.engine, session_id)
        except SnapshotMismatch as err:
            self.from_worker(self.resume_refused, session_id, str(err))
            return
        except Exception as err:
            self.from_worker(self.model_work_failed, f"Could not open session {session_id}", err)
            return
        self.from_worker(self.resume_finished, Conversation(session, session_id, title), info)

    async def resume_finished(self, conversation: Conversation, info: ResumeInfo) -> None:
        self.conversation = conversation
        settings = conversation.session.settings
        self.settings = replace(self.settings, method=settings.method, params=dict(settings.params))
        self.last_speeds = Speeds()
        await self.show_transcript(conversation.session.messages)
        self.end_activity()
        self.update_title()
        await self.chat.message_list.add_notice(f"Session {conversation.session_id}: {info.describe()}")
        self.notify(info.describe().capitalize(), title=f"Session {conversation.session_id}", markup=False)

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
        settings = self.saved_settings(session_id)
        cancel = threading.Event()
        self.set_activity(f"rebuilding session {session_id}", cancel)
        self.chat.show_progress(f"Rebuilding session {session_id}…")
        self.model_worker = self.run_rebuild_saved(session_id, settings, reason, cancel)

    def saved_settings(self, session_id: int) -> CacheSettings:
        """The cache settings the session was saved with (falls back to the current ones)."""
        current = replace(self.settings, params=dict(self.settings.params))
        if self.store is None:
            return current
        try:
            saved = self.store.get_session(session_id).params
            known = {f.name for f in fields(CacheSettings)}
            return replace(current, **{k: v for k, v in saved.items() if k in known})
        except (StoreError, TypeError):
            return current

    @work(thread=True, group="model", exit_on_error=False)
    def run_rebuild_saved(
        self, session_id: int, settings: CacheSettings, reason: str, cancel: threading.Event
    ) -> None:
        def on_progress(done: int, total: int) -> None:
            label = f"Rebuilding session {session_id}: {done:,} / {total:,} tokens"
            self.from_worker(self.chat.show_progress, label, done, total)

        try:
            with self.worker_store() as store:
                assert store is not None
                title = store.get_session(session_id).title
                session, info = persist.rebuild(store, self.engine, session_id, settings, reason, on_progress, cancel)
        except Cancelled:
            self.from_worker(self.rebuild_saved_stopped, session_id)
            return
        except Exception as err:
            self.from_worker(self.model_work_failed, f"Could not rebuild session {session_id}", err)
            return
        self.from_worker(self.resume_finished, Conversation(session, session_id, title), info)

    def rebuild_saved_stopped(self, session_id: int) -> None:
        self.end_activity()
        self.notify(f"Rebuild stopped; session {session_id} stays as it was saved.", severity="warning")

    # -- help and palette --------------------------------------------------------------
    def action_help(self) -> None:
        sections = [
            ("Chat", self.BINDINGS),
            ("Editor", PromptArea.BINDINGS),
            ("Sessions list (Ctrl+S)", SessionsScreen.BINDINGS),
        ]
        self.push_screen(HelpScreen(sections, EDITOR_NOTES))

    def palette_commands(self) -> Iterator[PaletteCommand]:
        seen: set[str] = set()
        for binding in self.BINDINGS:
            if binding.action in seen or binding.action == "command_palette":
                continue
            seen.add(binding.action)
            yield PaletteCommand(binding.description, binding.tooltip, run_action_later(self, binding.action))
        yield PaletteCommand("Attach a file", "type /file PATH in the editor", self.start_file_command)
        for name in compress.available():
            yield PaletteCommand(f"Method: {name}", compress.get(name).description, partial(self.switch_method, name))

    def start_file_command(self) -> None:
        prompt = self.chat.chat_input.prompt_area
        prompt.text = "/file "
        prompt.move_cursor(prompt.document.end)
        prompt.focus()


def run_app(
    engine: Any,
    store: Store | None,
    settings: CacheSettings,
    sampling: SamplingSettings,
    resume_id: int | None,
) -> None:
    """Run the chat app until the user quits (the CLI's default command)."""
    KvchatApp(engine, store, settings, sampling, resume_id).run()
