"""The sessions screen's search box (Ctrl+S, then /), driven headless with Pilot on a real
store. The fake engine stands in for the model: searching never touches it."""

from __future__ import annotations

import asyncio
import threading

from textual.widgets import DataTable

from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens import ConfirmDialog, SessionsScreen
from kvchat.tui.screens.sessions import SearchBox

from .conftest import APP_SIZE, notifications, type_text, wait_for
from .fakes import FakeEngine


def fake_app(store) -> KvchatApp:
    settings = CacheSettings(method="window", budget="1024", window=1024, sinks=4)
    return KvchatApp(FakeEngine(), store, settings, SamplingSettings(max_new_tokens=16), reopen_last=False)


def saved_chats(store) -> dict[str, int]:
    """Three sessions with messages, created oldest first."""
    ids = {}
    for title, messages in (
        ("Dragons", ["Tell me about a dragon who reads.", "The dragon read every book in the library."]),
        ("Capitals", ["What is the capital of France?", "Paris is the capital of France."]),
        ("Libraries", ["Which library has the most books?", "The Library of Congress, by most counts."]),
    ):
        sid = store.create_session(title, "fake", "window", {})
        for role, text in zip(("user", "assistant"), messages):
            store.add_message(sid, role, text, [1])
        ids[title] = sid
    return ids


async def open_sessions(pilot) -> SessionsScreen:
    app = pilot.app
    await wait_for(pilot, lambda: app.activity is None, 10, "the (fake) model to load")
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), 10, "the sessions list")
    await pilot.pause()
    return app.screen


def shown(screen: SessionsScreen) -> list[int]:
    return [row.id for row in screen.rows]


def cells(screen: SessionsScreen) -> list[list[str]]:
    table = screen.query_one(DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def test_the_search_box_filters_the_list_as_you_type_and_escape_restores_it(store):
    chats = saved_chats(store)
    everything = [chats["Libraries"], chats["Capitals"], chats["Dragons"]]
    searched_in: list[threading.Thread] = []

    async def body():
        app = fake_app(store)
        async with app.run_test(size=APP_SIZE) as pilot:
            real_search = app.controller.search_sessions

            def recording_search(text: str):
                searched_in.append(threading.current_thread())
                return real_search(text)

            app.controller.search_sessions = recording_search
            screen = await open_sessions(pilot)
            assert shown(screen) == everything
            assert isinstance(app.focused, DataTable)  # the list has the keys, as before
            await pilot.press("slash")
            assert isinstance(app.focused, SearchBox)

            await type_text(pilot, "libr")  # a prefix: library, libraries
            await wait_for(pilot, lambda: shown(screen) == [chats["Libraries"], chats["Dragons"]], 10, "the matches")
            rows = cells(screen)  # the title above the text around the match; newest first
            assert [row[1] for row in rows] == [
                "Libraries\nWhich library has the most books?",
                "Dragons\nThe dragon read every book in the library.",
            ]
            assert [screen.rows[1].snippet[a:b] for a, b in screen.rows[1].marks] == ["library"]
            assert all(thread is not threading.main_thread() for thread in searched_in)  # workers only

            # More words narrow it; query syntax is plain text and never an error.
            await type_text(pilot, 'ary "(dragon')
            await wait_for(pilot, lambda: shown(screen) == [chats["Dragons"]], 10, "the narrower match")
            await pilot.press(*" AND -*")
            await wait_for(pilot, lambda: screen.search_text.endswith("AND -*") and not screen.rows, 10, "no match")
            empty = screen.query_one("#sessions-empty")
            assert empty.display and "AND -*" in str(empty.render())
            assert app.ui_errors == [] and notifications(app) == []

            # Clearing the box brings the whole list back; so does Escape, which then closes.
            for _ in range(len(screen.query_one(SearchBox).value)):
                await pilot.press("backspace")
            await wait_for(pilot, lambda: shown(screen) == everything, 10, "the whole list")
            assert cells(screen)[0][2] == "window"  # the list's own columns again
            await type_text(pilot, "paris")
            await wait_for(pilot, lambda: shown(screen) == [chats["Capitals"]], 10, "the match")
            await pilot.press("escape")
            assert app.screen is screen and shown(screen) == everything
            assert screen.query_one(SearchBox).value == "" and isinstance(app.focused, DataTable)
            await pilot.pause(0.4)  # a search still pending must not come back
            assert shown(screen) == everything
            await pilot.press("escape")
            assert not isinstance(app.screen, SessionsScreen)
            assert app.ui_errors == []

    asyncio.run(body())


def test_the_keys_of_the_list_work_on_the_matches(store):
    chats = saved_chats(store)
    resumed: list[int] = []

    async def body():
        app = fake_app(store)
        async with app.run_test(size=APP_SIZE) as pilot:
            app.sessions.resume = resumed.append  # what Enter asks for; the fake model cannot restore
            screen = await open_sessions(pilot)
            await pilot.press("slash")
            await type_text(pilot, "the")
            await wait_for(
                pilot, lambda: len(screen.rows) == 3 and hasattr(screen.rows[0], "snippet"), 10, "the matches"
            )

            # Rename from the matches: the filtered list follows.
            await pilot.press("tab")
            assert isinstance(app.focused, DataTable)
            await pilot.press("down", "r")
            await type_text(pilot, "Capitals renamed")
            await pilot.press("enter")
            # Renamed, it is the newest: first in the matches, the cursor still on it.
            await wait_for(pilot, lambda: screen.rows and screen.rows[0].title == "Capitals renamed", 10, "the rename")
            assert screen.search_text == "the" and cells(screen)[0][1].startswith("Capitals renamed\n")
            assert screen.selected().id == chats["Capitals"]
            assert store.get_session(chats["Capitals"]).title == "Capitals renamed"

            # Delete from the matches: gone from the list and from the index.
            await pilot.press("d")
            assert isinstance(app.screen, ConfirmDialog) and "Capitals renamed" in app.screen.question
            await pilot.press("y")
            await wait_for(pilot, lambda: shown(screen) == [chats["Libraries"], chats["Dragons"]], 10, "the delete")
            assert store.search("capital") == []

            # Up/Down move the list's cursor from the box; Enter resumes the one picked.
            await pilot.press("slash")
            assert isinstance(app.focused, SearchBox)
            await pilot.press("up", "down")
            await pilot.press("enter")
            await wait_for(pilot, lambda: resumed == [chats["Dragons"]], 10, "the resume")
            assert not isinstance(app.screen, SessionsScreen)

            # n (new) from the list still works; typed into the box it is just a letter.
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), 10, "the sessions list")
            screen = app.screen
            await pilot.press("slash", "n")
            assert app.screen is screen and screen.query_one(SearchBox).value == "n"
            await pilot.press("escape", "n")
            assert not isinstance(app.screen, SessionsScreen)
            assert app.ui_errors == []

    asyncio.run(body())


def test_help_lists_the_search_key(store):
    async def body():
        app = fake_app(store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await pilot.press("f1")
            await pilot.pause()
            assert "Sessions list (Ctrl+S): / — Search." in app.screen.plain_text()

    asyncio.run(body())
