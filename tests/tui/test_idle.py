"""An idle app schedules no animation (kvchat/tui/screens/chat.py, `hide_progress`)."""

from __future__ import annotations

import asyncio

from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.tui.app import KvchatApp

from .conftest import wait_for
from .fakes import FakeEngine


def test_the_hidden_progress_bar_does_not_animate():
    async def body():
        app = KvchatApp(FakeEngine(), None, CacheSettings(), SamplingSettings(max_new_tokens=8), reopen_last=False)
        async with app.run_test(size=(100, 32)) as pilot:
            await wait_for(pilot, lambda: app.activity is None, what="the (fake) model to load")
            bar = app.chat.progress_bar.query_one("#bar")  # the animated part of the progress bar
            assert not app.chat.progress_visible
            assert bar.auto_refresh is None
            app.chat.show_progress("Reading the document…")  # indeterminate while shown: it animates
            assert bar.auto_refresh is not None
            app.chat.hide_progress()
            assert bar.auto_refresh is None

    asyncio.run(body())
