"""Attached documents in the editor (kvchat/tui/documents.py): what a chip says, which
part of `/file`'s argument is the path, and which pastes are paths to offer to attach."""

from __future__ import annotations

from kvchat.tui.documents import AttachedDocument, pasted_path, split_file_argument


def test_a_chip_names_the_file_its_pages_and_its_tokens():
    chip = AttachedDocument(1, "…", source="/papers/paper.pdf", tokens=31_200, summary="42 pages")
    assert chip.label == "paper.pdf · 42 pages · 31,200 tokens"


def test_a_chip_of_a_paste_names_only_its_number_and_tokens():
    assert AttachedDocument(2, "pasted text").label == "Document 2 · counting tokens…"
    assert AttachedDocument(2, "pasted text").sent_label == "Document 2 · 11 characters"


def test_the_file_argument_may_name_a_folder_and_be_followed_by_a_question(tmp_path):
    folder = tmp_path / "my papers"
    folder.mkdir()
    assert split_file_argument(f"{folder} What do they agree on?") == (str(folder), "What do they agree on?")


def test_a_pasted_absolute_path_of_an_existing_file_is_a_path(tmp_path):
    paper = tmp_path / "paper.pdf"
    paper.write_bytes(b"%PDF-1.4")
    assert pasted_path(f"  {paper}\n") == paper


def test_a_path_dropped_on_a_terminal_is_a_path_quoted_escaped_or_as_an_address(tmp_path):
    paper = tmp_path / "my paper.pdf"
    paper.write_bytes(b"%PDF-1.4")
    assert pasted_path(f"'{paper}'") == paper
    assert pasted_path(str(paper).replace(" ", "\\ ")) == paper
    assert pasted_path("file://" + str(paper).replace(" ", "%20")) == paper


def test_text_that_is_no_existing_path_is_pasted_as_text(tmp_path):
    assert pasted_path(str(tmp_path / "missing.pdf")) is None
    assert pasted_path("README") is None  # a word, even one that names a file here
    assert pasted_path(f"{tmp_path}\nsecond line") is None


def test_a_chip_of_a_folder_names_the_folder_and_its_files(tmp_path):
    chip = AttachedDocument(1, "…", source=str(tmp_path / "."), tokens=900, summary="3 files")
    assert chip.label == f"{tmp_path.name}/ · 3 files · 900 tokens"
