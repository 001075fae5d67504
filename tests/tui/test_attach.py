"""Attaching files in the app (kvchat/tui/flows/files.py), driven headless with Pilot on the
real embedded model: every kind as a chip with its pages and tokens, a folder after a
confirmation showing its token count, a pasted path, a refusal, and Esc stopping a long
reading. Files are written by the tests (tests/document_files.py)."""

from __future__ import annotations

import asyncio
import html

import pytest
from document_files import page_text, write_epub, write_long_pdf, write_pdf

from kvchat.chat.memory_map import part_lines
from kvchat.documents import read_document, read_folder
from kvchat.tui.screens import ConfirmDialog

from .conftest import APP_SIZE, make_app, notifications, paste, send_and_wait, wait_for, wait_idle

pytestmark = pytest.mark.slow


async def file_command(pilot, argument: str) -> None:
    pilot.app.chat.chat_input.prompt_area.text = f"/file {argument}"
    await pilot.press("enter")


async def chip_counted(pilot) -> None:
    chat_input = pilot.app.chat.chat_input
    await wait_for(pilot, lambda: chat_input.documents and chat_input.documents[-1].tokens, 30, "the chip's tokens")


def test_a_pdf_becomes_a_chip_with_its_pages_and_tokens_and_the_question_waits(engine, store, tmp_path):
    paper = write_pdf(tmp_path / "paper.pdf", 3)

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await file_command(pilot, f"{paper} What does page 2 say?")
            await chip_counted(pilot)
            chat_input = app.chat.chat_input
            tokens = engine.count_tokens(read_document(paper).text)
            assert [c.chip_text for c in chat_input.chips()] == [f"paper.pdf · 3 pages · {tokens:,} tokens"]
            assert chat_input.question == "What does page 2 say?"
            assert not app.chat.progress_visible
            assert app.ui_errors == []

    asyncio.run(body())


def test_a_sent_pdf_reaches_the_model_with_its_page_markers_and_the_map_names_its_pages(engine, store, tmp_path):
    paper = write_pdf(tmp_path / "paper.pdf", 3)

    async def body():
        app = make_app(engine, store, max_new_tokens=4)
        async with app.run_test(size=APP_SIZE) as pilot:
            await file_command(pilot, str(paper))
            await chip_counted(pilot)
            await send_and_wait(pilot, "What does page 2 say?")
            sent = app.conversation.session.messages[0]["content"]
            assert "--- page 2 ---\n" + page_text(2) in sent and sent.endswith("What does page 2 say?")
            report = app.controller.memory_report()
            assert [part.part for part in report.parts] == ["p. 1", "p. 2", "p. 3"]
            await pilot.press("f2")  # the memory map names the pages by what the cache holds
            await wait_for(pilot, lambda: getattr(app.screen, "report", None) is not None, 30, "the memory map")
            screen = html.unescape(app.export_screenshot()).replace("\xa0", " ")
            line = part_lines(app.screen.report)[0]
            assert line.startswith("paper.pdf: p. 1") and line in screen
            assert app.ui_errors == []

    asyncio.run(body())


def test_a_folder_is_attached_after_a_confirmation_that_shows_its_tokens(engine, store, tmp_path):
    folder = tmp_path / "island"
    folder.mkdir()
    write_pdf(folder / "b-log.pdf", 2)
    write_epub(folder / "a-book.epub")
    (folder / "c-notes.txt").write_text("The ferry leaves at six.\n", encoding="utf-8")

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await file_command(pilot, str(folder))
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 30, "the confirmation")
            tokens = engine.count_tokens(read_folder(folder).text)
            question = app.screen.question
            assert question.startswith(f"Attach 3 files from island/ ({tokens:,} tokens), in this order?")
            assert "a-book.epub, b-log.pdf, c-notes.txt" in question
            await pilot.press("y")
            await wait_for(pilot, lambda: app.chat.chat_input.chips(), 10, "the chip")
            chips = [c.chip_text for c in app.chat.chat_input.chips()]
            assert chips == [f"island/ · 3 files · {tokens:,} tokens"]
            assert app.ui_errors == []

    asyncio.run(body())


def test_a_folder_declined_attaches_nothing(engine, store, tmp_path):
    (tmp_path / "notes.txt").write_text("Nothing to see.\n", encoding="utf-8")

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await file_command(pilot, str(tmp_path))
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 30, "the confirmation")
            await pilot.press("escape")
            await pilot.pause()
            assert app.chat.chat_input.documents == []

    asyncio.run(body())


def test_a_pasted_path_offers_to_attach_the_file(engine, store, tmp_path):
    paper = write_pdf(tmp_path / "paper.pdf", 2)

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await paste(pilot, f"'{paper}'")  # as a terminal pastes a dropped file
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 10, "the offer")
            assert app.screen.question.startswith("Attach paper.pdf (")
            await pilot.press("y")
            await chip_counted(pilot)
            assert app.chat.chat_input.documents[0].summary == "2 pages"
            assert app.chat.chat_input.question == ""

    asyncio.run(body())


def test_a_pasted_path_declined_lands_in_the_editor_as_typed(engine, store, tmp_path):
    paper = write_pdf(tmp_path / "paper.pdf", 1)

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await paste(pilot, str(paper))
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), 10, "the offer")
            await pilot.press("n")
            await wait_for(pilot, lambda: app.chat.chat_input.question == str(paper), 10, "the path in the editor")
            assert app.chat.chat_input.documents == []

    asyncio.run(body())


def test_an_encrypted_pdf_is_refused_in_a_notification_and_the_editor_keeps_the_command(engine, store, tmp_path):
    locked = write_pdf(tmp_path / "locked.pdf", 1, user_password="secret")

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await file_command(pilot, str(locked))
            await wait_for(pilot, lambda: any("encrypted" in n for n in notifications(app)), 10, "the refusal")
            assert app.chat.chat_input.question == f"/file {locked}"
            assert app.chat.chat_input.documents == [] and app.files.reading is None
            assert app.ui_errors == []

    asyncio.run(body())


def test_esc_stops_reading_a_long_pdf_and_nothing_is_attached(engine, store, tmp_path):
    # 50,000 pages: about 6 s to read on an idle 2-core box (10,000 took 1.3 s, which a
    # loaded box could finish before the Esc arrived).
    long = write_long_pdf(tmp_path / "long.pdf", 50_000)

    async def body():
        app = make_app(engine, store)
        async with app.run_test(size=APP_SIZE) as pilot:
            await file_command(pilot, str(long))
            label = app.chat.query_one("#progress-label")
            await wait_for(pilot, lambda: "of 50,000 · Esc stops" in str(label.render()), 30, "page progress")
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.files.reading is None, 30, "the reading to stop")
            assert any(n == "Stopped reading long.pdf; nothing attached." for n in notifications(app))
            assert app.chat.chat_input.documents == [] and not app.chat.progress_visible
            await wait_idle(pilot)
            assert app.ui_errors == []

    asyncio.run(body())
