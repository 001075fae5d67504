"""Branches in the app (F3), on the real embedded model, driven headless with Pilot: pick
an earlier message, edit and resend it or regenerate its answer, in a new session that
shares the conversation before it; the original stays saved."""

from __future__ import annotations

import asyncio

import pytest

from kvchat.tui.screens import BranchPicker, EditMessage, HelpScreen, SessionsScreen

from .conftest import (
    APP_SIZE,
    essay_tokens,
    make_app,
    notifications,
    paste,
    send_and_wait,
    type_text,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.slow


def shown_questions(app) -> list[str]:
    return [m.text for m in app.chat.message_list.user_messages()]


def test_edit_and_resend_an_earlier_message_in_a_branch(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=8)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "What is the capital of France?")
            await send_and_wait(pilot, "And of Italy?")
            original = app.conversation.session_id
            saved = [(m.role, m.text) for m in store.messages(original)]
            await pilot.press("f3")
            assert isinstance(app.screen, BranchPicker)
            picker = app.screen
            assert picker.messages == ["What is the capital of France?", "And of Italy?"]
            assert picker.highlighted_turn() == 2  # the newest first under the cursor
            await pilot.press("up", "enter")
            assert isinstance(app.screen, EditMessage)
            editor = app.screen
            assert (editor.turn, editor.text) == (1, "What is the capital of France?")
            await pilot.press("ctrl+u")  # the editor's own key: delete to the line start
            await type_text(pilot, "What is the capital of Spain?")
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.conversation.session_id != original, 60, "the branch to open")
            await wait_idle(pilot)
            branch = app.conversation.session_id
            assert shown_questions(app) == ["What is the capital of Spain?"]
            first, answer = store.messages(branch)  # branched at turn 0, then one turn
            assert (first.role, first.text, answer.role) == ("user", "What is the capital of Spain?", "assistant")
            assert store.get_session(branch).origin() == f"branch of #{original} at turn 0"
            assert [(m.role, m.text) for m in store.messages(original)] == saved  # the original as it was
            assert any("stays as it was" in n for n in notifications(app)), notifications(app)
            assert f"session {branch}" in app.sub_title
            assert app.ui_errors == []

    asyncio.run(body())


def test_regenerate_the_last_answer_in_a_branch_shown_in_the_sessions_list(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=8)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Name a colour.")
            await send_and_wait(pilot, "Another one?")
            original = app.conversation.session_id
            calls = engine.forward_calls
            await pilot.press("f3")
            await pilot.press("r")
            await wait_for(pilot, lambda: app.conversation.session_id != original, 60, "the branch to open")
            await wait_idle(pilot)
            assert engine.forward_calls > calls  # turn 1 read again (no saved cache of it), then answered
            branch = app.conversation.session_id
            assert shown_questions(app) == ["Name a colour.", "Another one?"]
            assert [m.text for m in store.messages(branch)][::2] == ["Name a colour.", "Another one?"]
            notices = [str(n.render()) for n in app.chat.message_list.query("NoticeMessage")]
            assert any(f"a branch of session {original} at turn 1" in t for t in notices), notices
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), 10, "the sessions list")
            table = app.screen.query_one("DataTable")
            titles = [str(table.get_row_at(i)[1]) for i in range(table.row_count)]
            assert titles == [f"Name a colour.  ↳ branch of #{original} at turn 1", "Name a colour."]
            assert app.ui_errors == []

    asyncio.run(body())


def test_regenerating_a_message_sent_with_a_document_sends_the_document_again(engine, store):
    from kvchat.calibration.realkv import essays_text

    document = essays_text()[:2400]  # long enough to become a chip

    async def body():
        app = make_app(engine, store, max_new_tokens=6, budget="64", window=64)
        async with app.run_test(size=APP_SIZE) as pilot:
            await paste(pilot, document)
            await wait_for(pilot, lambda: app.chat.chat_input.documents, 10, "the chip")
            await send_and_wait(pilot, "Who wrote this?")
            original = app.conversation.session_id
            sent = store.messages(original)[0].text
            await pilot.press("f3")
            assert "after a document" in str(app.screen.query_one("OptionList").get_option_at_index(0).prompt)
            await pilot.press("r")
            await wait_for(pilot, lambda: app.conversation.session_id != original, 60, "the branch to open")
            await wait_idle(pilot)
            assert store.messages(app.conversation.session_id)[0].text == sent
            (shown,) = app.chat.message_list.user_messages()
            assert shown.text == "Who wrote this?" and shown.document_labels
            assert app.ui_errors == []

    asyncio.run(body())


def test_esc_stops_a_branch_being_rebuilt_and_nothing_is_left(engine, store):
    document, _ = essay_tokens(engine, 1800)  # 1,800 tokens: the rebuild reads four chunks

    async def body():
        app = make_app(engine, store, max_new_tokens=4, budget="64", window=64)
        async with app.run_test(size=APP_SIZE) as pilot:
            await paste(pilot, document)
            await wait_for(pilot, lambda: app.chat.chat_input.documents, 10, "the chip")
            await send_and_wait(pilot, "Who wrote this?")
            await send_and_wait(pilot, "Thanks.")
            original = app.conversation.session_id
            await pilot.press("f3", "r")  # regenerate turn 2: turn 1, with its document, is read again
            label = app.chat.query_one("#progress-label")
            await wait_for(
                pilot, lambda: "Rebuilding the branch's cache" in str(label.render()), 120, "the rebuild's progress"
            )
            assert app.runner.can_stop()
            await pilot.press("escape")
            await wait_idle(pilot, 120)
            assert any("Branch stopped" in n for n in notifications(app)), notifications(app)
            assert [r.id for r in store.list_sessions()] == [original]
            assert app.conversation.session_id == original
            assert app.ui_errors == []

    asyncio.run(body())


def test_f3_before_any_message_says_there_is_nothing_to_branch(engine, store):
    async def body():
        app = make_app(engine, store, reopen_last=False)
        async with app.run_test(size=APP_SIZE) as pilot:
            await wait_idle(pilot)
            await pilot.press("f3")
            await pilot.pause()
            assert not isinstance(app.screen, BranchPicker)
            assert any("No message of yours to branch from" in n for n in notifications(app))

    asyncio.run(body())


def test_help_lists_the_branch_key_and_the_picker_keys(engine, store):
    async def body():
        app = make_app(engine, store, reopen_last=False)
        async with app.run_test(size=APP_SIZE) as pilot:
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            text = app.screen.plain_text()
            assert "Chat: f3 — Branch. pick an earlier message of yours to edit and resend" in text
            assert "Branch (F3): ⏎ / e — Edit & resend." in text
            assert "Branch (F3): r — Regenerate." in text

    asyncio.run(body())
