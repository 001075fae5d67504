"""`/system` in the app, on the real embedded model, driven headless with Pilot."""

from __future__ import annotations

import asyncio

import pytest

from kvchat.tui.screens import HelpScreen

from .conftest import APP_SIZE, make_app, notifications, send_and_wait, type_text, wait_idle

pytestmark = pytest.mark.slow

PIRATE = "You are a pirate named Zorro."


def test_slash_system_reads_the_conversation_again_and_the_next_turn_uses_it(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=6)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Hi there")
            session = app.conversation.session
            assert session.system is None
            await send_and_wait(pilot, "/system")
            assert any("none" in n and "default" in n for n in notifications(app)), notifications(app)
            calls = engine.forward_calls
            await send_and_wait(pilot, f"/system {PIRATE}")
            assert app.chat.chat_input.question == ""
            assert session.system == PIRATE and engine.forward_calls > calls  # read again, not just noted
            assert any(n.startswith("Read ") and "again under it" in n for n in notifications(app)), notifications(app)
            row = store.get_session(app.conversation.session_id)
            assert row.params["system"] == PIRATE  # saved with the new cache
            assert store.snapshot_meta(row.id)["settings"]["system"] == PIRATE
            await send_and_wait(pilot, "What is your name?")
            fed = engine.tokenizer.decode(session.token_ids)
            assert fed.startswith(f"<|im_start|>system\n{PIRATE}<|im_end|>") and "SmolLM" not in fed
            assert fed.count("What is your name?") == 1 and len(session.messages) == 4
            await send_and_wait(pilot, "/system")
            assert PIRATE in notifications(app)
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen) and "/system [TEXT|off]" in app.screen.plain_text()
            assert app.ui_errors == []

    asyncio.run(body())


def app_with_system(engine, store, system: str):
    """The app as `kvchat --system TEXT` starts it."""
    from kvchat.settings import SamplingSettings
    from kvchat.tui.app import KvchatApp

    from .conftest import small_settings

    return KvchatApp(
        engine, store, small_settings(), SamplingSettings(max_new_tokens=4), None, reopen_last=False, system=system
    )


def test_system_given_to_the_app_is_that_of_new_sessions(engine, store):
    async def body():
        app = app_with_system(engine, store, PIRATE)
        async with app.run_test(size=APP_SIZE) as pilot:
            await wait_idle(pilot)
            assert app.conversation.session.system == PIRATE
            await type_text(pilot, "/system Be brief.")  # before any turn: nothing to read again
            calls = engine.forward_calls
            await pilot.press("enter")
            await wait_idle(pilot)
            assert app.conversation.session.system == "Be brief." and engine.forward_calls == calls
            assert any("next message" in n for n in notifications(app)), notifications(app)
            await send_and_wait(pilot, "Hi")
            assert store.get_session(app.conversation.session_id).params["system"] == "Be brief."
            assert app.ui_errors == []

    asyncio.run(body())


def test_slash_system_off_returns_to_the_model_s_default(engine, store):
    async def body():
        app = app_with_system(engine, store, PIRATE)
        async with app.run_test(size=APP_SIZE) as pilot:
            await wait_idle(pilot)
            await send_and_wait(pilot, "Hi")
            session = app.conversation.session
            await send_and_wait(pilot, "/system off")
            assert session.system is None
            assert engine.tokenizer.decode(session.token_ids).startswith("<|im_start|>system\nYou are a helpful AI")
            assert "system" not in store.get_session(app.conversation.session_id).params
            await send_and_wait(pilot, "/system off")
            assert notifications(app)[-1] == "There is no system prompt to turn off: the model's default applies."
            assert app.ui_errors == []

    asyncio.run(body())
