"""Documents attached to a question: pasted text, or a file or folder that `/file PATH`
(or a pasted path) attaches, read by `kvchat.documents`.

A long paste does not go into the editor as a wall of text: it becomes an
`AttachedDocument` (shown as a chip) whose text is put before the question on send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

# A paste at least this long (or with this many lines) becomes a document chip:
# shorter pastes (a line of code, a short quote) stay editable in the editor.
LONG_PASTE_CHARS = 2000
LONG_PASTE_LINES = 40
# A pasted path longer than this is no path (Linux allows 4,096 bytes).
MAX_PATH_CHARS = 4096


@dataclass
class AttachedDocument:
    number: int  # 1, 2, ... within the message being composed
    text: str
    source: str = ""  # the file or folder path for /file, "" for a paste
    tokens: int | None = None  # None until counted
    summary: str = ""  # "42 pages", "12 chapters", "3 files"; "" for none

    @property
    def name(self) -> str:
        """The file's name ("island/" for a folder's files), else "Document 2"."""
        if not self.source:
            return f"Document {self.number}"
        path = Path(self.source)
        return f"{path.name}/" if path.is_dir() else path.name

    @property
    def label(self) -> str:
        count = f"{self.tokens:,} tokens" if self.tokens is not None else "counting tokens…"
        return " · ".join(part for part in (self.name, self.summary, count) if part)

    @property
    def sent_label(self) -> str:
        """For the sent message: the token count, or the size if counting is not done."""
        size = f"{self.tokens:,} tokens" if self.tokens is not None else f"{len(self.text):,} characters"
        return " · ".join(part for part in (self.name, self.summary, size) if part)


def is_long_paste(text: str) -> bool:
    return len(text) >= LONG_PASTE_CHARS or text.count("\n") >= LONG_PASTE_LINES


def split_file_argument(argument: str) -> tuple[str, str]:
    """`/file`'s argument as (path, question): the whole argument when it names a file or
    folder (a path may hold spaces), else the longest part up to a space that names one,
    and the rest as the question typed after it ("/file notes.txt What is the password?");
    else the whole argument, for the reader to say what is wrong with it."""
    text = argument.strip()
    if not text or Path(text).expanduser().exists():
        return text, ""
    cuts = [i for i, char in enumerate(text) if char.isspace()]
    for cut in reversed(cuts):
        if Path(text[:cut]).expanduser().exists():
            return text[:cut], text[cut:].strip()
    return text, ""


def pasted_path(text: str) -> Path | None:
    """The file or folder a paste names, as a terminal pastes a path dropped on it (quoted,
    with escaped spaces, or as a file:// address); None for any other paste."""
    candidate = text.strip()
    if not candidate or "\n" in candidate or len(candidate) > MAX_PATH_CHARS:
        return None
    if len(candidate) > 1 and candidate[0] == candidate[-1] and candidate[0] in "'\"":
        candidate = candidate[1:-1]
    elif candidate.startswith("file://"):
        candidate = unquote(urlparse(candidate).path)
    else:
        candidate = candidate.replace("\\ ", " ")
    try:
        path = Path(candidate).expanduser()
        return path if (path.is_absolute() or candidate.startswith(("~", "."))) and path.exists() else None
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return None


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
