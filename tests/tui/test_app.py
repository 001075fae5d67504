"""The app on the real embedded model, driven headless with Pilot."""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest

from kvchat.documents import read_document
from kvchat.tui.screens import ConfirmDialog, HelpScreen, SessionsScreen
from kvchat.tui.widgets import AssistantMessage

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

STORY = "Write a long story about a dragon who learns to read."


def last_answer(app) -> AssistantMessage:
    return app.chat.message_list.assistant_messages()[-1]


def test_send_streams_the_answer_and_shows_speeds(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=16)
        async with app.run_test(size=APP_SIZE) as pilot:
            await type_text(pilot, "What is the capital of France?")
            await pilot.press("enter")
            assert app.chat.chat_input.question == ""  # accepted: the editor is cleared
            await wait_idle(pilot)
            answer = last_answer(app)
            assert answer.text.strip()
            assert answer.pieces_received > 1  # streamed piece by piece
            assert answer.markdown.source == answer.text
            assert answer.text == app.conversation.session.messages[-1]["content"]
            status = app.chat.status_bar.plain_text
            assert re.search(r"decode \d+\.\d tok/s", status), status
            assert re.search(r"prefill [\d,]+ tok/s", status) and "TTFT" in status
            assert "window · budget 16" in status and "kept/head" in status and "KV " in status
            stats = app.conversation.session.stats()
            assert stats.entries_per_head < stats.tokens_seen  # compression really happened
            rows = store.list_sessions()
            assert len(rows) == 1 and rows[0].message_count == 2 and rows[0].title.startswith("What is the capital")
            assert app.ui_errors == []

    asyncio.run(body())


def test_ctrl_t_switches_method_and_status_follows(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=12)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Hi there")
            before = app.chat.status_bar.plain_text
            assert before.startswith("window ·")
            await pilot.press("ctrl+t")  # window -> h2o (order of compress.available())
            await wait_idle(pilot)
            after = app.chat.status_bar.plain_text
            assert after.startswith("h2o ·"), after
            assert app.conversation.session.settings.method == "h2o"
            assert any("Now h2o" in n for n in notifications(app))
            assert store.get_session(app.conversation.session_id).method == "h2o"  # saved with the switch
            # Rebuild: the transcript is read again through h2o.
            calls = engine.forward_calls
            await pilot.press("ctrl+r")
            await wait_idle(pilot)
            assert engine.forward_calls > calls
            assert any(n.startswith("Rebuilt") and "through h2o" in n for n in notifications(app)), notifications(app)
            assert app.ui_errors == []

    asyncio.run(body())


def test_f2_shows_the_memory_map_and_it_follows_a_method_switch(engine, store):
    from kvchat.tui.screens import MemoryScreen

    async def body():
        app = make_app(engine, store, max_new_tokens=8)
        async with app.run_test(size=(80, 24)) as pilot:
            await send_and_wait(pilot, "Tell me about dragons, and then about the sea.")
            await pilot.press("f2")
            screen = app.screen
            assert isinstance(screen, MemoryScreen)
            await wait_for(pilot, lambda: screen.report is not None, what="the memory map")
            report = screen.report
            assert report.method == "window"
            assert report.spans[-1].end == app.conversation.session.cache.tokens_seen
            assert report.spans[-1].kept == 1.0  # the answer is in the window
            assert report.spans[0].kept < 1.0  # the small cache already dropped part of the prompt
            summary = str(screen.query_one("#memory-summary").render())
            assert summary.startswith("method window") and "holds" in summary
            # Switching from the map redraws it for the new method.
            await pilot.press("ctrl+t")
            await wait_idle(pilot)
            await wait_for(pilot, lambda: screen.report.method == "h2o", what="the map after the switch")
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, MemoryScreen)
            assert app.ui_errors == []

    asyncio.run(body())


