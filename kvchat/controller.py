"""The chat controller: what the app does besides drawing, with no Textual in it.

It owns the model (loaded once, in a background thread), the open conversation and
where it is saved, and it runs every model and database operation the app offers:
sending a turn, switching method, rebuilding, resuming, forking, comparing methods on
the last question, listing, renaming and deleting sessions. Every method that touches the model or SQLite blocks, so the
app calls them from its worker threads, never from the UI thread. What comes back is
strings, numbers and plain dataclasses; tensors stay behind `engine`.

SQLite connections belong to the thread that opened them, so each operation opens
its own short-lived connection to the database file (WAL mode makes that safe).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from . import compress, persist
from .compare import Comparison, MethodAnswer, check_methods
from .compare import compare as compare_methods
from .engine import CacheSettings, ChatSession, Engine, SamplingSettings, TurnResult
from .persist import ResumeInfo
from .store import SessionRow, Store

ProgressFn = Callable[[int, int], None]
EngineLoader = Callable[[], Engine]

# The commands typed in the editor, each with the app action it stands for.
SLASH_ACTIONS = {"/new": "new_session", "/sessions": "sessions", "/rebuild": "rebuild", "/help": "help"}
SLASH_USAGE = "/file PATH, /method NAME, /new, /sessions, /rebuild, /help"


class CommandError(ValueError):
    """A typed command that cannot run; the message names the way out."""


@dataclass(frozen=True)
class SlashCommand:
    """`/file PATH` is ("file", PATH), `/method NAME` is ("method", NAME); the rest
    name the app action to run ("new_session", "sessions", "rebuild", "help")."""

    action: str
    argument: str = ""


def parse_input(line: str) -> SlashCommand | str:
    """A command, or the message to send ("//x" sends "/x" literally). Raises
    CommandError for an unknown command or method."""
    text = line.strip()
    if text.startswith("//"):
        return text[1:]
    if not text.startswith("/"):
        return text
    name, _, argument = text.partition(" ")
    argument = argument.strip()
    if name == "/file":
        return SlashCommand("file", argument)
    if name == "/method":
        methods = compress.available()
        if argument not in methods:
            raise CommandError(f"Unknown method {argument!r}; choose one of: {', '.join(methods)}")
        return SlashCommand("method", argument)
    if name in SLASH_ACTIONS:
        return SlashCommand(SLASH_ACTIONS[name])
    raise CommandError(
        f"Unknown command {name}; try {SLASH_USAGE} (start with // to send a message beginning with /)."
    )


def methods() -> list[tuple[str, str]]:
    """(name, one-line description) of every method, in picker order."""
    return [(name, compress.get(name).description) for name in compress.available()]


@dataclass(frozen=True)
class AskedQuestion:
    """The last question asked in a conversation and where the transcript stood before
    it, so that `Controller.compare` can ask it again from the same starting point."""

    question: str
    document: str | None
    user_text: str  # what was sent: the document, then the question
    tokens_before: int  # the session's token ids before this question
    messages_before: int  # and its messages


@dataclass
class Conversation:
    """The open chat: the engine session plus where it is saved (None until its first turn)."""

    session: ChatSession
    session_id: int | None = None
    title: str = ""
    # Known for questions asked in this run (not for a resumed session's old ones).
    last_question: AskedQuestion | None = None


@dataclass
class TurnOutcome:
    result: TurnResult
    save_error: Exception | None = None


@dataclass
class SwitchOutcome:
    method: str
    kv_bytes_before: int
    kv_bytes_after: int
    seconds: float
    save_error: Exception | None = None


@dataclass
class RebuildOutcome:
    tokens: int
    seconds: float
    save_error: Exception | None = None


@dataclass
class ResumeOutcome:
    session_id: int
    title: str
    messages: list[dict[str, str]] = field(default_factory=list)
    info: ResumeInfo | None = None


class ModelLoading:
    """The model, loaded once in a daemon thread so that quitting never waits for it
    (a thread still converting weights is dropped when the process exits)."""

    def __init__(self, loader: EngineLoader) -> None:
        self._loader = loader
        self._done = threading.Event()
        self._started = threading.Lock()
        self._thread: threading.Thread | None = None
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.note = ""  # a one-off step the loader reports (the first start's model conversion)

    def start(self) -> None:
        with self._started:
            if self._thread is None:
                self._thread = threading.Thread(target=self._load, name="kvchat-model-load", daemon=True)
                self._thread.start()

    def _load(self) -> None:
        try:
            try:
                accepts_status = "on_status" in inspect.signature(self._loader).parameters
            except (TypeError, ValueError):
                accepts_status = False
            self.engine = self._loader(on_status=self._hear) if accepts_status else self._loader()
        except BaseException as err:  # reported to whoever waits, never lost in the thread
            self.error = err
        finally:
            self._done.set()

    def _hear(self, message: str) -> None:
        self.note = message

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once loading ended (loaded or failed)."""
        self.start()
        return self._done.wait(timeout)


