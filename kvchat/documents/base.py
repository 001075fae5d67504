"""What every reader shares: the document it gives back, the size limit, progress and
stopping, and the one-line refusals."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import Cancelled, DocumentError
from kvchat.turns import document_heading, part_marker, plural

# Files above this size are refused before a byte is read. A PDF or a book carries fonts
# and pictures besides its text, so the limit is far above any text that would fit a
# context (64 MB of text is about 16 million tokens).
MAX_FILE_BYTES = 64_000_000
# (parts done, parts in all): pages of a PDF, chapters of a book.
ReadProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class Document:
    """An attached file as the model reads it: `text` starts with a heading line naming
    the file, and a paged or chaptered file has a marker line before each page or
    chapter (`kvchat.turns.document_outline` finds them again)."""

    path: Path
    kind: str  # text | pdf | html | docx | epub
    text: str
    parts: int = 0  # pages or chapters (0: the file has none)
    part: str = ""  # "page" | "chapter"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def summary(self) -> str:
        """ "42 pages", "12 chapters", or "" for a file without either."""
        return plural(self.parts, self.part) if self.parts and self.part else ""


def assemble(path: Path, kind: str, parts: list[tuple[str, str]], part: str) -> Document:
    """A document of `parts` (title, text), each after its marker line; parts with no text
    keep their marker (a page number must stay that page's)."""
    lines = [document_heading(path.name, len(parts), part)]
    for number, (title, text) in enumerate(parts, 1):
        lines += [part_marker(part, number, title), text.strip()]
    return Document(path, kind, "\n".join(line for line in lines if line) + "\n", len(parts), part)


def whole(path: Path, kind: str, text: str) -> Document:
    """A document without pages or chapters: the heading line, then its text."""
    return Document(path, kind, f"{document_heading(path.name)}\n{text.strip()}\n")


def check_stop(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled()


def refused(path: Path, why: str) -> DocumentError:
    return DocumentError(f"{path}: {why}")
