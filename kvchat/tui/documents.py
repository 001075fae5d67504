"""Documents attached to a question: pasted text or a file read with `/file PATH`.

A long paste does not go into the editor as a wall of text: it becomes an
`AttachedDocument` (shown as a chip) whose text is put before the question on send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# A paste at least this long (or with this many lines) becomes a document chip:
# shorter pastes (a line of code, a short quote) stay editable in the editor.
LONG_PASTE_CHARS = 2000
LONG_PASTE_LINES = 40
# Files above this size are refused: they would not fit any sensible context anyway.
MAX_FILE_BYTES = 16_000_000
# How much of a file is sniffed for NUL bytes to call it binary.
BINARY_SNIFF_BYTES = 8192


class DocumentError(Exception):
    """A file could not be attached; the message names the cause and the way out."""


@dataclass
class AttachedDocument:
    number: int  # 1, 2, ... within the message being composed
    text: str
    source: str = ""  # the file path for /file, "" for a paste
    tokens: int | None = None  # None until counted

    @property
    def name(self) -> str:
        base = f"Document {self.number}"
        return f"{base} ({Path(self.source).name})" if self.source else base

    @property
    def label(self) -> str:
        count = f"{self.tokens:,} tokens" if self.tokens is not None else "counting tokens…"
        return f"{self.name} · {count}"

    @property
    def sent_label(self) -> str:
        """For the sent message: the token count, or the size if counting is not done."""
        size = f"{self.tokens:,} tokens" if self.tokens is not None else f"{len(self.text):,} characters"
        return f"{self.name} · {size}"


def is_long_paste(text: str) -> bool:
    return len(text) >= LONG_PASTE_CHARS or text.count("\n") >= LONG_PASTE_LINES


def split_file_argument(argument: str) -> tuple[str, str]:
    """`/file`'s argument as (path, question): the whole argument when it names a file (a
    path may hold spaces), else the longest part up to a space that names a file, and
    the rest as the question typed after it ("/file notes.txt What is the password?");
    else the whole argument, for `read_text_file` to say what is wrong with it."""
    text = argument.strip()
    if not text or Path(text).expanduser().is_file():
        return text, ""
    cuts = [i for i, char in enumerate(text) if char.isspace()]
    for cut in reversed(cuts):
        if Path(text[:cut]).expanduser().is_file():
            return text[:cut], text[cut:].strip()
    return text, ""


def read_text_file(path_text: str) -> str:
    """The UTF-8 text of a file, or DocumentError saying why it cannot be attached."""
    if not path_text.strip():
        raise DocumentError("/file needs a path: /file notes.txt")
    path = Path(path_text.strip()).expanduser()
    if not path.exists():
        raise DocumentError(f"{path}: no such file; check the path (relative paths start at {Path.cwd()})")
    if not path.is_file():
        raise DocumentError(f"{path} is not a regular file; give a text file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            # Decimal megabytes, as everywhere else in the app (it said MB and counted MiB).
            raise DocumentError(
                f"{path} is {size / 1e6:.1f} MB, over the {MAX_FILE_BYTES / 1e6:.0f} MB limit; split it"
            )
        data = path.read_bytes()
    except OSError as err:
        raise DocumentError(f"{path}: cannot read it ({err.strerror or err})") from None
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        raise DocumentError(f"{path} is not a text file (binary content); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise DocumentError(f"{path} is not UTF-8 text; convert it first (e.g. iconv -t utf-8)") from None


def joined_documents(documents: Sequence[AttachedDocument]) -> str | None:
    """All attached texts, separated by blank lines (None when there are none)."""
    texts = [doc.text.strip() for doc in documents if doc.text.strip()]
    return "\n\n".join(texts) if texts else None


def split_long_user_text(text: str) -> tuple[str, int]:
    """For showing a stored user message: (question, characters of document before it).

    A message sent with a document is `document + blank line + question`; showing the
    whole document again on resume would bury the conversation, so a long message is
    shown as its last paragraph plus a note of the document's size."""
    if len(text) < LONG_PASTE_CHARS:
        return text, 0
    head, sep, question = text.rstrip().rpartition("\n\n")
    if not sep or len(question) >= LONG_PASTE_CHARS:
        return text, 0
    return question, len(head)
