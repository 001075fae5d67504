"""`/recall` in the app, on the real embedded model, driven headless with Pilot."""

from __future__ import annotations

import asyncio

import pytest

from kvchat.tui.screens import MemoryScreen

from .conftest import APP_SIZE, make_app, notifications, send_and_wait, wait_for

pytestmark = pytest.mark.slow


def test_slash_recall_rebuilds_the_cache_with_a_tier_on_disk_that_the_status_bar_shows(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=6)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Hi there, how are you today?")
            bar = app.chat.status_bar
            assert "on disk" not in bar.plain_text
            calls = engine.forward_calls
            await send_and_wait(pilot, "/recall 32")
            session = app.conversation.session
            assert session.cache.recall == 32 and engine.forward_calls > calls  # rebuilt, not just noted
            assert session.cache.cold_bytes() > 0
            assert any(n.startswith("Rebuilt ") for n in notifications(app)), notifications(app)
            await wait_for(pilot, lambda: "on disk" in bar.plain_text, 10, "the status bar to show the disk tier")
            assert "recall 32/head" in bar.plain_text
            assert store.get_session(app.conversation.session_id).params["recall"] == 32  # saved with the cache
            await send_and_wait(pilot, "Tell me more.")
            assert app.last_result.metrics.recalled > 0 and app.last_result.metrics.cold_bytes > 0
            assert app.ui_errors == []

    asyncio.run(body())


def test_slash_recall_off_drops_the_tier_and_a_bad_value_changes_nothing(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=4, recall=32)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Hi there, how are you today?")
            bar = app.chat.status_bar
            await wait_for(pilot, lambda: "on disk" in bar.plain_text, 10, "the disk tier in the status bar")
            await send_and_wait(pilot, "/recall lots")
            assert any("/recall" in n and "or off" in n for n in notifications(app)), notifications(app)
            assert app.conversation.session.cache.recall == 32
            assert app.chat.chat_input.question == "/recall lots"  # kept to be fixed
            await pilot.press("ctrl+u")
            await send_and_wait(pilot, "/recall off")
            assert app.conversation.session.cache.recall == 0
            await wait_for(pilot, lambda: "on disk" not in bar.plain_text, 10, "the disk tier to leave the status bar")
            await send_and_wait(pilot, "/recall")
            assert any(n.startswith("off") for n in notifications(app)), notifications(app)
            assert app.ui_errors == []

    asyncio.run(body())


def test_the_memory_map_shows_what_the_last_answer_recalled(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=6, recall=32)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Hi there, how are you today?")
            await pilot.press("f2")
            await wait_for(pilot, lambda: getattr(app.screen, "report", None) is not None, what="the memory map")
            screen = app.screen
            assert isinstance(screen, MemoryScreen)
            report = screen.report
            assert report.cold_bytes > 0 and report.recalled > 0 and report.recalled_tokens > 0
            assert app.ui_errors == []

    asyncio.run(body())


def test_the_palette_offers_recall_on_and_off(engine, store):
    app = make_app(engine, store)
    titles = [command.title for command in app.palette_commands()]
    assert "Recall: 32 tokens per KV head" in titles and "Recall: off" in titles
