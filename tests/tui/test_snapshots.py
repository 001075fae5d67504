"""Pictures of the main screens (pytest-textual-snapshot). A fake engine with frozen
metrics keeps them deterministic; update with `pytest tests/tui --snapshot-update`."""

from __future__ import annotations

from textual import events

from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens import SessionsScreen

from .conftest import wait_for
from .fakes import FakeEngine

SIZE = (100, 32)
QUESTION = "What is the capital of France? [bold red]not styled[/]"


def fake_app(store=None) -> KvchatApp:
    settings = CacheSettings(method="window", budget="1024", window=1024, sinks=4)
    return KvchatApp(FakeEngine(), store, settings, SamplingSettings(max_new_tokens=64), reopen_last=False)


async def model_loaded(pilot) -> None:
    # The (fake) model loads in a worker.
    await wait_for(pilot, lambda: pilot.app.activity is None, what="the (fake) model to load")


async def one_turn(pilot) -> None:
    app = pilot.app
    app.chat.chat_input.prompt_area.cursor_blink = False
    await pilot.press(*QUESTION)
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.activity is None, what="the answer")
    app.clear_notifications()
    # A long paste waiting in the editor, shown as a chip with its token count.
    app.post_message(events.Paste("lorem ipsum dolor " * 700))

    def chip_counted() -> bool:
        documents = app.chat.chat_input.documents
        return bool(documents) and documents[0].tokens is not None

    await wait_for(pilot, chip_counted, what="the pasted document's chip and its token count")
    await pilot.press(*"Summarise it")
    await pilot.pause()


def test_main_screen_after_a_turn(snap_compare):
    assert snap_compare(fake_app(), run_before=one_turn, terminal_size=SIZE)


def test_method_picker(snap_compare):
    async def open_picker(pilot):
        await one_turn(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()

    assert snap_compare(fake_app(), run_before=open_picker, terminal_size=SIZE)


def test_sessions_list(snap_compare, tmp_path):
    from kvchat.storage.db import Store

    store = Store(tmp_path / "kvchat.db")
    for title, method in (("Paris and other capitals", "window"), ("Reading a long essay", "subgen")):
        store.create_session(title, "fake", method, {})

    async def open_sessions(pilot):
        pilot.app.chat.chat_input.prompt_area.cursor_blink = False
        await model_loaded(pilot)
        await pilot.press("ctrl+s")
        # The list is read in a worker.
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SessionsScreen), what="the sessions list")
        await pilot.pause(0.2)  # and the footer has settled on the dialog's keys

    try:
        assert snap_compare(fake_app(store), run_before=open_sessions, terminal_size=SIZE)
    finally:
        store.close()


def test_help_screen(snap_compare):
    async def open_help(pilot):
        pilot.app.chat.chat_input.prompt_area.cursor_blink = False
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(fake_app(), run_before=open_help, terminal_size=(100, 40))


def test_memory_map_in_80_by_24(snap_compare):
    async def open_map(pilot):
        await model_loaded(pilot)
        app = pilot.app
        app.chat.chat_input.prompt_area.cursor_blink = False
        await pilot.press(*"Hello")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.activity is None, what="the answer")
        app.clear_notifications()
        await pilot.press("f2")
        await wait_for(pilot, lambda: getattr(app.screen, "report", None) is not None, what="the memory map")
        await pilot.pause()

    assert snap_compare(fake_app(), run_before=open_map, terminal_size=(80, 24))


async def compared(pilot, pick: bool = True) -> None:
    """A turn, then Ctrl+G: the method picker, and (with `pick`) the compare view, done."""
    from kvchat.tui.screens import CompareMethodsPicker, CompareScreen

    app = pilot.app
    app.chat.chat_input.prompt_area.cursor_blink = False
    await model_loaded(pilot)
    await pilot.press(*"What is the capital of France?")
    await pilot.press("enter")
    await model_loaded(pilot)
    app.clear_notifications()
    await pilot.press("ctrl+g")
    await wait_for(pilot, lambda: isinstance(app.screen, CompareMethodsPicker), what="the compare picker")
    if pick:
        await pilot.press("c")
        await wait_for(
            pilot, lambda: isinstance(app.screen, CompareScreen) and not app.screen.running, what="the compared answers"
        )
    await pilot.pause(0.2)


def test_compare_method_picker(snap_compare):
    async def open_picker(pilot):
        await compared(pilot, pick=False)

    assert snap_compare(fake_app(), run_before=open_picker, terminal_size=SIZE)


def test_compare_view_side_by_side(snap_compare):
    assert snap_compare(fake_app(), run_before=compared, terminal_size=SIZE)


def test_compare_view_stacked_on_a_narrow_terminal(snap_compare):
    assert snap_compare(fake_app(), run_before=compared, terminal_size=(80, 24))
