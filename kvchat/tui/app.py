"""KvchatApp: the Textual chat app, and `run_app`, which the CLI calls.

The app draws, routes keys and owns the workflows; what the chat does lives in
`kvchat.chat.controller.Controller`. Each workflow is an object of `kvchat.tui.flows` that
the app owns and hands its keys, actions and messages to:

- `runner` (`ModelRunner`): the model worker's plumbing: loading the model at start,
  what the model is doing, stop and quit, the status bar, reporting back from workers;
- `turns` (`TurnsFlow`): the editor: slash commands, attached documents, sending;
- `files` (`FilesFlow`): attaching a file or folder: reading it (Esc stops), confirming a folder;
- `methods` (`MethodsFlow`): switching the method, rebuilding the cache;
- `sessions` (`SessionsFlow`): saved sessions (Ctrl+S), a new session, start-up resume,
  branches (F3: edit and resend an earlier message, or regenerate its answer);
- `compare` (`CompareFlow`): Ctrl+G, the last question under several methods;
- `copier` (`kvchat.tui.copying.Copier`): F4 and F5 copy an answer or its code.

Every controller call that touches the model or the database runs in a Textual thread
worker, never on the UI thread; model work runs one worker at a time (group "model").
Start-up: the first frame is drawn at once and the model loads in a worker, with
"loading model…" in the status bar; a message sent meanwhile waits for the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from textual.app import App
from textual.binding import Binding, BindingType

from kvchat.chat.controller import Controller, EngineLoader
from kvchat.chat.controller import methods as all_methods
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.tui.commands import KvchatCommands, PaletteCommand, run_action_later
from kvchat.tui.copying import Copier
from kvchat.tui.flows import (
    LOADING,
    NO_MODEL,
    CompareFlow,
    FilesFlow,
    MethodsFlow,
    ModelRunner,
    SessionsFlow,
    TurnsFlow,
)
from kvchat.tui.flows.runner import run_thread
from kvchat.tui.screens import BranchPicker, ChatScreen, CompareScreen, HelpScreen, MemoryScreen, SessionsScreen
from kvchat.tui.slash import help_lines
from kvchat.tui.widgets import AssistantMessage, ChatInput, PromptArea

if TYPE_CHECKING:
    from kvchat.chat.controller import Conversation
    from kvchat.storage.db import Store
    from kvchat.turns import MemoryReport, TurnResult

__all__ = ["LOADING", "NO_MODEL", "KvchatApp", "run_app"]

EDITOR_NOTES = [
    "Editor: Enter sends, Ctrl+J (or Alt+Enter) inserts a newline; the editor keeps its own keys:",
    "  ctrl+a/e line start/end · ctrl+w/u/k delete word/to start/to end · ctrl+z/y undo/redo",
    "  ctrl+x/c/v cut/copy/paste.",
    "Documents: a long paste becomes a chip (“Document 1 · 12,345 tokens”) put before your question;",
    "  /file PATH attaches a file: text, PDF, HTML, Word (.docx) or EPUB, or a folder's files",
    "  (/file PATH QUESTION leaves the question in the editor); a pasted path offers to attach it;",
    "  Esc stops a reading; Backspace in an empty editor removes the last chip.",
    *help_lines(),
]


def as_bindings(bindings: list[BindingType]) -> list[Binding]:
    """A class's BINDINGS as typed: Textual allows tuples there, kvchat writes `Binding`s only."""
    return cast("list[Binding]", bindings)


