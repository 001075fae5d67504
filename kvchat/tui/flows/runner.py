"""The model worker's plumbing: loading the model, what the model is doing, stop and
quit, the status bar, and reporting back from worker threads.

Model work (a turn, a method switch, a rebuild, a resume, a comparison) runs in one
Textual thread worker at a time (group "model"), so the screen never freezes and keys
echo while the model works. Workers report back with `from_worker` (`call_from_thread`);
the status bar is refreshed by a timer while the model works, never once per token.

Start-up: the first frame is drawn at once and the model loads in a worker, with
"loading model…" in the status bar; a message sent meanwhile waits for the model.

**One thread for the model.** Textual runs thread workers on asyncio's pool of threads,
and which one a worker gets is the pool's choice. PyTorch's OpenMP runtime keeps a team
of helper threads for every thread that starts parallel work, and once two teams exist
on a 2-core machine it counts more threads than cores and stops its helpers spinning
between parallel regions: each of the thousands of small regions of a prefill then waits
for a woken thread (12,000 voluntary context switches in 3 s per compute thread, against
none with one team), and a long document's first token comes up to a second later
(docs/decisions/0010-one-model-thread-in-the-app.md). So every model worker (and the
memory map's reading) runs on one thread of its own (`MODEL_THREAD`), and only that
thread ever starts PyTorch's parallel work.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from textual.timer import Timer
from textual.worker import Worker, WorkerFailed, get_current_worker

from kvchat.errors import DocumentError, ModelError, SnapshotMismatch, StoreError
from kvchat.settings import PREFILL_CHUNK
from kvchat.tui.status import LiveTurn, Speeds, StatusReport

if TYPE_CHECKING:
    from textual.dom import DOMNode

    from kvchat.chat.controller import Controller
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.flows.sessions import Reopened

# The status bar is refreshed this often while the model works (and once after).
STATUS_INTERVAL_S = 0.25
# The answer is handed to the UI at most this often (pieces in between are joined).
STREAM_FLUSH_S = 1 / 30
# How often a waiting worker looks whether the app is closing.
WAIT_POLL_S = 0.1
# The name of the one thread every model worker runs on (module docstring).
MODEL_THREAD = "kvchat-model"
LOADING = "loading model…"
NO_MODEL = "no model loaded"


def run_thread(
    node: DOMNode,
    work: Callable[..., None],
    *args: Any,
    group: str,
    exclusive: bool = False,
    executor: Executor | None = None,
) -> Worker[None]:
    """`work(*args)` in a thread worker that belongs to `node` (the app): what
    `@work(thread=True, exit_on_error=False)` does for a method of a DOM node; a flow
    is not one, so it starts its workers through here. `executor`: the threads to run
    it on (None: Textual's, asyncio's pool); the worker then awaits it, and `work` runs
    in the worker's context, so `get_current_worker()` finds it there as in a thread
    worker."""
    name = getattr(work, "__name__", "")
    if executor is None:
        return node.run_worker(
            partial(work, *args),
            name=name,
            group=group,
            exclusive=exclusive,
            thread=True,
            exit_on_error=False,
        )

    async def in_executor() -> None:
        context = contextvars.copy_context()  # the worker and the app, as Textual sets them
        await asyncio.get_running_loop().run_in_executor(executor, context.run, partial(work, *args))

    return node.run_worker(in_executor, name=name, group=group, exclusive=exclusive, exit_on_error=False)


class ModelRunner:
    """The one model worker and what it is doing (`activity`; None when idle)."""

    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self.activity: str | None = None
        self.cancel_event: threading.Event | None = None
        self.live: LiveTurn | None = None
        self.last_speeds = Speeds()
        self.worker: Worker[None] | None = None  # the model worker last started
        self.ui_errors: list[BaseException] = []  # UI callbacks that failed (tests assert none)
        self.shutting_down = False
        self._status_timer: Timer | None = None
        # Every model worker's thread (module docstring). Like asyncio's own pool, its
        # thread is joined when the interpreter exits, so a save under way completes.
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=MODEL_THREAD)

    @property
    def controller(self) -> Controller:
        return self.app.controller

    def run(self, work: Callable[..., None], *args: Any) -> None:
        """Start `work(*args)` as the model worker (the caller has set the activity)."""
        self.worker = run_thread(self.app, work, *args, group="model", executor=self.model_thread)

    # -- loading the model -------------------------------------------------------------
    def start(self) -> None:
        """On mount: the status timer, then, once the first frame is on screen, the model
        loads in the model worker (its imports, torch's above all, would otherwise hold
        the interpreter while the first frame is drawn)."""
        self._status_timer = self.app.set_interval(STATUS_INTERVAL_S, self.refresh_status, pause=True)
        self.set_activity(LOADING)
        self.app.call_after_refresh(self.run, self.load)

    def load(self) -> None:
        """Wait for the model (it loads in its own daemon thread, so quitting now never
        waits for it), then open the session to resume, if any."""
        worker = get_current_worker()
        try:
            while not self.controller.load(timeout=WAIT_POLL_S):
                if worker.is_cancelled or self.shutting_down:
                    return
        except Exception as err:
            self.from_worker(self.load_failed, err)
            return
        self.from_worker(self.model_loaded, self.app.sessions.reopen())

    async def model_loaded(self, opened: Reopened) -> None:
        resumed = opened.resumed
        if resumed is not None:
            await self.app.sessions.show_resumed(resumed)
        # Idle only once the transcript is shown. The trend starts with the first turn.
        self.end_activity(trend_sample=resumed is not None)
        self.app.update_title()
        waited = await self.app.turns.send_pending(after_transcript=resumed is not None)
        self.app.sessions.reopen_refused(opened, message_waited=waited)

    async def load_failed(self, err: Exception) -> None:
        self.activity = NO_MODEL  # stays: nothing can run without a model
        self.app.refresh_bindings()
        self.report_error("Could not load the model", err)
        self.app.chat.status_bar.show_text(f"{NO_MODEL} │ Ctrl+Q quits")
        await self.app.turns.drop_pending("no answer: the model did not load")

    # -- activity ----------------------------------------------------------------------
    def can_stop(self) -> bool:
        return self.cancel_event is not None and not self.cancel_event.is_set()

    def set_activity(self, activity: str, cancel: threading.Event | None = None) -> None:
        self.activity = activity
        self.cancel_event = cancel
        if self._status_timer is not None:
            self._status_timer.resume()
        self.app.refresh_bindings()
        self.refresh_status()

    def end_activity(self, *, trend_sample: bool = True) -> None:
        self.activity = None
        self.cancel_event = None
        self.live = None
        if self._status_timer is not None:
            self._status_timer.pause()
        self.app.chat.hide_progress()
        self.app.refresh_bindings()
        self.refresh_status()
        if trend_sample:
            self.add_trend_sample()
        self.app.refresh_memory()

    def ensure_idle(self) -> bool:
        if self.activity is None:
            return True
        if self.activity == LOADING:
            self.app.notify("The model is still loading; a message you send now waits for it.", severity="warning")
            return False
        if self.activity == NO_MODEL:
            self.app.notify(
                "No model is loaded (see the error above); quit with Ctrl+Q and check --model.", severity="error"
            )
            return False
        self.app.notify(f"The model is busy ({self.activity}); press Esc to stop it, or wait.", severity="warning")
        return False

    def failed(self, what: str, err: Exception) -> None:
        """Model work that raised: idle again, and say why."""
        self.end_activity()
        self.report_error(what, err)

    # -- reporting back from workers -----------------------------------------------------
    def from_worker(self, callback: Callable[..., Any], *args: Any) -> Any:
        """Run `callback` on the UI thread and wait for it. While the app is closing
        the UI is skipped: the worker's own work (saving) must still finish."""
        if self.shutting_down:
            return None
        try:
            return self.app.call_from_thread(callback, *args)
        except Exception as err:  # the app went away, or a UI bug: never kill the worker
            self.ui_errors.append(err)
            self.app.log.error(f"UI update {getattr(callback, '__name__', callback)} failed: {err!r}")
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
                f"{type(err).__name__}: {err}. Nothing said so far is lost; try again, or Ctrl+N for a fresh session."
            )
        self.app.log.error(f"{what}: {err!r}")
        self.app.notify(message, title=what, severity="error", timeout=12, markup=False)

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

    def refresh_status(self) -> None:
        app = self.app
        if not app.is_screen_installed("chat"):
            return
        stats = self.controller.stats()
        if stats is None:
            if self.activity == LOADING:
                note = self.controller.loading.note
                detail = f"{LOADING} ({note})" if note else LOADING
                app.chat.status_bar.show_text(f"{detail} │ {self.controller.method} │ Ctrl+Q quits")
            return
        speeds = self.live.speeds() if self.activity is not None and self.live is not None else self.last_speeds
        app.chat.status_bar.show(StatusReport.from_stats(stats, speeds, self.activity_label()))

    def add_trend_sample(self) -> None:
        stats = self.controller.stats()
        if stats is not None:
            self.app.chat.status_bar.add_trend_sample(stats.kv_bytes / (1 << 20))

    # -- stop and quit -----------------------------------------------------------------
    def stop(self) -> None:
        if self.cancel_event is not None and not self.cancel_event.is_set():
            self.cancel_event.set()
            self.activity = "stopping"
            self.app.refresh_bindings()
            self.refresh_status()

    async def interrupt(self) -> None:
        if self.activity == LOADING:
            await self.app.action_quit()
        else:
            self.stop()

    async def quit(self) -> None:
        """Stop the model, let its worker save what was said, then exit."""
        worker = self.worker
        if worker is not None and worker.is_running:
            self.stop()
            self.app.notify("Stopping the model and saving…", timeout=30)
            self.shutting_down = True
            with contextlib.suppress(WorkerFailed):
                await worker.wait()
        self.shutting_down = True
        self.app.exit()

    def unmount(self) -> None:
        # However the app ends, a running turn must end soon so its thread can finish.
        self.shutting_down = True
        if self.cancel_event is not None:
            self.cancel_event.set()
        # The model's thread ends once its work (a save under way) is done; nothing new
        # can start. (Its OpenMP team goes with it.)
        self.model_thread.shutdown(wait=False)
