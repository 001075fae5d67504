"""Compare (Ctrl+G): pick methods, watch the last question answered again under each,
side by side, and continue the conversation with one of the answers.

The comparison runs in the model worker and streams into the compare screen; Esc
there stops it. Continuing with an answer needs no model call: the controller kept
each method's fork."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvchat.chat.controller import methods as all_methods
from kvchat.errors import InputTooLong
from kvchat.settings import PREFILL_CHUNK
from kvchat.tui.flows.runner import STREAM_FLUSH_S
from kvchat.tui.screens import CompareMethodsPicker, CompareScreen
from kvchat.tui.status import Speeds
from kvchat.tui.widgets import AnswerFigures
from kvchat.turns import SHARED

if TYPE_CHECKING:
    from kvchat.tui.app import KvchatApp
    from kvchat.turns import Comparison, MethodAnswer


def comparison_summary(comparison: Comparison) -> str:
    """One line on how the answers were made (what their TTFT counts)."""
    if comparison.prefill_mode == SHARED:
        return (
            f"one exact prefill of {comparison.prompt_tokens:,} tokens ({comparison.prefill_s:.2f} s), forked to "
            "each method · TTFT = prefill + that method's compression of it + its first token"
        )
    return comparison.note


class CompareFlow:
    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self.runner = app.runner

    def pick(self) -> None:
        """Ctrl+G: the methods to compare, the current one and a few others preselected."""
        app, controller = self.app, self.app.controller
        if not self.runner.ensure_idle():
            return
        if not controller.can_compare():
            app.notify(
                "Nothing to compare yet: ask a question first. Compare asks the last question again "
                "under the methods you pick.",
                severity="warning",
            )
            return
        picker = CompareMethodsPicker(all_methods(), controller.default_compare_methods(), app.current_method())
        # the callback's result (call_later's bool) is discarded
        app.push_screen(picker, lambda methods: app.call_later(self.start, methods))  # type: ignore[arg-type]

    async def start(self, methods: list[str] | None) -> None:
        app = self.app
        conversation = app.conversation
        if not methods or conversation is None or conversation.last_question is None or not self.runner.ensure_idle():
            return
        screen = CompareScreen(conversation.last_question.question, methods, app.current_method())
        cancel = threading.Event()
        self.runner.set_activity("comparing methods", cancel)
        await app.push_screen(screen, lambda method: app.call_later(self.chosen, method))  # type: ignore[arg-type]
        self.runner.run(self.run_compare, screen, methods, cancel)

    def run_compare(self, screen: CompareScreen, methods: list[str], cancel: threading.Event) -> None:
        """The model worker of a comparison."""
        from_worker = self.runner.from_worker
        # As in a turn, pieces are coalesced: the UI is called at most ~30 times a second.
        pending: dict[str, list[str]] = {}
        last_flush = 0.0

        def flush() -> None:
            nonlocal last_flush
            for method, pieces in pending.items():
                if pieces:
                    text = "".join(pieces)
                    pieces.clear()
                    from_worker(screen.append, method, text)
            last_flush = time.perf_counter()

        def on_token(method: str, piece: str) -> None:
            pending.setdefault(method, []).append(piece)
            if time.perf_counter() - last_flush >= STREAM_FLUSH_S:
                flush()

        def on_start(method: str) -> None:
            flush()
            from_worker(screen.method_started, method)

        def on_progress(done: int, total: int) -> None:
            if total > PREFILL_CHUNK:
                from_worker(screen.show_status, f"reading {done:,} / {total:,} tokens…")

        def on_answer(answer: MethodAnswer) -> None:
            flush()
            figures = AnswerFigures(
                answer.kv_bytes, answer.ttft_s, answer.decode_tokens_per_s, stopped=answer.stop_reason == "cancelled"
            )
            from_worker(screen.method_finished, answer.method, figures)

        try:
            comparison = self.app.controller.compare(
                methods,
                on_token=on_token,
                on_progress=on_progress,
                on_start=on_start,
                on_answer=on_answer,
                cancel=cancel,
            )
        except Exception as err:
            flush()
            from_worker(self.failed, screen, err)
            return
        flush()
        from_worker(self.finished, screen, comparison_summary(comparison), comparison.cancelled)

    async def finished(self, screen: CompareScreen, summary: str, stopped: bool) -> None:
        await screen.finished(summary, stopped)
        self.runner.end_activity(trend_sample=False)

    def failed(self, screen: CompareScreen, err: Exception) -> None:
        self.runner.end_activity(trend_sample=False)
        if self.app.screen is screen:
            screen.dismiss(None)
        if isinstance(err, InputTooLong):
            self.app.notify(
                f"{err.message('prompt', 'a shorter question')} (or leave that method out)",
                title="Cannot compare",
                severity="error",
                timeout=12,
                markup=False,
            )
        else:
            self.runner.report_error("Compare failed", err)

    async def chosen(self, method: str | None) -> None:
        """The compare screen closed: continue with `method`'s answer, or (None) as before."""
        app, controller = self.app, self.app.controller
        if method is None:
            controller.drop_comparison()  # the forks' caches are let go
            return
        previous = app.conversation.session_id if app.conversation else None
        conversation = controller.continue_with(method)  # no model call: the fork exists already
        self.runner.last_speeds = Speeds()
        await app.sessions.show_transcript(conversation.session.messages)
        kept = f"session {previous} stays saved as it was; " if previous is not None else ""
        await app.chat.message_list.add_notice(
            f"Continuing with {method}'s answer: {kept}this is a new session, saved with its next turn."
        )
        app.update_title()
        self.runner.refresh_status()
        self.runner.add_trend_sample()