class KvchatApp(App[None]):
    # Absolute, so that subclasses defined elsewhere (tests) still find it.
    CSS_PATH = Path(__file__).with_name("styles.tcss")
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {KvchatCommands}

    # The help screen and the command palette are built from this list.
    BINDINGS = [
        Binding(
            "escape",
            "stop",
            "Stop",
            tooltip="stop generating (the partial answer is kept), a rebuild, or the reading of a file",
        ),
        Binding(
            "ctrl+c",
            "interrupt",
            "Stop",
            show=False,
            priority=True,
            tooltip="same as Esc while the model works; otherwise copies in the editor",
        ),
        Binding("ctrl+t", "cycle_method", "Next method", tooltip="cycle the compression method; takes effect at once"),
        Binding("ctrl+o", "pick_method", "Methods", tooltip="choose the method from a list with descriptions"),
        Binding(
            "ctrl+r",
            "rebuild",
            "Rebuild",
            show=False,
            tooltip="re-read the whole transcript through the current method (faithful state; Esc stops)",
        ),
        Binding(
            "ctrl+g",
            "compare",
            "Compare",
            show=False,
            tooltip="ask the last question again under methods you pick, answers side by side; continue with one",
        ),
        Binding("ctrl+s", "sessions", "Sessions", tooltip="list, resume, rename or delete saved sessions"),
        Binding("ctrl+n", "new_session", "New", tooltip="start a new session (the current one stays saved)"),
        Binding(
            "f3",
            "branch",
            "Branch",
            show=False,
            tooltip="pick an earlier message of yours to edit and resend, or to regenerate its answer, in a new "
            "session that shares the conversation before it (the original stays saved)",
        ),
        Binding(
            "f2",
            "memory",
            "Memory",
            tooltip="the memory map: how much of each message and document the cache still holds, per layer too",
        ),
        Binding(
            "f4",
            "copy_answer",
            "Copy",
            show=False,
            tooltip="copy the focused answer (click it or Tab to it), else the last "
            "one, to the clipboard (through the terminal: OSC 52)",
        ),
        Binding(
            "f5",
            "copy_code",
            "Copy code",
            show=False,
            tooltip="copy the last code block of that answer; again: the block before it",
        ),
        Binding("f1", "help", "Help", tooltip="this screen"),
        Binding("ctrl+p", "command_palette", "Palette", show=False, tooltip="search every action"),
        Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="stop the model, save, and quit"),
    ]
    # Actions that only make sense on the chat screen (not under a modal screen).
    CHAT_ACTIONS = {
        "cycle_method",
        "pick_method",
        "rebuild",
        "sessions",
        "new_session",
        "help",
        "memory",
        "compare",
        "branch",
        "copy_answer",
        "copy_code",
    }
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
        system: str | None = None,
    ) -> None:
        """`engine`: a kvchat Engine, or a callable that loads one (the CLI passes a
        loader so the first frame need not wait for the model; snapshot tests pass a
        fake engine). `store` None: nothing is saved or listed; otherwise the one store
        of the process, used from every worker (kvchat.storage.db is thread-safe). `reopen_last`: open the most
        recent session when `resume_id` is None. `system`: the system prompt of new sessions."""
        super().__init__()
        self.controller = Controller(engine, store, settings, sampling, system=system, on_disk_note=self.disk_note)
        self.runner = ModelRunner(self)
        self.turns = TurnsFlow(self)
        self.files = FilesFlow(self)
        self.methods = MethodsFlow(self)
        self.sessions = SessionsFlow(self, resume_id, reopen_last)
        self.compare = CompareFlow(self)
        self.copier = Copier(self)

    def disk_note(self, line: str) -> None:
        """From the worker that saved: what the disk budget dropped, as a notification."""
        self.runner.from_worker(
            lambda: self.notify(line[:1].upper() + line[1:], title="Disk budget", timeout=12, markup=False)
        )

    # -- what the flows and the tests read ---------------------------------------------
    @property
    def chat(self) -> ChatScreen:
        return self.get_screen("chat")  # type: ignore[return-value]

    @property
    def conversation(self) -> Conversation | None:
        return self.controller.conversation

    @property
    def sampling(self) -> SamplingSettings:
        return self.controller.sampling

    @property
    def has_store(self) -> bool:
        return self.controller.store is not None

    @property
    def activity(self) -> str | None:
        """What the model worker is doing; None when idle."""
        return self.runner.activity

    @property
    def last_result(self) -> TurnResult | None:
        """The last turn's result."""
        return self.turns.last_result

    @property
    def ui_errors(self) -> list[BaseException]:
        """UI callbacks from workers that failed (tests assert none)."""
        return self.runner.ui_errors

    def current_method(self) -> str:
        return self.controller.method

    # -- start -------------------------------------------------------------------------
    async def on_mount(self) -> None:
        self.install_screen(ChatScreen(), "chat")
        await self.push_screen("chat")
        self.update_title()
        self.runner.start()

    def update_title(self) -> None:
        conv = self.conversation
        where = f"session {conv.session_id} · {conv.title}" if conv and conv.session_id is not None else "new session"
        self.sub_title = f"{self.controller.model_name} · {where}"

    def on_unmount(self) -> None:
        self.runner.unmount()

    # -- bindings ----------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        runner = self.runner
        if action in ("stop", "interrupt"):
            if action == "interrupt" and isinstance(self.screen, CompareScreen):
                return True if runner.can_stop() else None  # Ctrl+C stops a comparison like Esc
            if not isinstance(self.screen, ChatScreen):
                return False  # under a dialog, Esc closes the dialog
            if self.files.can_stop():
                return True  # a file being read
            if action == "interrupt" and runner.activity == LOADING:
                return True  # nothing to stop yet: Ctrl+C quits
            # None: shown dimmed, and the key falls through (ctrl+c then copies).
            return True if runner.can_stop() else None
        if action in self.MEMORY_ACTIONS and isinstance(self.screen, MemoryScreen):
            return True
        if action in self.CHAT_ACTIONS and not isinstance(self.screen, ChatScreen):
            return False
        return True

    def action_stop(self) -> None:
        if not self.files.stop():
            self.runner.stop()

    async def action_interrupt(self) -> None:
        if not self.files.stop():
            await self.runner.interrupt()

    async def action_quit(self) -> None:
        """Stop the model, let its worker save what was said, then exit."""
        await self.runner.quit()

    def action_cycle_method(self) -> None:
        self.methods.cycle()

    def action_pick_method(self) -> None:
        self.methods.pick()

    def action_rebuild(self) -> None:
        self.methods.rebuild()

    def action_compare(self) -> None:
        self.compare.pick()

    def action_sessions(self) -> None:
        self.sessions.open_list()

    def action_new_session(self) -> None:
        self.sessions.new()

    def action_branch(self) -> None:
        self.sessions.pick_branch()

    def action_copy_answer(self) -> None:
        self.copier.copy_answer()

    def action_copy_code(self) -> None:
        self.copier.copy_code()

    # -- messages from the screens and widgets -------------------------------------------
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        await self.turns.submitted(event)

    def on_chat_input_document_attached(self, event: ChatInput.DocumentAttached) -> None:
        self.turns.document_attached(event)

    def on_chat_input_path_pasted(self, event: ChatInput.PathPasted) -> None:
        self.files.path_pasted(event)

    def on_sessions_screen_rename_requested(self, event: SessionsScreen.RenameRequested) -> None:
        self.sessions.rename_requested(event)

    def on_sessions_screen_delete_requested(self, event: SessionsScreen.DeleteRequested) -> None:
        self.sessions.delete_requested(event)

    def on_compare_screen_stop_requested(self, event: CompareScreen.StopRequested) -> None:
        self.action_stop()

    # -- the memory map ----------------------------------------------------------------
    def action_memory(self) -> None:
        self.push_screen(MemoryScreen())
        self.refresh_memory()

    def memory_screen(self) -> MemoryScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, MemoryScreen)), None)

    def refresh_memory(self) -> None:
        """New numbers for the memory map, when it is open (read in a worker)."""
        if self.memory_screen() is not None and not self.runner.shutting_down:
            self.read_memory()

    def read_memory(self) -> None:
        """On the model's thread (`ModelRunner.model_thread`): the report reads the cache's
        tensors, and only that thread may start PyTorch's parallel work."""
        run_thread(self, self._read_memory, group="memory", exclusive=True, executor=self.runner.model_thread)

    def _read_memory(self) -> None:
        try:
            report = self.controller.memory_report()
        except Exception as err:
            self.runner.from_worker(self.runner.report_error, "Could not read the memory map", err)
            return
        self.runner.from_worker(self.show_memory, report)

    def show_memory(self, report: MemoryReport | None) -> None:
        screen = self.memory_screen()
        if screen is not None:
            screen.show(report)

    # -- help and palette --------------------------------------------------------------
    def action_help(self) -> None:
        sections = [
            ("Chat", as_bindings(self.BINDINGS)),
            ("Editor", as_bindings(PromptArea.BINDINGS)),
            ("Sessions list (Ctrl+S)", as_bindings(SessionsScreen.BINDINGS)),
            ("Branch (F3)", as_bindings(BranchPicker.BINDINGS)),
            ("A focused answer (click it, or Tab to it)", as_bindings(AssistantMessage.BINDINGS)),
            ("Compare view (Ctrl+G)", as_bindings(CompareScreen.BINDINGS)),
        ]
        self.push_screen(HelpScreen(sections, EDITOR_NOTES))

    def palette_commands(self) -> Iterator[PaletteCommand]:
        seen: set[str] = set()
        for binding in as_bindings(self.BINDINGS):
            if binding.action in seen or binding.action in ("command_palette", "interrupt"):
                continue
            seen.add(binding.action)
            yield PaletteCommand(binding.description, binding.tooltip, run_action_later(self, binding.action))
        yield PaletteCommand("Attach a file", "type /file PATH in the editor", self.files.start_command)
        for name, description in all_methods():
            yield PaletteCommand(f"Method: {name}", description, partial(self.methods.switch, name))
        # The recall tier at the measured setting, and off (`/recall N` for other values).
        yield PaletteCommand(
            "Recall: 32 tokens per KV head",
            "keep every cold token on disk and recall the 32 each step needs (rebuilds the cache; decode slows)",
            partial(self.methods.recall, "32"),
        )
        yield PaletteCommand(
            "Recall: off", "drop the tier on disk (rebuilds the cache)", partial(self.methods.recall, "0")
        )


def run_app(
    engine: Any | EngineLoader,
    store: Store | None,
    settings: CacheSettings,
    sampling: SamplingSettings,
    resume_id: int | None,
    *,
    system: str | None = None,
) -> None:
    """Run the chat app until the user quits (the CLI's default command). `engine`
    may be a loader: the app then draws at once and loads the model in a worker.
    `system`: the system prompt of new sessions."""
    KvchatApp(engine, store, settings, sampling, resume_id, system=system).run()