class Controller:
    """One user's chat: the model, the open conversation, the saved sessions."""

    def __init__(
        self,
        engine: Engine | EngineLoader,
        db_path: str | Path | None,
        settings: CacheSettings,
        sampling: SamplingSettings,
        *,
        store_timeout_s: float = 10.0,
    ) -> None:
        """`engine`: a loaded engine, or a callable that loads one (see `load`).
        `db_path` None: nothing is saved or listed."""
        self.loading = ModelLoading(engine if callable(engine) and not hasattr(engine, "new_session")
                                    else (lambda: engine))
        self.db_path = Path(db_path) if db_path is not None else None
        self.store_timeout_s = store_timeout_s
        self.settings = replace(settings, params=dict(settings.params))
        self.sampling = sampling
        # Hyperparameters given on the command line belong to the method they were given for.
        self.method_params: dict[str, dict[str, Any]] = {settings.method: dict(settings.params)}
        self.conversation: Conversation | None = None
        self._compared: tuple[Comparison, AskedQuestion] | None = None

    # -- the model ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.conversation is not None

    @property
    def engine(self) -> Engine:
        if self.loading.engine is None:
            raise RuntimeError("the model is not loaded yet")
        return self.loading.engine

    @property
    def model_name(self) -> str:
        engine = self.loading.engine
        return str(getattr(getattr(engine, "loaded", None), "name", "model")) if engine else "model"

    def load(self, timeout: float | None = None) -> bool:
        """Wait for the model (starting its load if needed), then open a new
        conversation. False on timeout; the loader's error is raised as is."""
        if not self.loading.wait(timeout):
            return False
        if self.loading.error is not None:
            raise self.loading.error
        if self.conversation is None:
            self.new_session()
        return True

    def count_tokens(self, text: str) -> int:
        self.load()
        return int(self.engine.count_tokens(text))

    # -- the open conversation ---------------------------------------------------------
    @property
    def method(self) -> str:
        return str(self.conversation.session.settings.method) if self.conversation else self.settings.method

    def new_session(self) -> Conversation:
        """A fresh conversation under the current settings (the previous one stays saved)."""
        # A copy: a session changes its own settings when its method is switched.
        self.conversation = Conversation(self.engine.new_session(replace(self.settings, params=dict(self.settings.params))))
        return self.conversation

    def stats(self) -> dict[str, Any] | None:
        """The cache's numbers for the status bar; None before the model is loaded or
        while a worker is changing the cache."""
        if self.conversation is None:
            return None
        try:
            return self.conversation.session.stats()
        except Exception:  # the cache is being changed right now; the next look will do
            return None

    def memory_report(self) -> dict[str, Any] | None:
        """The open conversation's memory map (`ChatSession.memory_report`); None before
        the model is loaded."""
        if self.conversation is None:
            return None
        return self.conversation.session.memory_report()

    @contextmanager
    def store(self) -> Iterator[Store | None]:
        """A store connection for the calling thread (None when nothing is saved)."""
        if self.db_path is None:
            yield None
            return
        opened = Store(self.db_path, timeout_s=self.store_timeout_s)
        try:
            yield opened
        finally:
            opened.close()

    # -- a turn ------------------------------------------------------------------------
    def send(
        self,
        question: str,
        document: str | None = None,
        *,
        on_token: Callable[[str], None] | None = None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> TurnOutcome:
        """Answer `question` (after `document`, when given) and save the turn. Waits
        for the model first when it is still loading."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        user_text = ChatSession.user_message(question, document)
        session = conversation.session
        asked = AskedQuestion(question, document, user_text, len(session.token_ids), len(session.messages))
        result = session.send(
            user_text, self.sampling, on_token=on_token, on_progress=on_progress, cancel=cancel, document=document
        )
        conversation.last_question = asked
        return TurnOutcome(result, self._save_turn(conversation, question, user_text, result))

    def _save_turn(self, conversation: Conversation, question: str, user_text: str, result: TurnResult) -> Exception | None:
        try:
            with self.store() as store:
                if store is None:
                    return None
                if conversation.session_id is None:
                    conversation.title = persist.title_for(question)
                    conversation.session_id = persist.new_session_row(store, conversation.session, conversation.title)
                persist.save_turn(store, conversation.session_id, conversation.session, user_text, result)
        except Exception as err:  # the answer stands; the caller reports the failed save
            return err
        return None

    def _save_snapshot(self, conversation: Conversation) -> Exception | None:
        if conversation.session_id is None:
            return None
        try:
            with self.store() as store:
                if store is not None:
                    persist.save_snapshot(store, conversation.session_id, conversation.session)
        except Exception as err:
            return err
        return None

    # -- method switch, rebuild, fork --------------------------------------------------
    def next_method(self) -> str:
        names = compress.available()
        current = self.method
        return names[(names.index(current) + 1) % len(names)] if current in names else names[0]

    def switch_method(self, method: str) -> SwitchOutcome:
        """Re-stream the cache into `method` (with the hyperparameters given for it) and save."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        params = dict(self.method_params.get(method, {}))
        session = conversation.session
        before = int(session.stats()["kv_bytes"])
        start = time.perf_counter()
        session.switch_method(method, params)
        seconds = time.perf_counter() - start
        after = int(session.stats()["kv_bytes"])
        self.settings = replace(self.settings, method=method, params=dict(params))
        return SwitchOutcome(method, before, after, seconds, self._save_snapshot(conversation))

    def rebuild(self, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None) -> RebuildOutcome:
        """Re-read every token so far through the current method and save. Raises
        engine.Cancelled when stopped (the previous cache is kept)."""
        conversation = self.conversation
        assert conversation is not None
        start = time.perf_counter()
        conversation.session.rebuild(on_progress, cancel)
        seconds = time.perf_counter() - start
        return RebuildOutcome(len(conversation.session.token_ids), seconds, self._save_snapshot(conversation))

    def fork(self, method: str | None = None) -> Conversation:
        """Continue a copy of the open conversation (optionally under another method)
        as a new, not yet saved conversation; the original stays saved as it was."""
        self.load()
        assert self.conversation is not None
        session = self.conversation.session
        settings = replace(session.settings, params=dict(session.settings.params))
        if method is not None and method != settings.method:
            settings = replace(settings, method=method, params=dict(self.method_params.get(method, {})))
        self.conversation = Conversation(session.fork(settings))
        self.settings = replace(self.settings, method=settings.method, params=dict(settings.params))
        return self.conversation

    # -- one question under several methods ------------------------------------------
    def can_compare(self) -> bool:
        return self.conversation is not None and self.conversation.last_question is not None

    def default_compare_methods(self) -> list[str]:
        """The methods a comparison offers preselected: the current one and a few that
        differ in kind (none, recency, scores, merging)."""
        names = compress.available()
        picked = [self.method] + [m for m in ("window", "h2o", "chelsea") if m != self.method]
        return [m for m in picked if m in names]

    def compare(
        self,
        methods: list[str],
        *,
        on_token: Callable[[str, str], None] | None = None,
        on_progress: ProgressFn | None = None,
        on_start: Callable[[str], None] | None = None,
        on_answer: Callable[[MethodAnswer], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Comparison:
        """Ask the open conversation's last question again under each of `methods`: the
        transcript before it is read again, exactly as it was fed, with the question,
        in one exact prefill forked to each method (see kvchat.compare). Nothing is
        saved and the open conversation is not changed; `continue_with` adopts one
        answer. Raises ValueError when no question was asked in this run."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        asked = conversation.last_question
        if asked is None:
            raise ValueError("nothing to compare yet: ask a question first (Compare asks the last one again)")
        chosen = check_methods(methods)
        session = conversation.session
        params = {m: dict(self.method_params.get(m, {})) for m in chosen}
        params[session.settings.method] = dict(session.settings.params)
        comparison = compare_methods(
            self.engine, session.settings, self.sampling, asked.user_text, chosen, params=params,
            history_ids=session.token_ids[: asked.tokens_before],
            history_messages=session.messages[: asked.messages_before],
            on_token=on_token, on_progress=on_progress, on_start=on_start, on_answer=on_answer, cancel=cancel,
            keep_sessions=True,
        )
        self._compared = (comparison, asked)
        return comparison

    def continue_with(self, method: str) -> Conversation:
        """Make the last comparison's answer under `method` the open conversation: a new
        conversation, saved as a session of its own on its next turn (like `fork`); the
        conversation compared from stays saved as it was."""
        compared = self._compared
        if compared is None:
            raise ValueError("no comparison to continue from")
        comparison, asked = compared
        answer = next((a for a in comparison.answers if a.method == method and a.session is not None), None)
        if answer is None:
            raise ValueError(f"the comparison has no answer under {method}")
        session = answer.session
        assert session is not None
        self.conversation = Conversation(session, last_question=asked)
        self.settings = replace(self.settings, method=session.settings.method, params=dict(session.settings.params))
        self._compared = None  # the other forks' caches are let go
        return self.conversation

    def drop_comparison(self) -> None:
        """Let go of the last comparison's caches (the user continued without one)."""
        self._compared = None

    # -- saved sessions ----------------------------------------------------------------
    def last_session_id(self) -> int | None:
        with self.store() as store:
            return None if store is None else store.last_session_id()

    def list_sessions(self) -> list[SessionRow]:
        with self.store() as store:
            return [] if store is None else store.list_sessions()

    def rename_session(self, session_id: int, title: str) -> None:
        with self.store() as store:
            if store is not None:
                store.update_session(session_id, title=title)
        if self.conversation is not None and self.conversation.session_id == session_id:
            self.conversation.title = title

    def delete_session(self, session_id: int) -> bool:
        """Delete a saved session; True when it was the open one (a fresh one is opened)."""
        with self.store() as store:
            if store is not None:
                store.delete_session(session_id)
        if self.conversation is not None and self.conversation.session_id == session_id:
            self.new_session()
            return True
        return False

    def resume(self, session_id: int) -> ResumeOutcome:
        """Open a saved session from its snapshot. Raises persist.SnapshotMismatch when
        the snapshot does not fit the loaded model (offer `rebuild_saved`)."""
        self.load()
        with self.store() as store:
            if store is None:
                raise RuntimeError("sessions are not saved in this run (no database)")
            title = store.get_session(session_id).title
            session, info = persist.resume(store, self.engine, session_id)
        return self._opened(Conversation(session, session_id, title), info)

    def saved_settings(self, session_id: int) -> CacheSettings:
        """The cache settings the session was saved with (the current ones where unknown)."""
        current = replace(self.settings, params=dict(self.settings.params))
        try:
            with self.store() as store:
                if store is None:
                    return current
                saved = store.get_session(session_id).params
        except Exception:
            return current
        known = {f.name for f in fields(CacheSettings)}
        try:
            return replace(current, **{k: v for k, v in saved.items() if k in known})
        except TypeError:
            return current

    def rebuild_saved(
        self,
        session_id: int,
        reason: str = "",
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> ResumeOutcome:
        """Re-read a saved session's transcript through its saved settings. Raises
        engine.Cancelled when stopped (the saved session stays as it was)."""
        self.load()
        settings = self.saved_settings(session_id)
        with self.store() as store:
            if store is None:
                raise RuntimeError("sessions are not saved in this run (no database)")
            title = store.get_session(session_id).title
            session, info = persist.rebuild(store, self.engine, session_id, settings, reason, on_progress, cancel)
        return self._opened(Conversation(session, session_id, title), info)

    def _opened(self, conversation: Conversation, info: ResumeInfo) -> ResumeOutcome:
        self.conversation = conversation
        settings = conversation.session.settings
        self.settings = replace(self.settings, method=settings.method, params=dict(settings.params))
        messages = [dict(m) for m in conversation.session.messages]
        return ResumeOutcome(conversation.session_id or 0, conversation.title, messages, info)
