"""Reading files to attach them (kvchat/documents/): every kind on a real file written in the
test, what each keeps and drops, and every refusal in one line naming the way out."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
from document_files import (
    BOILERPLATE,
    CHAPTERS,
    MAIN_TEXT,
    SCRIPT_TEXT,
    page_text,
    write_corrupt_pdf,
    write_docx,
    write_epub,
    write_html_page,
    write_pdf,
    write_scanned_pdf,
)

from kvchat.documents import MAX_FILE_BYTES, kind_of, read_document, read_folder
from kvchat.errors import Cancelled, DocumentError
from kvchat.optional import MissingPackage
from kvchat.turns import OutlineEntry, document_outline


def refusal(path, **kwargs) -> str:
    with pytest.raises(DocumentError) as refused:
        read_document(path, **kwargs)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


# -- PDF -------------------------------------------------------------------------------------
def test_a_pdf_gives_each_page_after_its_page_marker(tmp_path):
    document = read_document(write_pdf(tmp_path / "keeper.pdf", 3))
    assert document.text.splitlines() == [
        "=== keeper.pdf · 3 pages ===",
        "--- page 1 ---",
        page_text(1),
        "--- page 2 ---",
        page_text(2),
        "--- page 3 ---",
        page_text(3),
    ]
    assert (document.kind, document.parts, document.summary) == ("pdf", 3, "3 pages")


def test_a_page_without_text_keeps_its_marker_so_later_pages_keep_their_numbers(tmp_path):
    document = read_document(write_pdf(tmp_path / "gap.pdf", [page_text(1), "", page_text(3)]))
    lines = document.text.splitlines()
    assert lines[lines.index("--- page 2 ---") + 1] == "--- page 3 ---"
    assert lines[-1] == page_text(3)


def test_reading_a_pdf_reports_every_page(tmp_path):
    heard: list[tuple[int, int]] = []
    read_document(write_pdf(tmp_path / "keeper.pdf", 3), on_progress=lambda done, total: heard.append((done, total)))
    assert heard == [(1, 3), (2, 3), (3, 3)]


def test_a_set_cancel_stops_reading_at_the_next_page(tmp_path):
    cancel = threading.Event()
    heard: list[int] = []

    def progress(done: int, total: int) -> None:
        heard.append(done)
        if done == 2:
            cancel.set()

    with pytest.raises(Cancelled):
        read_document(write_pdf(tmp_path / "long.pdf", 6), on_progress=progress, cancel=cancel)
    assert heard == [1, 2]


def test_an_encrypted_pdf_is_refused_as_encrypted_without_asking_for_the_password(tmp_path):
    message = refusal(write_pdf(tmp_path / "locked.pdf", 2, user_password="secret"))
    assert "encrypted" in message and "unprotected copy" in message


def test_a_pdf_with_an_empty_open_password_is_read(tmp_path):
    # Permissions only (printing, copying): every viewer opens it without a password.
    document = read_document(write_pdf(tmp_path / "permissions.pdf", 1, user_password=""))
    assert page_text(1) in document.text


def test_a_scanned_pdf_is_refused_and_ocr_named_as_the_way_out(tmp_path):
    message = refusal(write_scanned_pdf(tmp_path / "scan.pdf", 2))
    assert "no text layer" in message and "2 scanned or image-only pages" in message and "OCR" in message


def test_a_truncated_pdf_is_refused_as_damaged(tmp_path):
    assert "not a readable PDF (damaged or truncated)" in refusal(write_corrupt_pdf(tmp_path / "cut.pdf"))


def test_a_pdf_is_known_by_its_first_bytes_whatever_its_name(tmp_path):
    renamed = write_pdf(tmp_path / "keeper.pdf", 1).rename(tmp_path / "keeper.txt")
    assert read_document(renamed).kind == "pdf"


def test_a_missing_pdf_reader_names_the_install_command(tmp_path, monkeypatch):
    path = write_pdf(tmp_path / "keeper.pdf", 1)
    monkeypatch.setitem(sys.modules, "pypdfium2", None)  # how an uninstalled package looks
    with pytest.raises(MissingPackage) as missing:
        read_document(path)
    assert "pip install -e '.[docs]'" in str(missing.value) and "PDF" in str(missing.value)


# -- HTML, DOCX, EPUB ------------------------------------------------------------------------
def test_a_web_page_gives_its_main_text_without_menus_banners_scripts_or_footer(tmp_path):
    text = read_document(write_html_page(tmp_path / "beans.html")).text
    assert all(paragraph in text for paragraph in MAIN_TEXT)
    assert [line for line in BOILERPLATE if line in text] == []
    assert SCRIPT_TEXT not in text
    assert text.splitlines()[:2] == ["=== beans.html ===", "# Beans on a balcony"]


def test_a_saved_page_without_a_suffix_is_read_as_html(tmp_path):
    page = write_html_page(tmp_path / "beans.html").rename(tmp_path / "beans")
    assert read_document(page).kind == "html"


def test_a_word_document_keeps_headings_lists_and_table_rows_in_order(tmp_path):
    document = read_document(write_docx(tmp_path / "harbour.docx"))
    assert document.text.splitlines() == [
        "=== harbour.docx ===",
        "# Harbour report",
        "The harbour closed on Tuesday because of the storm.",
        "Ferries resume on Friday at 6 in the morning.",
        "- Check the tide tables first.",
        "Ferry | Departure",
        "Islander | 06:00",
    ]
    assert (document.kind, document.parts) == ("docx", 0)


def test_an_epub_gives_its_chapters_in_reading_order_with_their_titles(tmp_path):
    document = read_document(write_epub(tmp_path / "island.epub"))
    lines = document.text.splitlines()
    markers = [line for line in lines if line.startswith("--- chapter")]
    assert markers == [f"--- chapter {n}: {title} ---" for n, (title, _) in enumerate(CHAPTERS, 1)]
    assert all(lines.index(marker) < lines.index(text) for marker, (_, text) in zip(markers, CHAPTERS))
    assert document.summary == "3 chapters"  # the cover, a picture, is no chapter


def test_reading_a_book_warns_of_nothing(tmp_path):
    # Its chapters are XHTML, which BeautifulSoup would warn about on the user's terminal.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_document(write_epub(tmp_path / "island.epub"))


def test_a_damaged_word_document_or_book_is_refused_in_one_line(tmp_path):
    docx_bytes = write_docx(tmp_path / "whole.docx").read_bytes()
    (tmp_path / "cut.docx").write_bytes(docx_bytes[: len(docx_bytes) // 2])
    assert "not a readable Word document" in refusal(tmp_path / "cut.docx")
    (tmp_path / "cut.epub").write_bytes(b"PK\x03\x04 not really a book")
    assert "not a readable EPUB book" in refusal(tmp_path / "cut.epub")


def test_a_docx_or_epub_is_known_by_what_its_archive_holds(tmp_path):
    docx = write_docx(tmp_path / "harbour.docx").rename(tmp_path / "harbour.zip")
    book = write_epub(tmp_path / "island.epub").rename(tmp_path / "island.zip")
    assert kind_of(docx, docx.read_bytes()[:1024]) == "docx"
    assert kind_of(book, book.read_bytes()[:1024]) == "epub"


# -- text ----------------------------------------------------------------------------------
def test_a_text_file_is_read_as_it_is_after_its_heading(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("\ufeff# Notes\n\nThe password is 7316.\n", encoding="utf-8")  # with a byte order mark
    assert read_document(notes).text == "=== notes.md ===\n# Notes\n\nThe password is 7316.\n"


def test_a_binary_file_is_refused_naming_the_kinds_kvchat_reads(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x00\x01\x02" * 100)
    message = refusal(blob)
    assert "not a text file" in message and "PDF, HTML, Word (.docx) or EPUB" in message


def test_a_file_that_is_not_utf8_is_refused_with_the_way_to_convert_it(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café crème".encode("latin-1"))
    assert "not UTF-8 text; convert it first" in refusal(latin)


def test_a_file_over_the_limit_is_refused_before_it_is_read_in_decimal_megabytes(tmp_path):
    big = tmp_path / "big.pdf"
    with big.open("wb") as out:
        out.truncate(MAX_FILE_BYTES + 500_000)  # sparse: nothing is written, nothing to read
    assert refusal(big) == f"{big}: 64.5 MB, over the 64 MB limit; split it"


def test_a_missing_file_names_where_relative_paths_start(tmp_path):
    assert "no such file; check the path" in refusal(tmp_path / "missing.pdf")


# -- folders -----------------------------------------------------------------------------------
def test_a_folder_gives_its_readable_files_in_name_order_and_says_which_it_skipped(tmp_path):
    write_pdf(tmp_path / "b-keeper.pdf", 1)
    (tmp_path / "a-notes.txt").write_text("Notes first.\n", encoding="utf-8")
    (tmp_path / "c-blob.bin").write_bytes(b"\x00" * 10)
    (tmp_path / ".hidden.txt").write_text("never read\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.txt").write_text("never read either\n", encoding="utf-8")
    folder = read_folder(tmp_path)
    assert [document.name for document in folder.documents] == ["a-notes.txt", "b-keeper.pdf"]
    assert [path.name for path, _ in folder.skipped] == ["c-blob.bin"]
    assert folder.skipped_note().startswith("skipped 1 file: c-blob.bin (not a text file")
    assert folder.text.index("=== a-notes.txt ===") < folder.text.index("=== b-keeper.pdf · 1 page ===")


def test_a_set_cancel_stops_reading_a_folder_at_the_next_file(tmp_path):
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(f"{name}\n", encoding="utf-8")
    cancel = threading.Event()
    heard: list[int] = []

    def progress(done: int, total: int) -> None:
        heard.append(done)
        cancel.set()

    with pytest.raises(Cancelled):
        read_folder(tmp_path, progress, cancel)
    assert heard == [1]


def test_a_folder_without_a_readable_file_is_refused_saying_why(tmp_path):
    write_scanned_pdf(tmp_path / "scan.pdf", 1)
    with pytest.raises(DocumentError) as refused:
        read_folder(tmp_path)
    assert "holds no file kvchat can read; skipped 1 file: scan.pdf (the PDF has no text layer" in str(refused.value)


# -- the outline the memory map reads ----------------------------------------------------------
def test_the_outline_finds_each_file_and_each_of_its_pages_again(tmp_path):
    write_pdf(tmp_path / "a.pdf", 2)
    (tmp_path / "b.txt").write_text("Plain notes.\n", encoding="utf-8")
    text = read_folder(tmp_path).text
    outline = document_outline(text)
    assert [(entry.document, entry.part) for entry in outline] == [
        ("a.pdf", ""),
        ("a.pdf", "p. 1"),
        ("a.pdf", "p. 2"),
        ("b.txt", ""),
    ]
    assert text[outline[1].at :].startswith("--- page 1 ---")


def test_a_pasted_text_has_no_outline_even_with_marker_like_lines():
    assert document_outline("--- page 3 ---\nsome notes\n") == []
    assert document_outline("=== log.txt ===\n--- page 3 ---\n") == [
        OutlineEntry(0, "log.txt", ""),
        OutlineEntry(16, "log.txt", "p. 3"),
    ]


def test_an_empty_file_is_refused_as_nothing_to_attach(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    assert "the file is empty; nothing to attach" in refusal(empty)
