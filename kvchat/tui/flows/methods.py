"""The open conversation's compression method: switch it (Ctrl+T cycles, Ctrl+O picks
from a list, `/method NAME`, the palette) and rebuild the cache through it (Ctrl+R);
and its system prompt (`/system TEXT`), which sits at the start of the conversation, so
setting it reads the conversation again like a rebuild; and the recall tier (`/recall
N|off`, the palette), a cache setting, so switching it rebuilds the cache under it. These
run in the model worker."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvchat.chat.controller import methods as all_methods
from kvchat.errors import Cancelled
from kvchat.settings import recall_text, system_prompt
from kvchat.tui.screens import MethodPicker
from kvchat.tui.status import megabytes

if TYPE_CHECKING:
    from kvchat.chat.controller import RebuildOutcome, SwitchOutcome, SystemOutcome
    from kvchat.tui.app import KvchatApp


class MethodsFlow:
    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self.runner = app.runner

    def cycle(self) -> None:
        if self.runner.ensure_idle():
            self.switch(self.app.controller.next_method())

    def pick(self) -> None:
        def picked(name: str | None) -> None:
            if name:
                self.switch(name)

        self.app.push_screen(MethodPicker(all_methods(), self.app.current_method()), picked)

    # -- switch ------------------------------------------------------------------------
    def switch(self, method: str) -> None:
        if not self.runner.ensure_idle():
            return
        if method == self.app.current_method():
            self.app.notify(f"Already using {method}.")
            return
        self.runner.set_activity(f"switching to {method}")
        self.runner.run(self.run_switch, method)

    def run_switch(self, method: str) -> None:
        """The model worker of a switch."""
        try:
            outcome = self.app.controller.switch_method(method)
        except Exception as err:
            self.runner.from_worker(self.runner.failed, f"Could not switch to {method}", err)
            return
        self.runner.from_worker(self.switch_finished, outcome)

    def switch_finished(self, outcome: SwitchOutcome) -> None:
        self.runner.end_activity()
        before, after = megabytes(outcome.kv_bytes_before), megabytes(outcome.kv_bytes_after)
        self.app.notify(
            f"Now {outcome.method}: KV {before} → {after} (switched in {outcome.seconds:.2f} s)",
            title="Method switched",
            markup=False,
        )
        if outcome.save_error is not None:
            self.runner.report_error("The switch was not saved", outcome.save_error)

    # -- rebuild -----------------------------------------------------------------------
    def rebuild(self) -> None:
        if not self.runner.ensure_idle():
            return
        conversation = self.app.conversation
        if conversation is None or not conversation.session.token_ids:
            self.app.notify("Nothing to rebuild yet: the conversation is empty.")
            return
        cancel = threading.Event()
        self.runner.set_activity(f"rebuilding through {self.app.current_method()}", cancel)
        self.app.chat.show_progress("Rebuilding…")
        self.runner.run(self.run_rebuild, cancel)

    def run_rebuild(self, cancel: threading.Event) -> None:
        """The model worker of a rebuild."""
        method = self.app.controller.method
        self._rereading(
            lambda progress: self.app.controller.rebuild(progress, cancel),
            f"Rebuilding through {method}",
            self.rebuild_finished,
            "Rebuild failed (the previous cache is kept)",
        )

    def _rereading(self, call, label: str, finished, failure: str) -> None:
        """Run `call(on_progress)` in the model worker, which reads the conversation again:
        progress under `label`, then `finished(outcome)`, or `finished(None)` when stopped,
        or the failure reported as `failure`."""
        from_worker = self.runner.from_worker

        def on_progress(done: int, total: int) -> None:
            from_worker(self.app.chat.show_progress, f"{label}: {done:,} / {total:,} tokens", done, total)

        try:
            outcome = call(on_progress)
        except Cancelled:
            from_worker(finished, None)
            return
        except Exception as err:
            from_worker(self.runner.failed, failure, err)
            return
        from_worker(finished, outcome)

    def rebuild_finished(self, outcome: RebuildOutcome | None) -> None:
        self.runner.end_activity()
        if outcome is None:
            self.app.notify("Rebuild stopped; the previous cache is kept.", severity="warning")
            return
        self.app.notify(
            f"Rebuilt {outcome.tokens:,} tokens through {self.app.current_method()} in {outcome.seconds:.1f} s",
            title="Rebuilt",
        )
        if outcome.save_error is not None:
            self.runner.report_error("The rebuilt cache was not saved", outcome.save_error)

    # -- the system prompt -------------------------------------------------------------
    def system(self, text: str) -> None:
        """`/system TEXT`: make TEXT the open conversation's system prompt (and that of
        new ones); `/system off`: back to the chat template's default; `/system`: show
        the current one."""
        controller = self.app.controller
        if text.strip().lower() == "off":
            text = ""  # blank: the template's default (`settings.system_prompt`)
            if controller.system is None:
                self.app.notify("There is no system prompt to turn off: the model's default applies.")
                return
        elif not text:
            current = controller.system
            self.app.notify(
                current if current is not None else "none: the model's default (set one with /system TEXT)",
                title="System prompt",
                markup=False,
            )
            return
        if not self.runner.ensure_idle():
            return
        if system_prompt(text) == controller.system:
            self.app.notify("That is the system prompt already.")
            return
        cancel = threading.Event()
        self.runner.set_activity("setting the system prompt", cancel)
        conversation = self.app.conversation
        if conversation is not None and conversation.session.token_ids:
            self.app.chat.show_progress("Reading the conversation again…")
        self.runner.run(self.run_system, text, cancel)

    def run_system(self, text: str, cancel: threading.Event) -> None:
        """The model worker of `/system TEXT`: the transcript is read again under it."""
        self._rereading(
            lambda progress: self.app.controller.set_system(text, progress, cancel),
            "Reading the conversation under the new system prompt",
            self.system_finished,
            "The system prompt was not changed",
        )

    def system_finished(self, outcome: SystemOutcome | None) -> None:
        self.runner.end_activity()
        if outcome is None:
            self.app.notify("Stopped; the previous system prompt and cache are kept.", severity="warning")
            return
        if outcome.tokens:
            note = f"Read {outcome.tokens:,} tokens again under it in {outcome.seconds:.1f} s."
        else:
            note = "It applies from the next message."
        title = "System prompt set" if outcome.system is not None else "System prompt off: the model's default"
        self.app.notify(note, title=title, markup=False)
        if outcome.save_error is not None:
            self.runner.report_error("The new system prompt was not saved", outcome.save_error)

    # -- the recall tier ---------------------------------------------------------------
    def recall(self, argument: str) -> None:
        """`/recall N|off` (`argument` "N", "0" for off: `controller.parse_input`): recall N
        cold tokens per KV head and step from the tier on disk, or stop; the cache is
        rebuilt under the new setting. `/recall` (""): show the current setting."""
        current = self.app.controller.settings.recall
        if not argument:
            note = (
                "off (`/recall 32` turns it on: the chat is read again into a tier on disk; each step "
                "then also ranks the cold tokens, so decode slows a little)"
                if not current
                else f"{current} cold tokens per KV head and step, from the tier on disk (`/recall off` stops)"
            )
            self.app.notify(note, title="Recall", markup=False)
            return
        if not self.runner.ensure_idle():
            return
        recall = int(argument)
        if recall == current:
            self.app.notify(f"Recall is {recall_text(recall)} already.")
            return
        cancel = threading.Event()
        self.runner.set_activity(f"recall {recall_text(recall)}: rebuilding", cancel)
        conversation = self.app.conversation
        if conversation is not None and conversation.session.token_ids:
            self.app.chat.show_progress("Rebuilding the cache…")
        self.runner.run(self.run_recall, recall, cancel)

    def run_recall(self, recall: int, cancel: threading.Event) -> None:
        """The model worker of `/recall`: the cache is rebuilt with the new setting."""
        self._rereading(
            lambda progress: self.app.controller.set_recall(recall, progress, cancel),
            f"Rebuilding with recall {recall_text(recall)}",
            self.recall_finished,
            "Recall was not changed",
        )

    def recall_finished(self, outcome: RebuildOutcome | None) -> None:
        self.runner.end_activity()
        if outcome is None:
            self.app.notify("Stopped; the previous recall setting and cache are kept.", severity="warning")
            return
        recall = self.app.controller.settings.recall
        assert recall is not None  # `set_recall` has just set it
        if outcome.tokens:
            note = f"Rebuilt {outcome.tokens:,} tokens under it in {outcome.seconds:.1f} s."
        else:
            note = "It applies from the next message."
        self.app.notify(note, title=f"Recall {recall_text(recall)}", markup=False)
        if outcome.save_error is not None:
            self.runner.report_error("The new recall setting was not saved", outcome.save_error)
