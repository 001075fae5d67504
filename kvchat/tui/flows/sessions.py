"""Saved sessions: the sessions list (Ctrl+S: search, resume, new, rename, delete), a new
session (Ctrl+N, `/new`), a session whose snapshot does not fit the model (rebuild it
from its transcript, after asking), the session reopened at start-up, and branches (F3:
edit and resend an earlier message, or regenerate its answer, in a new session).

Reading and writing the list runs in "store" workers, searching it in "search" workers;
resuming and rebuilding run in the model worker. The sessions screen only shows rows
and reports what was asked."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvchat.errors import Cancelled, SnapshotMismatch, StoreError
from kvchat.tui.documents import AttachedDocument, split_long_user_text
from kvchat.tui.flows.runner import run_thread
from kvchat.tui.screens import BranchPicker, ConfirmDialog, EditMessage, SessionsScreen
from kvchat.tui.status import Speeds

if TYPE_CHECKING:
    from kvchat.chat.controller import BranchOutcome, ResumeOutcome
    from kvchat.storage.rows import SessionRow
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.screens.branch import BranchChoice
    from kvchat.tui.screens.sessions import SessionChoice


@dataclass
class Reopened:
    """What start-up opened: the session resumed, or the one to reopen and why it was
    refused (its snapshot does not fit the model)."""

    resumed: ResumeOutcome | None = None
    target: int | None = None
    refused: str | None = None


class SessionsFlow:
    def __init__(self, app: KvchatApp, resume_id: int | None, reopen_last: bool) -> None:
        self.app = app
        self.runner = app.runner
        self.resume_id = resume_id  # the session to open at start-up
        self.reopen_last = reopen_last  # else the most recent one

    def is_open(self, session_id: int) -> bool:
        conversation = self.app.conversation
        return conversation is not None and conversation.session_id == session_id

    # -- start-up ----------------------------------------------------------------------
    def reopen(self) -> Reopened:
        """In the model worker, once the model is loaded: open the session to resume, if any."""
        controller, from_worker, report_error = self.app.controller, self.runner.from_worker, self.runner.report_error
        target = self.resume_id
        if target is None and self.reopen_last:
            try:
                target = controller.last_session_id()
            except StoreError as err:
                from_worker(report_error, "Could not read the saved sessions", err)
        opened = Reopened(target=target)
        if target is not None:
            try:
                opened.resumed = controller.resume(target)
            except SnapshotMismatch as err:
                opened.refused = str(err)
            except Exception as err:
                from_worker(report_error, f"Could not open session {target}", err)
        return opened

    def reopen_refused(self, opened: Reopened, *, message_waited: bool) -> None:
        """After start-up: offer to rebuild the session that was refused, if any."""
        if opened.refused is None or opened.target is None:
            return
        if message_waited:
            self.app.notify(
                f"Session {opened.target} was not restored: {opened.refused}. Your message started a new session.",
                severity="warning",
                timeout=12,
                markup=False,
            )
        else:
            self.resume_refused(opened.target, opened.refused)

    # -- a new session -----------------------------------------------------------------
    def new(self) -> None:
        if not self.runner.ensure_idle():
            return
        self.runner.set_activity("starting a new session")
        self.runner.run(self.run_new)

    def run_new(self) -> None:
        """The model worker of Ctrl+N: an empty cache under the current settings (no model
        call, but tensor work, which stays on the model's thread: kvchat/tui/flows/runner.py)."""
        try:
            self.app.controller.new_session()
        except Exception as err:
            self.runner.from_worker(self.runner.failed, "Could not start a new session", err)
            return
        self.runner.from_worker(self.new_started)

    async def new_started(self) -> None:
        self.runner.end_activity(trend_sample=False)  # (`show_new` adds the first sample)
        await self.show_new()
        self.app.notify("New session; the previous one stays saved (Ctrl+S).")

    async def show_new(self) -> None:
        self.runner.last_speeds = Speeds()
        await self.app.chat.message_list.clear()
        self.app.update_title()
        self.runner.refresh_status()
        self.runner.add_trend_sample()

    # -- the sessions list -------------------------------------------------------------
    def open_list(self) -> None:
        if not self.app.has_store:
            self.app.notify("Sessions are not saved in this run (no database).", severity="warning")
            return
        self.list_sessions(open_screen=True)

    def list_sessions(self, open_screen: bool = False) -> None:
        """Read the list in a worker; open the sessions screen, or refresh the one shown."""
        run_thread(self.app, self.read_list, open_screen, group="store")

    def read_list(self, open_screen: bool) -> None:
        try:
            rows = self.app.controller.list_sessions()
        except StoreError as err:
            self.runner.from_worker(self.runner.report_error, "Could not list the sessions", err)
            return
        self.runner.from_worker(self.show_list, rows, open_screen)

    def current_id(self) -> int | None:
        conversation = self.app.conversation
        return conversation.session_id if conversation else None

    def screen(self) -> SessionsScreen | None:
        """The sessions screen, when open (a dialog may be over it)."""
        return next((s for s in reversed(self.app.screen_stack) if isinstance(s, SessionsScreen)), None)

    def show_list(self, rows: list[SessionRow], open_screen: bool) -> None:
        if open_screen:
            self.app.push_screen(SessionsScreen(rows, self.current_id(), self.search), self.chosen)
        elif (screen := self.screen()) is not None:
            screen.show_rows(rows, self.current_id())

    def search(self, text: str) -> None:
        """What the sessions screen's search box asks for: search in a worker."""
        run_thread(self.app, self.read_matches, text, group="search")

    def read_matches(self, text: str) -> None:
        """In a worker."""
        try:
            rows = self.app.controller.search_sessions(text)
        except StoreError as err:
            self.runner.from_worker(self.runner.report_error, "Could not search the sessions", err)
            return
        self.runner.from_worker(self.show_matches, text, rows)

    def show_matches(self, text: str, rows: list[SessionRow]) -> None:
        screen = self.screen()
        if screen is not None:
            screen.show_matches(text, rows, self.current_id())

    def chosen(self, choice: SessionChoice | None) -> None:
        if choice is None:
            return
        if choice.action == "new":
            self.new()
        elif choice.session_id is not None:
            if self.is_open(choice.session_id):
                self.app.notify(f"Session {choice.session_id} is already open.")
            else:
                self.resume(choice.session_id)

    def rename_requested(self, event: SessionsScreen.RenameRequested) -> None:
        run_thread(self.app, self.rename, event.session_id, event.title, group="store")

    def rename(self, session_id: int, title: str) -> None:
        """In a worker."""
        try:
            self.app.controller.rename_session(session_id, title)
        except StoreError as err:
            self.runner.from_worker(self.runner.report_error, "Could not rename the session", err)
            return
        self.runner.from_worker(self.app.update_title)
        self.list_sessions()

    def delete_requested(self, event: SessionsScreen.DeleteRequested) -> None:
        if self.is_open(event.session_id) and not self.runner.ensure_idle():
            return
        # The open session's deletion opens a fresh one: tensor work, on the model's thread.
        model_thread = self.runner.model_thread if self.is_open(event.session_id) else None
        run_thread(self.app, self.delete, event.session_id, group="store", executor=model_thread)

    def delete(self, session_id: int) -> None:
        """In a worker."""
        try:
            was_open = self.app.controller.delete_session(session_id)
        except StoreError as err:
            self.runner.from_worker(self.runner.report_error, "Could not delete the session", err)
            return
        self.runner.from_worker(self.deleted, session_id, was_open)
        self.list_sessions()

    async def deleted(self, session_id: int, was_open: bool) -> None:
        self.app.notify(f"Session {session_id} deleted.")
        if was_open:
            await self.show_new()

    # -- resume ------------------------------------------------------------------------
    def resume(self, session_id: int) -> None:
        if not self.runner.ensure_idle():
            return
        self.runner.set_activity(f"restoring session {session_id}")
        self.runner.run(self.run_resume, session_id)

    def run_resume(self, session_id: int) -> None:
        """The model worker of a resume."""
        try:
            outcome = self.app.controller.resume(session_id)
        except SnapshotMismatch as err:
            self.runner.from_worker(self.resume_refused, session_id, str(err))
            return
        except Exception as err:
            self.runner.from_worker(self.runner.failed, f"Could not open session {session_id}", err)
            return
        self.runner.from_worker(self.resume_finished, outcome)

    async def resume_finished(self, outcome: ResumeOutcome) -> None:
        await self.show_resumed(outcome)
        self.runner.end_activity()

    async def show_resumed(self, outcome: ResumeOutcome) -> None:
        self.runner.last_speeds = Speeds()
        await self.show_transcript(outcome.messages)
        self.app.update_title()
        self.runner.refresh_status()
        described = outcome.info.describe() if outcome.info else "opened"
        await self.app.chat.message_list.add_notice(f"Session {outcome.session_id}: {described}")
        self.app.notify(described.capitalize(), title=f"Session {outcome.session_id}", markup=False)

    async def show_transcript(self, messages: list[dict[str, str]]) -> None:
        """The conversation list shows `messages` (a resumed or continued transcript)."""
        message_list = self.app.chat.message_list
        await message_list.clear()
        for message in messages:
            if message["role"] == "user":
                question, document_chars = split_long_user_text(message["content"])
                labels = [f"Document · {document_chars:,} characters"] if document_chars else []
                await message_list.add_user(question, labels)
            elif message["role"] == "assistant":
                await message_list.add_assistant(message["content"])
        message_list.scroll_end(animate=False)

    # -- a snapshot that does not fit: rebuild from the transcript -------------------------
    def resume_refused(self, session_id: int, reason: str) -> None:
        self.runner.end_activity()
        self.app.notify(
            f"Session {session_id} was not restored: {reason}.",
            title="Cannot restore",
            severity="warning",
            timeout=12,
            markup=False,
        )
        question = (
            f"Session {session_id} cannot be restored from its saved cache: {reason}.\n\n"
            "Rebuild it from the transcript? Every message is read again through the method "
            "(progress shown, Esc stops); the transcript itself is safe either way."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.rebuild_saved(session_id, reason)

        self.app.push_screen(ConfirmDialog(question, "Rebuild", "Not now"), answered)

    def rebuild_saved(self, session_id: int, reason: str) -> None:
        if not self.runner.ensure_idle():
            return
        cancel = threading.Event()
        self.runner.set_activity(f"rebuilding session {session_id}", cancel)
        self.app.chat.show_progress(f"Rebuilding session {session_id}…")
        self.runner.run(self.run_rebuild_saved, session_id, reason, cancel)

    def run_rebuild_saved(self, session_id: int, reason: str, cancel: threading.Event) -> None:
        """The model worker of a saved session's rebuild."""
        from_worker = self.runner.from_worker

        def on_progress(done: int, total: int) -> None:
            label = f"Rebuilding session {session_id}: {done:,} / {total:,} tokens"
            from_worker(self.app.chat.show_progress, label, done, total)

        try:
            outcome = self.app.controller.rebuild_saved(session_id, reason, on_progress, cancel)
        except Cancelled:
            from_worker(self.rebuild_saved_stopped, session_id)
            return
        except Exception as err:
            from_worker(self.runner.failed, f"Could not rebuild session {session_id}", err)
            return
        from_worker(self.resume_finished, outcome)

    def rebuild_saved_stopped(self, session_id: int) -> None:
        self.runner.end_activity()
        self.app.notify(f"Rebuild stopped; session {session_id} stays as it was saved.", severity="warning")

    # -- branches (F3): edit and resend, or regenerate, an earlier message ---------------
    def pick_branch(self) -> None:
        """F3: the picker of the open conversation's user messages."""
        if not self.runner.ensure_idle():
            return
        messages = self.app.controller.user_messages()
        if not messages:
            self.app.notify("No message of yours to branch from yet: send one first.")
            return
        if self.current_id() is None:
            why = "sessions are not saved in this run" if not self.app.has_store else "it is saved with its next answer"
            self.app.notify(
                f"This conversation is not saved yet ({why}); a branch starts from a saved one.", severity="warning"
            )
            return
        self.app.push_screen(BranchPicker(messages), self.branch_picked)

    def branch_picked(self, choice: BranchChoice | None) -> None:
        if choice is None:
            return
        if choice.action == "edit":
            self.app.push_screen(
                EditMessage(choice.turn, choice.question, choice.document), partial(self.edited, choice)
            )
        else:
            self.start_branch(choice.turn, choice.question, choice.document)

    def edited(self, choice: BranchChoice, text: str | None) -> None:
        if text:
            self.start_branch(choice.turn, text, choice.document)

    def start_branch(self, turn: int, question: str, document: str | None) -> None:
        """Branch the open session before message `turn`, then send `question` there."""
        session_id = self.current_id()
        if session_id is None or not self.runner.ensure_idle():
            return
        cancel = threading.Event()
        self.runner.set_activity(f"branching session {session_id}", cancel)
        self.app.chat.show_progress(f"Branching session {session_id} before message {turn}…")
        self.runner.run(self.run_branch, session_id, turn - 1, question, document, cancel)

    def run_branch(
        self, session_id: int, at: int, question: str, document: str | None, cancel: threading.Event
    ) -> None:
        """The model worker of a branch: its cache copied, or rebuilt from the transcript."""
        from_worker = self.runner.from_worker

        def on_progress(done: int, total: int) -> None:
            label = f"Rebuilding the branch's cache: {done:,} / {total:,} tokens"
            from_worker(self.app.chat.show_progress, label, done, total)

        try:
            outcome = self.app.controller.branch(session_id, at, on_progress, cancel)
        except Cancelled:
            from_worker(self.branch_stopped, session_id)
            return
        except Exception as err:
            from_worker(self.runner.failed, f"Could not branch session {session_id}", err)
            return
        from_worker(self.branch_finished, outcome, question, document)

    async def branch_finished(self, outcome: BranchOutcome, question: str, document: str | None) -> None:
        """The branch is open: show what it shares, then send the message in it."""
        opened = outcome.opened
        assert opened is not None
        self.runner.last_speeds = Speeds()
        await self.show_transcript(opened.messages)
        self.app.update_title()
        where = f"Session {outcome.session_id}: a branch of session {outcome.origin_id} at turn {outcome.at}"
        await self.app.chat.message_list.add_notice(f"{where} ({outcome.how})")
        self.app.notify(
            f"{outcome.how.capitalize()}; session {outcome.origin_id} stays as it was.",
            title=f"Branch: session {outcome.session_id}",
            markup=False,
        )
        self.runner.end_activity()
        documents = [AttachedDocument(1, document)] if document else []
        answer = await self.app.turns.show_question(question, documents)
        self.app.turns.start_turn(question, documents, answer)

    def branch_stopped(self, session_id: int) -> None:
        self.runner.end_activity()
        self.app.notify(
            f"Branch stopped; no branch was made and session {session_id} stays open as it was.", severity="warning"
        )
