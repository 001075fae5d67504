"""Every piece of model work in the app runs on one thread of its own (kvchat/tui/flows/
runner.py: PyTorch's parallel regions slow down once two threads have started them)."""

from __future__ import annotations

import asyncio
import threading

from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.tui.app import KvchatApp
from kvchat.tui.flows.runner import MODEL_THREAD
from kvchat.tui.screens import MemoryScreen

from .conftest import wait_for
from .fakes import FakeEngine

SIZE = (100, 32)


def test_turns_the_memory_map_and_a_new_session_run_on_the_one_model_thread():
    async def body():
        engine = FakeEngine()
        app = KvchatApp(engine, None, CacheSettings(), SamplingSettings(max_new_tokens=8), reopen_last=False)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.activity is None, what="the (fake) model to load")
            for question in ("first", "second"):
                await pilot.press(*question)
                await pilot.press("enter")
                await wait_for(pilot, lambda: app.activity is None, what=f"the answer to {question!r}")
            await pilot.press("f2")
            session = app.conversation.session
            await wait_for(pilot, lambda: len(session.threads) == 3, what="the memory map to be read")
            assert isinstance(app.screen, MemoryScreen)
            assert len(set(session.threads)) == 1, session.threads
            assert session.threads[0].startswith(MODEL_THREAD)
            assert session.threads[0] != threading.main_thread().name
            await pilot.press("escape")
            await pilot.press("ctrl+n")
            await wait_for(
                pilot, lambda: app.conversation.session is not session and app.activity is None, what="a new session"
            )
            assert engine.new_session_threads[-1] == session.threads[0]

    asyncio.run(body())