def test_pasting_20k_tokens_makes_a_chip_and_reading_shows_progress(engine, store):
    """The chip and its token count come at once; sending shows reading progress.
    Reading all 20k tokens takes minutes on a small CPU, so the test stops it after a
    few chunks (Esc), which also checks that a stopped prefill keeps the session."""
    document, tokens = essay_tokens(engine, 20_000)
    assert 19_000 < tokens < 21_000

    async def body():
        app = make_app(engine, store, max_new_tokens=12, budget="64", window=64)
        async with app.run_test(size=APP_SIZE) as pilot:
            chat_input = app.chat.chat_input
            start = time.perf_counter()
            await paste(pilot, document)
            await wait_for(pilot, lambda: chat_input.documents and chat_input.documents[0].tokens, 10, "the count")
            print(f"\n20k-token paste: chip with its token count after {time.perf_counter() - start:.2f} s")
            assert chat_input.prompt_area.text == ""  # not a wall of text in the editor
            assert [chip.chip_text for chip in chat_input.chips()] == [f"Document 1 · {tokens:,} tokens"]
            await type_text(pilot, "Who wrote this?")
            await pilot.press("enter")
            assert chat_input.chips() == [] and chat_input.question == ""
            user = app.chat.message_list.user_messages()[-1]
            assert user.document_labels == [f"Document 1 · {tokens:,} tokens"] and user.text == "Who wrote this?"
            start = time.perf_counter()
            await wait_for(
                pilot,
                lambda: app.chat.progress_visible and app.chat.progress_bar.progress >= 1024,
                300,
                "two chunks of reading progress",
            )
            seconds = time.perf_counter() - start
            done = int(app.chat.progress_bar.progress)
            assert app.chat.progress_bar.total > tokens
            assert re.search(r"reading [\d,]+ / [\d,]+ tokens", app.chat.status_bar.plain_text)
            print(
                f"20k-token paste: {done:,} tokens read in {seconds:.1f} s ({done / seconds:.0f} tok/s; "
                f"all {tokens:,} would take about {tokens / done * seconds:.0f} s)"
            )
            await pilot.press("escape")
            await wait_idle(pilot, 120)
            assert app.last_result.stop_reason == "cancelled" and not app.chat.progress_visible
            assert app.conversation.session.stats().tokens_seen >= done  # what was read stays
            assert app.ui_errors == []

    asyncio.run(body())


def test_long_document_is_read_with_progress_then_answered(engine, store):
    """A multi-chunk document end to end. KVCHAT_TUI_DOC_TOKENS=20000 runs it at the
    full 20k tokens (minutes on CPU); the default keeps the suite quick."""
    document, tokens = essay_tokens(engine, int(os.environ.get("KVCHAT_TUI_DOC_TOKENS", "1100")))

    async def body():
        app = make_app(engine, store, max_new_tokens=12, budget="64", window=64)
        async with app.run_test(size=APP_SIZE) as pilot:
            await paste(pilot, document)
            await wait_for(
                pilot,
                lambda: app.chat.chat_input.documents and app.chat.chat_input.documents[0].tokens,
                10,
                "the token count",
            )
            await type_text(pilot, "Who wrote this?")
            start = time.perf_counter()
            await pilot.press("enter")
            seen_progress: list[float] = []

            def progressing() -> bool:
                if app.chat.progress_visible and app.chat.progress_bar.total:
                    seen_progress.append(app.chat.progress_bar.progress)
                return app.activity is None

            await wait_for(pilot, progressing, 1800, "the document to be read and answered")
            print(f"\n{tokens:,}-token document read and answered in {time.perf_counter() - start:.1f} s")
            assert seen_progress and max(seen_progress) > 0
            assert last_answer(app).text.strip()
            sent = app.conversation.session.messages[-2]["content"]
            assert sent.startswith(document.strip()[:200]) and sent.endswith("Who wrote this?")
            stats = app.conversation.session.stats()
            assert stats.tokens_seen > tokens
            assert stats.entries_per_head <= 4 + 64 + 64 + 512  # bounded whatever the length
            assert app.ui_errors == []

    asyncio.run(body())


def test_resume_from_the_sessions_list_does_not_prefill(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=12)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Name a colour.")
            saved_id = app.conversation.session_id
            saved_answer = last_answer(app).text
            saved_tokens = app.conversation.session.stats().tokens_seen
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert app.conversation.session_id is None and app.chat.message_list.assistant_messages() == []
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), 5, "the sessions list")
            calls = engine.forward_calls
            await pilot.press("enter")
            await wait_idle(pilot)
            assert engine.forward_calls == calls  # restored from the snapshot: no prefill
            assert app.conversation.session_id == saved_id
            assert last_answer(app).text == saved_answer
            assert app.chat.message_list.user_messages()[-1].text == "Name a colour."
            assert f"{saved_tokens:,} seen" in app.chat.status_bar.plain_text
            assert any(
                re.match(rf"Restored {saved_tokens:,} tokens from disk in [\d.]+ s", n) for n in notifications(app)
            )
            # It goes on from there: another turn continues the restored cache.
            await send_and_wait(pilot, "Another one?")
            assert app.conversation.session.stats().tokens_seen > saved_tokens
            assert store.get_session(saved_id).message_count == 4
            assert app.ui_errors == []

        # A new start reopens the last session, again without prefill.
        calls = engine.forward_calls
        again = make_app(engine, store)
        async with again.run_test(size=APP_SIZE) as pilot:
            # The conversation exists once the (worker-loaded) model is ready.
            await wait_for(
                pilot,
                lambda: (
                    again.conversation is not None
                    and again.conversation.session_id == saved_id
                    and again.activity is None
                ),
                30,
                "the last session to reopen",
            )
            assert engine.forward_calls == calls
            assert len(again.chat.message_list.assistant_messages()) == 2

    asyncio.run(body())


