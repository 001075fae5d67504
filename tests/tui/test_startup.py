"""Start-up: the first frame comes at once, with "loading model…" in the status bar,
while the model loads in a worker. A gated loader (it returns the real engine only
when the test releases it) makes the loading window deterministic; one test uses the
real loader."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvchat.settings import SamplingSettings
from kvchat.tui.app import LOADING, KvchatApp

from .conftest import APP_SIZE, send_and_wait, small_settings, type_text, wait_for, wait_idle

pytestmark = pytest.mark.slow


class GatedLoader:
    """Loads (returns) the real engine only once `release` is set."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.release = threading.Event()
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if not self.release.wait(120):
            raise TimeoutError("the test never released the loader")
        return self.engine


def app_with(loader, store, *, reopen_last: bool = False) -> KvchatApp:
    return KvchatApp(loader, store, small_settings(), SamplingSettings(max_new_tokens=8), reopen_last=reopen_last)


def test_first_frame_says_loading_model_before_the_model_is_ready(engine, store):
    loader = GatedLoader(engine)

    async def body():
        app = app_with(loader, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await pilot.pause()
            assert LOADING in app.chat.status_bar.plain_text
            assert app.conversation is None  # no session before the model
            assert app.chat.chat_input.prompt_area.has_focus  # the editor takes keys already
            loader.release.set()
            await wait_idle(pilot)
            assert LOADING not in app.chat.status_bar.plain_text
            assert "window · budget 16" in app.chat.status_bar.plain_text
            assert app.conversation is not None and loader.calls == 1
            assert app.ui_errors == []

    try:
        asyncio.run(body())
    finally:
        loader.release.set()


def test_a_message_sent_while_loading_is_answered_once_the_model_is_ready(engine, store):
    loader = GatedLoader(engine)

    async def body():
        app = app_with(loader, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await type_text(pilot, "Name a colour.")
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert app.chat.chat_input.question == ""  # accepted
            assert app.chat.message_list.user_messages()[-1].text == "Name a colour."
            assert app.activity == LOADING and app.chat.message_list.assistant_messages()[-1].text == ""
            assert store.list_sessions() == []  # nothing answered yet
            loader.release.set()
            await wait_for(pilot, lambda: app.last_result is not None and app.activity is None, 60, "the answer")
            answer = app.chat.message_list.assistant_messages()[-1]
            assert answer.text.strip() and answer.text == app.conversation.session.messages[-1]["content"]
            rows = store.list_sessions()
            assert len(rows) == 1 and rows[0].message_count == 2
            assert app.ui_errors == []

    try:
        asyncio.run(body())
    finally:
        loader.release.set()


def test_a_message_sent_while_loading_follows_the_reopened_session(engine, store):
    async def first_run():
        app = app_with(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Name a colour.")

    asyncio.run(first_run())
    saved_id = store.list_sessions()[0].id
    loader = GatedLoader(engine)

    async def body():
        app = app_with(loader, store, reopen_last=True)
        async with app.run_test(size=APP_SIZE) as pilot:
            await type_text(pilot, "Another one?")
            await pilot.press("enter")
            await pilot.pause(0.2)
            loader.release.set()
            await wait_for(pilot, lambda: app.last_result is not None and app.activity is None, 60, "the answer")
            assert app.conversation.session_id == saved_id
            users = [m.text for m in app.chat.message_list.user_messages()]
            assert users == ["Name a colour.", "Another one?"]  # the transcript, then the waiting message
            assert store.get_session(saved_id).message_count == 4
            assert app.ui_errors == []

    try:
        asyncio.run(body())
    finally:
        loader.release.set()


@pytest.mark.parametrize("quit_key", ["ctrl+q", "ctrl+c"])
def test_quitting_while_the_model_loads_exits_at_once(engine, store, quit_key):
    loader = GatedLoader(engine)

    async def body():
        app = app_with(loader, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await pilot.pause()
            assert app.activity == LOADING
            await pilot.press(quit_key)
            await wait_for(pilot, lambda: not app.is_running, 5, "the app to quit")
        assert not loader.release.is_set()  # it quit without waiting for the model
        assert app.ui_errors == [] and store.list_sessions() == []

    try:
        asyncio.run(body())
    finally:
        loader.release.set()


def test_the_real_loader_loads_the_embedded_model_in_a_worker(store):
    from kvchat.model.engine import Engine
    from kvchat.model.loading import load_model

    def load(on_status):  # the app's loader signature: one-off notes go to the status bar
        return Engine(load_model(on_status=on_status))

    # The first frame while loading is checked with the gated loader above: the real one
    # loads the converted copy in a second or two, so it may be ready before any pause.
    async def body():
        app = app_with(load, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await wait_for(pilot, lambda: app.activity is None, 240, "the model to load")
            await send_and_wait(pilot, "Say hi.")
            assert app.chat.message_list.assistant_messages()[-1].text.strip()
            assert app.ui_errors == []

    asyncio.run(body())
