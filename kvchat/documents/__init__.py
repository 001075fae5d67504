"""Reading files to attach them to a question, for `/file` in the app and `--file` on the
command line: plain text, Markdown and code as they are; PDF, HTML, Word (.docx) and EPUB
through their readers, which come with the `docs` extra (`pip install -e '.[docs]'`) and
are imported only when such a file is read.

A file's kind is told by its first bytes where it has a signature (a PDF, a .docx or an
EPUB, which are ZIP archives told apart by what they hold), else by its name. A paged or
chaptered file keeps its pages or chapters as marker lines in the text
(`kvchat.documents.base.Document`). No torch here: the app's UI reads files itself.
"""

from __future__ import annotations

import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.documents import epub, pdf, text, web, word
from kvchat.documents.base import MAX_FILE_BYTES, Document, ReadProgress, check_stop, refused
from kvchat.errors import DocumentError
from kvchat.optional import MissingPackage

__all__ = [
    "MAX_FILE_BYTES",
    "Document",
    "DocumentError",
    "Folder",
    "ReadProgress",
    "checked_path",
    "kind_of",
    "read_document",
    "read_folder",
]

SUFFIXES = {
    ".pdf": "pdf",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".docx": "docx",
    ".epub": "epub",
}
# A PDF's signature may follow a few bytes of junk (PDF readers look in the first 1,024).
PDF_SIGNATURE = b"%PDF-"
ZIP_SIGNATURE = b"PK\x03\x04"
HEAD_BYTES = 1024


def kind_of(path: Path, head: bytes) -> str:
    """text | pdf | html | docx | epub, from the first bytes, else from the name."""
    if PDF_SIGNATURE in head[:HEAD_BYTES]:
        return "pdf"
    suffix = SUFFIXES.get(path.suffix.lower(), "")
    if head.startswith(ZIP_SIGNATURE) and suffix not in ("docx", "epub"):
        return zip_kind(path) or suffix or "text"
    if suffix:
        return suffix
    start = head.lstrip()[:64].lower()
    if start.startswith((b"<!doctype html", b"<html")):
        return "html"
    return "text"


def zip_kind(path: Path) -> str:
    """docx or epub for a ZIP archive that holds one ("" for any other)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if "word/document.xml" in names:
                return "docx"
            if "mimetype" in names and archive.read("mimetype").strip() == b"application/epub+zip":
                return "epub"
    except (zipfile.BadZipFile, OSError, KeyError):
        return ""
    return ""


def checked_path(path_text: str | Path) -> Path:
    """The path of an existing file or folder, or DocumentError saying what is wrong."""
    if not str(path_text).strip():
        raise DocumentError("no file given: name a file, e.g. notes.txt or paper.pdf")
    path = Path(str(path_text).strip()).expanduser()
    if not path.exists():
        raise DocumentError(f"{path}: no such file; check the path (relative paths start at {Path.cwd()})")
    return path


def read_document(
    path_text: str | Path, on_progress: ReadProgress | None = None, cancel: threading.Event | None = None
) -> Document:
    """One file as a `Document`. `on_progress(done, total)` hears of every page or chapter
    read; a set `cancel` stops the reading between them (`kvchat.errors.Cancelled`).
    Refusals are `DocumentError`s, and a reader that is not installed is
    `kvchat.optional.MissingPackage`; both are one line naming the way out."""
    path = checked_path(path_text)
    if not path.is_file():
        raise refused(path, "not a regular file; give a file (a folder is read with read_folder)")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            # Decimal megabytes, as everywhere else in kvchat.
            raise refused(path, f"{size / 1e6:.1f} MB, over the {MAX_FILE_BYTES / 1e6:.0f} MB limit; split it")
        with path.open("rb") as stream:
            head = stream.read(HEAD_BYTES)
        kind = kind_of(path, head)
        if kind == "pdf":
            return pdf.read(path, on_progress, cancel)
        if kind == "epub":
            return epub.read(path, on_progress, cancel)
        if kind == "docx":
            return word.read(path)
        data = path.read_bytes()
    except OSError as err:
        raise refused(path, f"cannot read it ({err.strerror or err})") from None
    if kind == "html":
        return web.read(path, data)
    return text.read(path, data)


@dataclass
class Folder:
    """A folder's readable files, in name order, and those left out with the reason."""

    path: Path
    documents: list[Document] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(document.text for document in self.documents)

    def skipped_note(self, shown: int = 3) -> str:
        """ "skipped 2 files: a.bin (not a text file…), b.pdf (encrypted…)" ("" for none)."""
        if not self.skipped:
            return ""
        listed = "; ".join(f"{path.name} ({why})" for path, why in self.skipped[:shown])
        more = f"; and {len(self.skipped) - shown} more" if len(self.skipped) > shown else ""
        return f"skipped {len(self.skipped)} file{'s' if len(self.skipped) > 1 else ''}: {listed}{more}"


def folder_files(folder: Path) -> list[Path]:
    """A folder's files in name order: not its subfolders, nor hidden files (.git, .DS_Store)."""
    return sorted(
        (p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")), key=lambda p: p.name.lower()
    )


def read_folder(
    path_text: str | Path, on_progress: ReadProgress | None = None, cancel: threading.Event | None = None
) -> Folder:
    """Every readable file of a folder (`folder_files`), in name order. A file that cannot
    be read is left out with the reason (`Folder.skipped`); a folder with none is refused.
    `on_progress(done, total)` counts files."""
    folder = checked_path(path_text)
    if not folder.is_dir():
        raise refused(folder, "not a folder")
    result = Folder(folder)
    files = folder_files(folder)
    for index, path in enumerate(files):
        check_stop(cancel)
        try:
            result.documents.append(read_document(path, cancel=cancel))
        except DocumentError as err:
            result.skipped.append((path, str(err).removeprefix(f"{path}: ")))
        except MissingPackage as err:  # one kind unreadable here: the others still are
            result.skipped.append((path, str(err)))
        if on_progress is not None:
            on_progress(index + 1, len(files))
    if not result.documents:
        why = f"; {result.skipped_note()}" if result.skipped else ""
        raise refused(folder, f"the folder holds no file kvchat can read{why}")
    return result