def test_a_later_turn_in_the_app_is_saved_as_a_delta(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=6)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Name a colour.")
            await send_and_wait(pilot, "And another one?")
            session_id = app.conversation.session_id
            assert app.ui_errors == []
        parents = [
            row["parent_id"]
            for row in store.db.query("SELECT parent_id FROM snapshots WHERE session_id = ? ORDER BY id", [session_id])
        ]
        assert len(parents) == 2 and parents[0] is None and parents[1] is not None

    asyncio.run(body())


@pytest.mark.parametrize("stop_key", ["escape", "ctrl+c"])
def test_stopping_generation_keeps_the_partial_answer(engine, store, stop_key):
    async def body():
        app = make_app(engine, store, max_new_tokens=400)
        async with app.run_test(size=APP_SIZE) as pilot:
            await type_text(pilot, STORY)
            await pilot.press("enter")
            await wait_for(pilot, lambda: last_answer(app).pieces_received >= 3, 60, "the answer to start")
            # Keys echo while the model generates (one key: the answer ends by itself after
            # ~150 tokens, so the window between "started" and the stop key stays short).
            await pilot.press("t")
            assert app.chat.chat_input.question == "t" and app.activity == "generating"
            await pilot.press(stop_key)
            await wait_idle(pilot)
            result = app.last_result
            assert result.stop_reason == "cancelled" and 0 < result.metrics.new_tokens < 400
            answer = last_answer(app)
            assert answer.text and answer.stopped
            assert answer.text == app.conversation.session.messages[-1]["content"] == result.text
            stored = store.messages(app.conversation.session_id)
            assert [m.role for m in stored] == ["user", "assistant"] and stored[-1].text == answer.text
            assert app.chat.chat_input.question == "t"  # what was typed meanwhile is kept
            assert app.ui_errors == []

    asyncio.run(body())


