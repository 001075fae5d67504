"""PDF through pypdfium2 (PDFium, the PDF engine of Chromium): each page's text layer in
reading order, with a marker line before each page. Why PDFium and not pypdf:
docs/decisions/0012-document-readers.md."""

from __future__ import annotations

import threading
from pathlib import Path

from kvchat.documents.base import Document, ReadProgress, assemble, check_stop, refused
from kvchat.optional import require

# A page with fewer characters than this is taken to have no text layer (a scan may carry
# a stray page number or a few characters of noise).
MIN_PAGE_CHARS = 16
# PDFium's load errors (fpdfview.h's FPDF_ERR_*).
ERR_PASSWORD = 4
ERR_SECURITY = 6


def read(path: Path, on_progress: ReadProgress | None = None, cancel: threading.Event | None = None) -> Document:
    require("pypdfium2")
    import pypdfium2

    try:
        document = pypdfium2.PdfDocument(str(path))
    except pypdfium2.PdfiumError as err:
        code = getattr(err, "err_code", None)
        if code == ERR_PASSWORD:
            raise refused(
                path,
                "the PDF is encrypted with a password; save an unprotected copy (e.g. qpdf --decrypt) and attach it",
            ) from None
        if code == ERR_SECURITY:
            raise refused(
                path, "the PDF uses a security handler PDFium does not support; save an unprotected copy"
            ) from None
        raise refused(
            path, "not a readable PDF (damaged or truncated); open it in a viewer and save it again"
        ) from None
    # Pages are closed before their document, as PDFium wants; a read cut short (Esc,
    # Ctrl+C) closes nothing by hand and leaves the order to pypdfium2's finalizers, which
    # would otherwise find a document closed under a page still open.
    try:
        count = len(document)
        pages: list[tuple[str, str]] = []
        for index in range(count):
            check_stop(cancel)
            page = document[index]
            textpage = page.get_textpage()
            pages.append(("", clean(textpage.get_text_bounded())))
            textpage.close()
            page.close()
            if on_progress is not None:
                on_progress(index + 1, count)
    except pypdfium2.PdfiumError:
        raise refused(
            path, "a page of the PDF cannot be read (damaged); open it in a viewer and save it again"
        ) from None
    document.close()
    if count == 0:
        raise refused(path, "the PDF has no pages")
    if all(len(text.strip()) < MIN_PAGE_CHARS for _, text in pages):
        raise refused(
            path,
            f"the PDF has no text layer ({count} scanned or image-only page{'s' if count > 1 else ''}); "
            "run OCR on it first (e.g. ocrmypdf in.pdf out.pdf) and attach the result",
        )
    return assemble(path, "pdf", pages, "page")


def clean(text: str) -> str:
    """PDFium ends lines with CR LF, and where it joined a word hyphenated at a line end
    ("manip-" "ulation") it leaves \\x02 in the word's middle."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x02", "")
