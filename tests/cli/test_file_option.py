"""`--file` on the command line: every kind the readers take, repeated and folders in order,
every refusal one line before the model loads, and one real `kvchat ask` about a PDF.
Files are written by the tests (tests/document_files.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from document_files import (
    page_text,
    write_corrupt_pdf,
    write_docx,
    write_epub,
    write_long_pdf,
    write_pdf,
    write_scanned_pdf,
)

from kvchat import cli
from kvchat.cli.options import read_documents
from kvchat.cli.parser import build_parser
from kvchat.documents import MAX_FILE_BYTES

from .test_cli import KVCHAT, REPO, kvchat


def refused(args: list[str], tmp_path, capsys, monkeypatch) -> str:
    """The one error line of `kvchat ARGS`, which must end before any model loads."""
    monkeypatch.setattr(cli.options, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    code, lines, _ = kvchat(args, capsys, monkeypatch, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (lambda p: write_pdf(p, 1, user_password="secret"), "the PDF is encrypted with a password"),
        (write_scanned_pdf, "no text layer (2 scanned or image-only pages); run OCR on it first"),
        (write_corrupt_pdf, "not a readable PDF (damaged or truncated)"),
    ],
)
def test_a_pdf_that_cannot_be_read_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, make, cause):
    path = make(tmp_path / "bad.pdf")
    line = refused(["ask", "What is it about?", "--file", str(path)], tmp_path, capsys, monkeypatch)
    assert line.startswith(f"kvchat: error: {path}: ") and cause in line


def test_a_file_over_the_limit_is_refused_without_being_read(tmp_path, capsys, monkeypatch):
    big = tmp_path / "big.pdf"
    with big.open("wb") as out:
        out.truncate(MAX_FILE_BYTES + 1)  # sparse
    line = refused(["ask", "Why?", "--file", str(big)], tmp_path, capsys, monkeypatch)
    assert "over the 64 MB limit; split it" in line


def test_a_missing_reader_is_one_line_naming_the_install_command(tmp_path, capsys, monkeypatch):
    paper = write_pdf(tmp_path / "paper.pdf", 1)
    monkeypatch.setitem(sys.modules, "pypdfium2", None)  # what an uninstalled package looks like
    line = refused(["ask", "Why?", "--file", str(paper)], tmp_path, capsys, monkeypatch)
    assert "pypdfium2 is not installed" in line and "pip install -e '.[docs]'" in line


def test_file_may_be_repeated_and_compare_takes_it_too():
    parser = build_parser({})
    assert parser.parse_args(["ask", "Q", "--file", "a.pdf", "--file", "b.txt"]).file == ["a.pdf", "b.txt"]
    assert parser.parse_args(["compare", "Q", "--file", "a.pdf"]).file == ["a.pdf"]


def test_repeated_files_are_put_before_the_question_in_the_order_given(tmp_path):
    paper, book, report = (
        write_pdf(tmp_path / "z.pdf", 2),
        write_epub(tmp_path / "a.epub"),
        write_docx(tmp_path / "m.docx"),
    )
    text = read_documents([str(paper), str(book), str(report)])
    assert text is not None
    assert (
        text.index("=== z.pdf · 2 pages ===") < text.index("=== a.epub · 3 chapters ===") < text.index("=== m.docx ===")
    )
    assert "--- page 2 ---\n" + page_text(2) in text


def test_a_folder_gives_its_files_in_name_order_and_says_so_on_stderr(tmp_path, capsys):
    folder = tmp_path / "island"
    folder.mkdir()
    write_pdf(folder / "b.pdf", 1)
    (folder / "a.md").write_text("# Notes\n", encoding="utf-8")
    (folder / "c.bin").write_bytes(b"\x00\x01")
    text = read_documents([str(folder)])
    assert text is not None and text.index("=== a.md ===") < text.index("=== b.pdf · 1 page ===")
    err = capsys.readouterr().err
    assert err.startswith(f"kvchat: --file {folder}: 2 files in name order (a.md, b.pdf); skipped 1 file: c.bin (")


def test_ask_about_a_pdf_answers_and_reports_its_pages(tmp_path, model_process):
    paper = write_pdf(tmp_path / "paper.pdf", 3)
    done = model_process(
        ["ask", "What does page 2 say?", "--file", str(paper), "--json", "--no-save", "--max-new-tokens", "24"],
        tmp_path,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    answer = json.loads(done.stdout)
    assert answer["answer"].strip()
    assert [span["role"] for span in answer["memory"]][:3] == ["system", "document", "user"]
    assert [(p["document"], p["part"]) for p in answer["parts"]] == [("paper.pdf", f"p. {n}") for n in (1, 2, 3)]
    assert all(p["kept"] == 1.0 for p in answer["parts"])  # three short pages fit the default cache


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the file being read")
def test_ctrl_c_while_a_long_pdf_is_read_stops_without_a_traceback(tmp_path):
    long = write_long_pdf(tmp_path / "long.pdf", 10_000)  # a few seconds to read
    environment = {**os.environ, "KVCHAT_DB": str(tmp_path / "kvchat.db"), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [*KVCHAT, "ask", "What is it about?", "--file", str(long)],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while str(long) not in open_files(process.pid):  # PDFium has the file open: reading
        assert process.poll() is None and time.monotonic() < deadline, "the PDF was never opened"
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err == "kvchat: interrupted\n" and out == ""


def open_files(pid: int) -> set[str]:
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:  # a descriptor closed while listing
        return set()