def test_quit_mid_generation_saves_what_was_said(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=400)
        async with app.run_test(size=APP_SIZE) as pilot:
            await type_text(pilot, STORY)
            await pilot.press("enter")
            await wait_for(pilot, lambda: last_answer(app).pieces_received >= 2, 60, "the answer to start")
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: not app.is_running, 30, "the app to quit")
        rows = store.list_sessions()
        assert len(rows) == 1
        stored = store.messages(rows[0].id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[0].text == STORY and stored[1].text.strip()
        assert store.load_snapshot(rows[0].id) is not None

    asyncio.run(body())


def test_markup_looking_input_is_shown_literally(engine, store):
    text = "[bold red]x[/] and [link=http://e.com]y[/link]"

    async def body():
        app = make_app(engine, store, max_new_tokens=4)
        async with app.run_test(size=APP_SIZE) as pilot:
            await type_text(pilot, text)
            await pilot.press("enter")
            user = app.chat.message_list.user_messages()[-1]
            await pilot.pause()
            body_widget = user.query_one(".message-body")
            assert body_widget.visual.plain == text
            assert not body_widget.visual.spans  # nothing was styled
            await wait_idle(pilot)
            assert app.conversation.session.messages[0]["content"] == text

    asyncio.run(body())


def test_file_command_attaches_text_and_refuses_the_rest(engine, store, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("kvchat keeps sinks, a window and a compressed middle.\n" * 50, encoding="utf-8")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02" * 100)

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            chat_input = app.chat.chat_input
            for bad, why in ((tmp_path / "missing.txt", "no such file"), (binary, "not a text file")):
                chat_input.prompt_area.text = f"/file {bad}"
                await pilot.press("enter")
                await wait_for(pilot, lambda why=why: any(why in n for n in notifications(app)), 10, "the refusal")
                assert chat_input.question == f"/file {bad}"  # nothing lost
            assert chat_input.documents == []
            chat_input.prompt_area.text = f"/file {notes}"
            await pilot.press("enter")
            await wait_for(pilot, lambda: chat_input.documents and chat_input.documents[0].tokens, 10, "the chip")
            tokens = engine.count_tokens(read_document(notes).text)  # its text after a line naming it
            assert [c.chip_text for c in chat_input.chips()] == [f"notes.txt · {tokens:,} tokens"]
            assert chat_input.question == ""
            await pilot.press("backspace")  # in an empty editor: takes the chip back
            assert chat_input.documents == [] and chat_input.chips() == []
            assert app.activity is None and app.ui_errors == []

    asyncio.run(body())


def test_file_command_with_a_question_attaches_the_file_and_keeps_the_question(engine, store, tmp_path):
    """`/file PATH QUESTION`: the file is attached as a chip and the question waits in the
    editor, to send with Enter; a path that holds spaces is still one path."""
    notes = tmp_path / "my notes.txt"
    notes.write_text("The password for the vault is 7316.\n" * 20, encoding="utf-8")

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            chat_input = app.chat.chat_input
            chat_input.prompt_area.text = f"/file {notes} What is the password?"
            await pilot.press("enter")
            await wait_for(pilot, lambda: chat_input.documents and chat_input.documents[0].tokens, 10, "the chip")
            assert [d.source for d in chat_input.documents] == [str(notes)]
            assert chat_input.question == "What is the password?"
            assert app.activity is None and app.ui_errors == []

    asyncio.run(body())


def test_help_and_palette_cover_every_binding(engine, store):
    from kvchat.tui.app import KvchatApp

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            help_text = app.screen.plain_text()
            for binding in KvchatApp.BINDINGS:
                assert binding.description in help_text
            assert "Send" in help_text and "Newline" in help_text
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            titles = [c.title for c in app.palette_commands()]
            for binding in KvchatApp.BINDINGS:
                if binding.action != "command_palette":
                    assert binding.description in titles
            assert "Method: h2o" in titles
            await pilot.press("ctrl+p")
            await pilot.pause()
            await send_and_wait(pilot, "next method")
            assert app.conversation.session.settings.method == "h2o"

    asyncio.run(body())


def test_snapshot_mismatch_offers_rebuild(engine, store):
    async def body():
        app = make_app(engine, store, max_new_tokens=8)
        async with app.run_test(size=APP_SIZE) as pilot:
            await send_and_wait(pilot, "Say hello.")
            saved_id = app.conversation.session_id
            saved_answer = last_answer(app).text
            # The snapshot now claims another dtype: it must be refused, not loaded.
            row = store.db.execute("SELECT id, meta FROM snapshots WHERE session_id = ?", [saved_id]).fetchone()
            store.db.execute(
                "UPDATE snapshots SET meta = ? WHERE id = ?",
                [row[1].replace('"dtype": "float32"', '"dtype": "float16"'), row[0]],
            )
            store.db.conn.commit()
            await pilot.press("ctrl+n")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), 5, "the sessions list")
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 30, "the rebuild offer")
            assert "float16" in app.screen.question and "Rebuild" in app.screen.question
            await pilot.press("y")
            await wait_idle(pilot)
            assert app.conversation.session_id == saved_id
            assert last_answer(app).text == saved_answer
            assert any("Rebuilt" in n and "from the transcript" in n for n in notifications(app))
            assert app.ui_errors == []

    asyncio.run(body())


def test_sessions_list_renames_and_deletes(engine, store):
    first = store.create_session("First chat", engine.loaded.fingerprint, "window", {})
    second = store.create_session("Second chat", engine.loaded.fingerprint, "h2o", {})

    async def body():
        app = make_app(engine, store, reopen_last=False)
        async with app.run_test(size=APP_SIZE) as pilot:
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), 5, "the sessions list")
            sessions = app.screen
            assert [row.id for row in sessions.rows] == [second, first]  # most recent first
            await pilot.press("r")
            await type_text(pilot, "Renamed chat")
            await pilot.press("enter")
            await pilot.pause()
            assert store.get_session(second).title == "Renamed chat"
            assert app.screen is sessions and sessions.rows[0].title == "Renamed chat"
            await pilot.press("down", "d")
            assert isinstance(app.screen, ConfirmDialog) and "First chat" in app.screen.question
            await pilot.press("y")
            await pilot.pause()
            assert [row.id for row in store.list_sessions()] == [second]
            assert app.screen is sessions and len(sessions.rows) == 1
            await pilot.press("escape")
            assert not isinstance(app.screen, SessionsScreen)
            assert app.ui_errors == []

    asyncio.run(body())
