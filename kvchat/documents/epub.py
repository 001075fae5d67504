"""EPUB books through ebooklib: the chapters in reading order (the book's spine), each
after a marker line with its number and title; a chapter's XHTML becomes text as a web
page's does (kvchat.documents.web), but whole: a book has no menus to drop."""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

from kvchat.documents.base import Document, ReadProgress, assemble, check_stop, refused
from kvchat.documents.web import chapter
from kvchat.optional import require


def read(path: Path, on_progress: ReadProgress | None = None, cancel: threading.Event | None = None) -> Document:
    require("lxml")
    require("ebooklib")
    import ebooklib
    from ebooklib import epub

    try:
        # The table of contents (NCX) is not needed for the text, and a broken one would
        # refuse a readable book.
        book = epub.read_epub(str(path), {"ignore_ncx": True})
    except (epub.EpubException, zipfile.BadZipFile, KeyError, ValueError, OSError):
        raise refused(
            path, "not a readable EPUB book (damaged, or not EPUB); open it in a reader and export it again"
        ) from None
    documents = [
        item
        for idref, _ in book.spine
        if (item := book.get_item_with_id(idref)) is not None and item.get_type() == ebooklib.ITEM_DOCUMENT
    ]
    chapters: list[tuple[str, str]] = []
    for index, item in enumerate(documents):
        check_stop(cancel)
        title, text = chapter(item.get_content())
        if text.strip():  # a cover or a picture page is no chapter
            chapters.append((title, text))
        if on_progress is not None:
            on_progress(index + 1, len(documents))
    if not chapters:
        raise refused(
            path, "the book holds no readable text (DRM-protected, or pictures only); kvchat reads unprotected EPUBs"
        )
    return assemble(path, "epub", chapters, "chapter")
