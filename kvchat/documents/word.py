"""Word documents (.docx) through python-docx: paragraphs and tables in the order they
come, headings marked `#`, list items `- `, a table row per line. A .docx file has no pages
of its own (they depend on the program that lays it out), so it is one part."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from kvchat.documents.base import Document, refused, whole
from kvchat.optional import require


def read(path: Path) -> Document:
    require("lxml")
    require("docx")
    import docx
    from docx.opc.exceptions import PackageNotFoundError

    try:
        document = docx.Document(str(path))
        # python-docx looks a paragraph's style up among all the styles each time it is
        # asked (7.8 s for 2,600 paragraphs): the names are read once here.
        styles = {style.style_id: style.name or "" for style in document.styles}
        lines = [line for block in document.iter_inner_content() for line in block_lines(block, styles)]
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError):
        raise refused(path, "not a readable Word document (damaged, or not .docx); open it and save it again") from None
    text = "\n".join(lines)
    if not text.strip():
        raise refused(path, "the Word document holds no text")
    return whole(path, "docx", text)


def block_lines(block: Any, styles: dict[str, str]) -> list[str]:
    """A paragraph as one line, a table as one line per row. `styles`: name by style id."""
    from docx.table import Table

    if isinstance(block, Table):
        return [" | ".join(cell_text(cell) for cell in unique_cells(row)) for row in block.rows]
    text = block.text.strip()
    if not text:
        return []
    style = styles.get(block._p.style or "", "")  # the paragraph's style id, as the file names it
    if style.startswith("Heading") and style[-1:].isdigit():
        return ["#" * int(style[-1]) + " " + text]
    if style == "Title":
        return ["# " + text]
    if style.startswith("List"):
        return ["- " + text]
    return [text]


def unique_cells(row: Any) -> list[Any]:
    """A row's cells, a merged cell once (python-docx repeats it for every grid column)."""
    seen: list[Any] = []
    for cell in row.cells:
        if not any(cell._tc is other._tc for other in seen):
            seen.append(cell)
    return seen


def cell_text(cell: Any) -> str:
    return " ".join(cell.text.split())
