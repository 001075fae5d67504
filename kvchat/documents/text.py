"""Plain text, Markdown and code: the file's UTF-8 text, as it is."""

from __future__ import annotations

from pathlib import Path

from kvchat.documents.base import Document, refused, whole

# How much of a file is sniffed for NUL bytes to call it binary.
SNIFF_BYTES = 8192


def looks_binary(head: bytes) -> bool:
    return b"\x00" in head[:SNIFF_BYTES]


def read(path: Path, data: bytes) -> Document:
    if looks_binary(data):
        raise refused(
            path, "not a text file, nor a PDF, HTML, Word (.docx) or EPUB file; convert it to text or one of those"
        )
    try:
        text = data.decode("utf-8-sig")  # a byte order mark is not part of the text
    except UnicodeDecodeError:
        raise refused(path, "not UTF-8 text; convert it first (e.g. iconv -t utf-8)") from None
    if not text.strip():
        raise refused(path, "the file is empty; nothing to attach")
    return whole(path, "text", text)
