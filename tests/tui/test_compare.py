"""Compare methods in the app (Ctrl+G), on the real embedded model, driven with Pilot."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvchat.tui.screens import CompareMethodsPicker, CompareScreen, HelpScreen

from .conftest import APP_SIZE, make_app, notifications, send_and_wait, wait_for, wait_idle

pytestmark = pytest.mark.slow

# The prompt is small, so with `auto` it is one exact prefill, forked to each method.
EXACT = dict(prefill_mode="auto")


async def compare_with_defaults(pilot) -> CompareScreen:
    """Ctrl+G, accept the preselected methods, wait for every answer."""
    app = pilot.app
    await pilot.press("ctrl+g")
    await wait_for(pilot, lambda: isinstance(app.screen, CompareMethodsPicker), what="the method picker")
    await pilot.press("c")
    await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="the compare view")
    screen = app.screen
    await wait_idle(pilot)
    return screen


def test_the_last_question_is_answered_under_each_method_side_by_side(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=12, **EXACT)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "What is the capital of France?")
            asked = app.conversation.session.messages[-1]["content"]
            screen = await compare_with_defaults(pilot)
            columns = screen.columns
            assert [c.method for c in columns] == ["window", "h2o", "chelsea"]  # current first, then the defaults
            # Asked again from the same (empty) past, under the same method: the same answer.
            assert columns[0].text == asked
            for column in columns:
                assert column.state == "done" and column.text.strip()
                assert column.figures_text.startswith("KV ") and "TTFT" in column.figures_text
                assert "tok/s" in column.figures_text
            assert screen.status_text.startswith("one exact prefill of")
            # Side by side at 100 columns, stacked below 100.
            assert len({c.region.y for c in columns}) == 1 and len({c.region.x for c in columns}) == 3
            await pilot.resize_terminal(80, 24)
            await pilot.pause()
            assert screen.narrow and len({c.region.x for c in columns}) == 1
            assert columns[0].region.y < columns[1].region.y < columns[2].region.y
            assert app.ui_errors == []

    asyncio.run(body())


def test_choosing_a_column_continues_with_that_method_as_a_new_session(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=10, **EXACT)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Name a colour.")
            original = app.conversation.session_id
            screen = await compare_with_defaults(pilot)
            h2o_answer = screen.column("h2o").text
            await pilot.press("right")  # from the first column (focused) to h2o
            await pilot.press("enter")
            await wait_for(pilot, lambda: not isinstance(app.screen, CompareScreen), what="the chat")
            await pilot.pause()
            assert app.current_method() == "h2o" and app.conversation.session_id is None
            assert app.chat.message_list.assistant_messages()[-1].text == h2o_answer
            assert "Continuing with h2o's answer" in str(app.chat.message_list.children[-1].render())
            assert store.get_session(original).message_count == 2  # the original stays as saved
            await send_and_wait(pilot, "And another?")
            assert app.conversation.session_id not in (None, original)  # saved with its next turn
            assert store.get_session(app.conversation.session_id).method == "h2o"
            assert app.ui_errors == []

    asyncio.run(body())


def test_esc_stops_a_comparison_and_closing_keeps_the_conversation(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=8, **EXACT)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Write a long story about a dragon who learns to read.")
            app.controller.sampling = replace(app.sampling, max_new_tokens=2000)  # compared at length
            messages = [dict(m) for m in app.conversation.session.messages]
            session_id = app.conversation.session_id
            await pilot.press("ctrl+g")
            await wait_for(pilot, lambda: isinstance(app.screen, CompareMethodsPicker), what="the method picker")
            await pilot.press("c")
            await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), what="the compare view")
            screen = app.screen
            await wait_for(pilot, lambda: len(screen.column("window").text) > 20, what="the first answer to stream")
            await pilot.press("escape")
            await wait_idle(pilot)
            assert screen.status_text.startswith("stopped")
            window, *others = screen.columns
            assert window.figures is not None and window.figures.stopped and window.figures_text.endswith("stopped")
            assert window.text.strip()  # the partial answer is kept
            assert [c.state for c in others] == ["skipped", "skipped"]
            await pilot.press("escape")  # closes: the conversation stays as it was
            await wait_for(pilot, lambda: not isinstance(app.screen, CompareScreen), what="the chat")
            assert app.conversation.session_id == session_id and app.conversation.session.messages == messages
            assert app.ui_errors == []

    asyncio.run(body())


def test_compare_needs_a_question_and_is_in_help_and_palette(engine, store):
    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await wait_idle(pilot)
            await pilot.press("ctrl+g")
            await pilot.pause()
            assert not isinstance(app.screen, CompareMethodsPicker)
            assert any("ask a question first" in n for n in notifications(app))
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            help_text = app.screen.plain_text()
            assert "Chat: ^g — Compare." in help_text and "Compare view (Ctrl+G): esc — Stop / close." in help_text
            await pilot.press("escape")
            assert "Compare" in [c.title for c in app.palette_commands()]

    asyncio.run(body())
