"""The chat controller: what the app does besides drawing, with no Textual in it.

It owns the model (loaded once, in a background thread), the open conversation and
where it is saved, and it runs every model and database operation the app offers:
sending a turn, switching method, rebuilding, resuming, forking, comparing methods on
the last question, listing, renaming and deleting sessions. Every method that touches the model or SQLite blocks, so the
app calls them from its worker threads, never from the UI thread. What comes back is
strings, numbers and plain dataclasses; tensors stay behind `engine`.

One `Store` serves the whole process: it is opened once (by the front end, which
reports a bad database before anything else starts) and used from every thread, as
`kvchat.storage.db` documents. Holding it open is also what lets a save write a delta
on the previous snapshot: the row hashes that deltas compare live in the store.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from kvchat.errors import SnapshotMismatch, StoreError
from kvchat.settings import CacheSettings, SamplingSettings, human_size, system_prompt
from kvchat.turns import (
    Comparison,
    MemoryReport,
    MethodAnswer,
    ProgressFn,
    SessionStats,
    TurnResult,
    user_message,
)

if TYPE_CHECKING:
    from kvchat.chat.persist import ResumeInfo
    from kvchat.model.engine import Engine
    from kvchat.model.session import ChatSession
    from kvchat.storage.db import Store
    from kvchat.storage.rows import SessionMatch, SessionRow, TierDrop

# The model's stack (torch, transformers, the compressors, the store's codec) is imported
# by the methods that need it, not here: the app imports this module before its first
# frame, which should not wait for torch.

# A loader takes no arguments, or an `on_status` keyword (`ModelLoading._load`).
EngineLoader = Callable[..., "Engine"]


def disk_budget_line(dropped: TierDrop) -> str:
    """What the disk budget did after a save, in one line for the user."""
    count = len(dropped.sessions)
    line = (
        f"disk budget {human_size(dropped.budget)}: dropped the recall tier{'s' if count > 1 else ''} of "
        f"{count} older session{'s' if count > 1 else ''} ({human_size(dropped.freed)})"
    )
    if dropped.total > dropped.budget:
        line += (
            f"; the sessions still take {human_size(dropped.total)}: delete some "
            "(`kvchat sessions list` shows their sizes) or raise disk_budget"
        )
    return line


def methods() -> list[tuple[str, str]]:
    """(name, one-line description) of every method, in picker order."""
    from kvchat import compress

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
class SystemOutcome:
    system: str | None  # the system prompt now (None: the chat template's default)
    tokens: int  # tokens read again under it (0: nothing was said yet, or it did not change)
    seconds: float
    save_error: Exception | None = None


@dataclass
class ResumeOutcome:
    session_id: int
    title: str
    messages: list[dict[str, str]] = field(default_factory=list)
    info: ResumeInfo | None = None


@dataclass
class BranchOutcome:
    """A branch made by `Controller.branch`: the new session, where it came from, how its
    cache was obtained (one line), and what opening it gave (None when not opened)."""

    session_id: int
    origin_id: int
    at: int
    how: str
    opened: ResumeOutcome | None = None


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
        store: Store | None,
        settings: CacheSettings,
        sampling: SamplingSettings,
        method_params: dict[str, dict[str, Any]] | None = None,
        *,
        system: str | None = None,
        on_disk_note: Callable[[str], None] | None = None,
    ) -> None:
        """`engine`: a loaded engine, or a callable that loads one (see `load`).
        `store` None: nothing is saved or listed. The caller owns the store (and closes it).
        `method_params`: hyperparameters given for other methods than `settings.method`
        (used when the user switches to one, or compares). `system`: the system prompt
        of new conversations (None: the chat template's default). Like the method, it
        follows the open conversation: a resumed session keeps its own. `on_disk_note(line)`:
        told, from the thread that saved, when the store's disk budget dropped the recall
        tiers of other sessions after a save."""
        self.loading = ModelLoading(
            # an object with `new_session` is an engine, callable or not
            engine if callable(engine) and not hasattr(engine, "new_session") else (lambda: cast("Engine", engine))
        )
        self.store = store
        self.settings = replace(settings, params=dict(settings.params))
        self.sampling = sampling
        # Hyperparameters given on the command line belong to the method they were given for.
        self.method_params: dict[str, dict[str, Any]] = {m: dict(p) for m, p in (method_params or {}).items()}
        self.method_params[settings.method] = dict(settings.params)
        self._system = system_prompt(system)
        self.conversation: Conversation | None = None
        self._compared: tuple[Comparison, AskedQuestion] | None = None
        self.on_disk_note = on_disk_note

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

    @property
    def system(self) -> str | None:
        """The open conversation's system prompt (before one is open: that of new ones)."""
        return self.conversation.session.system if self.conversation else self._system

    def new_session(self) -> Conversation:
        """A fresh conversation under the current settings and system prompt (the
        previous one stays saved)."""
        # A copy: a session changes its own settings when its method is switched.
        settings = replace(self.settings, params=dict(self.settings.params))
        self.conversation = Conversation(self.engine.new_session(settings, system=self._system))
        # Recall not given (None) is the engine's default from now on (`Engine.default_recall`).
        self.settings = replace(self.settings, recall=self.conversation.session.settings.recall)
        return self.conversation

    def stats(self) -> SessionStats | None:
        """The cache's numbers for the status bar; None before the model is loaded or
        while a worker is changing the cache."""
        if self.conversation is None:
            return None
        try:
            return self.conversation.session.stats()
        except Exception:  # the cache is being changed right now; the next look will do
            return None

    def describe(self) -> dict[str, Any]:
        """The open conversation as plain data (`kvchat ask --json`): its method, budget,
        model, precision, saved session id and memory map (the share of each message
        part, and of each page or chapter of an attached file, the cache still holds)."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        session, loaded = conversation.session, self.engine.loaded
        stats = session.stats()
        return {
            "method": stats.method,
            "budget": stats.budget,
            "model": loaded.name,
            "precision": loaded.precision,
            "session": conversation.session_id,
            "system": session.system,
            "recall": session.settings.recall,
            "memory": [span.as_dict() for span in session.memory_map()],
            "parts": [asdict(part) for part in session.memory_report(cell_layers=False).parts] if session.parts else [],
        }

    def memory_report(self) -> MemoryReport | None:
        """The open conversation's memory map (`ChatSession.memory_report`); None before
        the model is loaded."""
        if self.conversation is None:
            return None
        return self.conversation.session.memory_report()

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
        user_text = user_message(question, document)
        session = conversation.session
        asked = AskedQuestion(question, document, user_text, len(session.token_ids), len(session.messages))
        result = session.send(
            user_text, self.sampling, on_token=on_token, on_progress=on_progress, cancel=cancel, document=document
        )
        conversation.last_question = asked
        return TurnOutcome(result, self._save_turn(conversation, question, user_text, result))

    def _save_turn(
        self, conversation: Conversation, question: str, user_text: str, result: TurnResult
    ) -> Exception | None:
        store = self.store
        if store is None:  # (`ask --no-save`: not even the storage code is imported)
            return None
        from kvchat.chat import persist

        try:
            if conversation.session_id is None:
                conversation.title = persist.title_for(question)
                conversation.session_id = persist.new_session_row(store, conversation.session, conversation.title)
            persist.save_turn(store, conversation.session_id, conversation.session, user_text, result)
            self._fit_disk(conversation.session_id)
        except Exception as err:  # the answer stands; the caller reports the failed save
            return err
        return None

    def _save_snapshot(self, conversation: Conversation, rebuilt: bool = False) -> Exception | None:
        """Save the open conversation's cache; `rebuilt`: it was read again from the
        transcript, its recall tier whole again."""
        from kvchat.chat import persist

        if conversation.session_id is None or self.store is None:
            return None
        try:
            persist.save_snapshot(self.store, conversation.session_id, conversation.session, rebuilt=rebuilt)
            self._fit_disk(conversation.session_id)
        except Exception as err:
            return err
        return None

    def _fit_disk(self, session_id: int) -> None:
        """After a save: hold the sessions to the store's disk budget, and say what it
        dropped. A failure is said too, and is not the save's: that has committed."""
        try:
            dropped = None if self.store is None else self.store.fit_disk_budget(keep=session_id)
        except StoreError as err:
            note: str | None = f"the disk budget was not applied: {err}"
        else:
            note = None if dropped is None else disk_budget_line(dropped)
        if note is not None and self.on_disk_note is not None:
            self.on_disk_note(note)

    # -- method switch, rebuild, fork --------------------------------------------------
    def next_method(self) -> str:
        from kvchat import compress

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
        before = session.stats().kv_bytes
        start = time.perf_counter()
        session.switch_method(method, params)
        seconds = time.perf_counter() - start
        after = session.stats().kv_bytes
        self.settings = replace(self.settings, method=method, params=dict(params))
        return SwitchOutcome(method, before, after, seconds, self._save_snapshot(conversation))

    def rebuild(self, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None) -> RebuildOutcome:
        """Re-read every token so far through the current method and save. Raises
        Cancelled when stopped (the previous cache is kept)."""
        conversation = self.conversation
        assert conversation is not None
        start = time.perf_counter()
        conversation.session.rebuild(on_progress, cancel)
        seconds = time.perf_counter() - start
        saved = self._save_snapshot(conversation, rebuilt=True)
        return RebuildOutcome(len(conversation.session.token_ids), seconds, saved)

    def set_system(
        self,
        text: str | None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> SystemOutcome:
        """Make `text` the open conversation's system prompt (None or blank: the chat
        template's default) and that of new ones. The transcript so far is read again
        under it (`ChatSession.set_system`) and the snapshot saved. Raises Cancelled
        when stopped (the previous prompt and cache are kept) and SettingsError when the
        model's chat template takes no system prompt."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        start = time.perf_counter()
        fed = conversation.session.set_system(text, on_progress, cancel)
        seconds = time.perf_counter() - start
        self._system = conversation.session.system
        if fed:  # the token ids before the last question changed: Compare needs a new one
            conversation.last_question = None
        tokens = len(conversation.session.token_ids) if fed else 0
        return SystemOutcome(
            self._system, tokens, seconds, self._save_snapshot(conversation, rebuilt=True) if fed else None
        )

    def set_recall(
        self,
        recall: int,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> RebuildOutcome:
        """Turn the recall tier on (`recall` cold tokens per KV head and step) or off (0)
        for the open conversation (rebuilt under it, `ChatSession.set_recall`, and saved)
        and new ones; `tokens` 0: nothing was said yet. Raises Cancelled when stopped."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        start = time.perf_counter()
        fed = conversation.session.set_recall(recall, on_progress, cancel)
        self.settings = replace(self.settings, recall=int(recall))
        tokens = len(conversation.session.token_ids) if fed else 0
        saved = self._save_snapshot(conversation, rebuilt=True) if fed else None
        return RebuildOutcome(tokens, time.perf_counter() - start, saved)

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
        self.settings = replace(
            self.settings, method=settings.method, params=dict(settings.params), recall=settings.recall
        )
        return self.conversation

    # -- one question under several methods ------------------------------------------
    def can_compare(self) -> bool:
        return self.conversation is not None and self.conversation.last_question is not None

    def default_compare_methods(self) -> list[str]:
        """The methods a comparison offers preselected: the current one and a few that
        differ in kind (none, recency, scores, merging)."""
        from kvchat import compress

        names = compress.available()
        picked = [self.method] + [m for m in ("window", "h2o", "chelsea") if m != self.method]
        return [m for m in picked if m in names]

    def compare(
        self,
        methods: list[str],
        *,
        question: str | None = None,
        document: str | None = None,
        on_token: Callable[[str, str], None] | None = None,
        on_progress: ProgressFn | None = None,
        on_start: Callable[[str], None] | None = None,
        on_answer: Callable[[MethodAnswer], None] | None = None,
        cancel: threading.Event | None = None,
        keep_sessions: bool = True,
    ) -> Comparison:
        """Ask the open conversation's last question again under each of `methods`, or,
        given `question` (about `document`), that new question after the conversation so
        far: the transcript before it is read again, exactly as it was fed, with the
        question, in one exact prefill forked to each method (see kvchat.chat.compare).
        Nothing is saved and the open conversation is not changed; `continue_with`
        adopts one answer (`keep_sessions` False: the answers keep no cache to continue
        from). Raises ValueError when there is no question to ask, and InputTooLong,
        before any work, when a method cannot hold the prompt."""
        self.load()
        conversation = self.conversation
        assert conversation is not None
        session = conversation.session
        if question is not None:
            asked = AskedQuestion(
                question, document, user_message(question, document), len(session.token_ids), len(session.messages)
            )
        elif conversation.last_question is not None:
            asked = conversation.last_question
        else:
            raise ValueError("nothing to compare yet: ask a question first (Compare asks the last one again)")
        from kvchat.chat.compare import check_methods, compare

        chosen = check_methods(methods)
        params = {m: dict(self.method_params.get(m, {})) for m in chosen}
        params[session.settings.method] = dict(session.settings.params)
        comparison = compare(
            self.engine,
            session.settings,
            self.sampling,
            asked.user_text,
            chosen,
            params=params,
            history_ids=session.token_ids[: asked.tokens_before],
            history_messages=session.messages[: asked.messages_before],
            system=session.system,
            on_token=on_token,
            on_progress=on_progress,
            on_start=on_start,
            on_answer=on_answer,
            cancel=cancel,
            keep_sessions=keep_sessions,
        )
        self._compared = (comparison, asked) if keep_sessions else None
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
        self.settings = replace(
            self.settings,
            method=session.settings.method,
            params=dict(session.settings.params),
            recall=session.settings.recall,
        )
        self._system = session.system
        self._compared = None  # the other forks' caches are let go
        return self.conversation

    def drop_comparison(self) -> None:
        """Let go of the last comparison's caches (the user continued without one)."""
        self._compared = None

    # -- saved sessions ----------------------------------------------------------------
    def last_session_id(self) -> int | None:
        return None if self.store is None else self.store.last_session_id()

    def list_sessions(self) -> list[SessionRow]:
        return [] if self.store is None else self.store.list_sessions()

    def search_sessions(self, text: str) -> list[SessionMatch]:
        """The saved sessions whose messages match `text` (plain words, the last also as
        a prefix), newest first: `SessionMatch` rows, each with the snippet of its best
        match and the matched words' offsets in it. Blocks: call it from a worker."""
        return [] if self.store is None else self.store.search(text)

    def rename_session(self, session_id: int, title: str) -> None:
        if self.store is not None:
            self.store.update_session(session_id, title=title)
        if self.conversation is not None and self.conversation.session_id == session_id:
            self.conversation.title = title

    def delete_session(self, session_id: int) -> bool:
        """Delete a saved session; True when it was the open one (a fresh one is opened)."""
        if self.store is not None:
            self.store.delete_session(session_id)
        if self.conversation is not None and self.conversation.session_id == session_id:
            self.new_session()
            return True
        return False

    def resume(self, session_id: int) -> ResumeOutcome:
        """Open a saved session from its snapshot. Raises SnapshotMismatch when
        the snapshot does not fit the loaded model (offer `rebuild_saved`)."""
        from kvchat.chat import persist

        self.load()
        store = self._saved_sessions()
        title = store.get_session(session_id).title
        session, info = persist.resume(store, self.engine, session_id)
        return self._opened(Conversation(session, session_id, title), info)

    def saved_settings(self, session_id: int) -> CacheSettings:
        """The cache settings the session was saved with (the current ones where unknown)."""
        from kvchat.chat import persist

        current = replace(self.settings, params=dict(self.settings.params))
        if self.store is None:
            return current
        try:
            return persist.settings_from_meta(self.store.get_session(session_id).params, base=current)
        except Exception:  # an unknown id or unreadable params: the rebuild itself reports the id
            return current

    def rebuild_saved(
        self,
        session_id: int,
        reason: str = "",
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> ResumeOutcome:
        """Re-read a saved session's transcript through its saved settings. Raises
        Cancelled when stopped (the saved session stays as it was)."""
        from kvchat.chat import persist

        self.load()
        settings = self.saved_settings(session_id)
        store = self._saved_sessions()
        title = store.get_session(session_id).title
        session, info = persist.rebuild(store, self.engine, session_id, settings, reason, on_progress, cancel)
        self._fit_disk(session_id)
        return self._opened(Conversation(session, session_id, title), info)

    def open_saved(
        self,
        session_id: int,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> ResumeOutcome:
        """Resume a saved session, or, when its snapshot does not fit the loaded model,
        rebuild it from its transcript without asking (what `kvchat ask --session` does;
        the app asks first, through `resume` and `rebuild_saved`)."""
        try:
            return self.resume(session_id)
        except SnapshotMismatch as err:
            return self.rebuild_saved(session_id, str(err), on_progress, cancel)

    # -- branches: edit, regenerate --------------------------------------------------
    def user_messages(self) -> list[str]:
        """The open conversation's user messages, turn 1 first (what a branch starts from:
        editing or regenerating turn k is a branch at k - 1, then a send)."""
        if self.conversation is None:
            return []
        return [m["content"] for m in self.conversation.session.messages if m["role"] == "user"]

    def branch(
        self,
        session_id: int,
        at: int,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        *,
        open_it: bool = True,
    ) -> BranchOutcome:
        """A new saved session sharing the first `at` turns of saved session `session_id`
        (a turn: a user message and its answer; 0 = none); the original stays as saved.
        Its cache is the state after turn `at`: a copy of the original's snapshot when
        that is of turn `at`, else rebuilt from the shared transcript through the saved
        settings, with progress. `open_it`: make it the open conversation (otherwise the
        model is loaded only for a rebuild). Raises Cancelled when stopped, StoreError for
        an unknown id or turn; a stopped or failed branch is not left behind."""
        store = self._saved_sessions()
        made = store.branch_session(session_id, at)
        copied = f"copied the saved cache of turn {at}"
        try:
            if made.snapshot and not open_it:
                return BranchOutcome(made.session_id, made.origin_id, made.at, copied)
            if made.snapshot:  # opened as any saved session (rebuilt if it does not fit the model)
                opened = self.open_saved(made.session_id, on_progress, cancel)
            else:
                opened = self.rebuild_saved(made.session_id, f"no saved cache of turn {at}", on_progress, cancel)
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                store.delete_session(made.session_id)
            raise
        info = opened.info
        how = info.describe() if info is not None and info.rebuilt else copied
        return BranchOutcome(made.session_id, made.origin_id, made.at, how, opened if open_it else None)

    def _saved_sessions(self) -> Store:
        if self.store is None:
            raise RuntimeError("sessions are not saved in this run (no database)")
        return self.store

    def _opened(self, conversation: Conversation, info: ResumeInfo) -> ResumeOutcome:
        self.conversation = conversation
        settings = conversation.session.settings
        # Like the method, the recall setting follows the open conversation.
        self.settings = replace(
            self.settings, method=settings.method, params=dict(settings.params), recall=settings.recall
        )
        self._system = conversation.session.system
        messages = [dict(m) for m in conversation.session.messages]
        return ResumeOutcome(conversation.session_id or 0, conversation.title, messages, info)
