"""Real files of every kind kvchat reads, written by the libraries that make them (fpdf2 for
PDF, python-docx, ebooklib), with text the tests know: the reader tests, the command line's
and the app's use them."""

from __future__ import annotations

from pathlib import Path


def page_text(number: int) -> str:
    """The known text of page `number` of `write_pdf`'s files."""
    return f"Page {number} tells of the lighthouse keeper number {number * 7}."


def write_pdf(path: Path, pages: int | list[str] = 3, *, user_password: str | None = None) -> Path:
    """A PDF whose page N holds `page_text(N)` (or the given texts), encrypted when a
    user password is given."""
    from fpdf import FPDF

    texts = [page_text(n) for n in range(1, pages + 1)] if isinstance(pages, int) else pages
    document = FPDF()
    document.set_font("Helvetica", size=12)
    for text in texts:
        document.add_page()
        document.multi_cell(0, 6, text)
    if user_password is not None:
        document.set_encryption(owner_password="owner", user_password=user_password)
    document.output(str(path))
    return path


def write_scanned_pdf(path: Path, pages: int = 2) -> Path:
    """A PDF of pictures only (what a scanner makes): no text layer."""
    from fpdf import FPDF
    from PIL import Image, ImageDraw

    document = FPDF()
    for number in range(1, pages + 1):
        picture = Image.new("RGB", (600, 200), "white")
        ImageDraw.Draw(picture).text((20, 80), page_text(number), fill="black")
        document.add_page()
        document.image(picture, x=10, y=10, w=180)
    document.output(str(path))
    return path


def write_corrupt_pdf(path: Path) -> Path:
    """The first half of a real PDF, as an interrupted download leaves it."""
    whole = write_pdf(path.with_name("whole-" + path.name), 3).read_bytes()
    path.write_bytes(whole[: len(whole) // 3])
    return path


MAIN_TEXT = [
    "Growing beans on a balcony takes a deep pot, a sunny wall and a little patience.",
    "Sow the seeds two centimetres deep in late spring, once the nights stay above ten degrees.",
    "Pick the pods while they are still thin: the plant then keeps flowering for weeks.",
]
BOILERPLATE = [
    "Home Products Pricing Blog Careers",
    "We use cookies to improve your experience. Accept all cookies.",
    "Copyright 2026 Example Gardens Limited. All rights reserved.",
    "Subscribe to our newsletter for weekly updates.",
]
SCRIPT_TEXT = "trackVisitor('analytics')"


def write_html_page(path: Path) -> Path:
    """A saved web page: a menu in <nav>, a cookie banner and a newsletter box in plain
    divs, scripts, a footer, and the article's text in between."""
    paragraphs = "".join(f"<p>{text}</p>" for text in MAIN_TEXT)
    path.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Beans on a balcony</title>"
        f"<script>{SCRIPT_TEXT}</script><style>p {{ color: black; }}</style></head><body>"
        f"<nav><a href='/'>{BOILERPLATE[0]}</a></nav>"
        f"<div id='cookie-banner'>{BOILERPLATE[1]}<button>OK</button></div>"
        f"<div class='post-content'><h1>Beans on a balcony</h1>{paragraphs}</div>"
        f"<div class='newsletter'>{BOILERPLATE[3]}</div>"
        f"<footer>{BOILERPLATE[2]}</footer><script>{SCRIPT_TEXT}</script></body></html>",
        encoding="utf-8",
    )
    return path


def write_docx(path: Path) -> Path:
    """A Word document: a heading, two paragraphs, a list item and a table."""
    import docx

    document = docx.Document()
    document.add_heading("Harbour report", level=1)
    document.add_paragraph("The harbour closed on Tuesday because of the storm.")
    document.add_paragraph("Ferries resume on Friday at 6 in the morning.")
    document.add_paragraph("Check the tide tables first.", style="List Bullet")
    table = document.add_table(rows=2, cols=2)
    for row, (a, b) in zip(table.rows, [("Ferry", "Departure"), ("Islander", "06:00")]):
        row.cells[0].text, row.cells[1].text = a, b
    document.save(str(path))
    return path


CHAPTERS = [
    ("The Storm", "The storm reached the island on the first night of autumn."),
    ("The Lighthouse", "The keeper climbed the 112 steps of the lighthouse twice a day."),
    ("The Rescue", "At dawn the fishing boat Marigold came home with all hands safe."),
]


def write_epub(path: Path) -> Path:
    """An EPUB book of the three `CHAPTERS`, after a cover page without text."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("kvchat-test-book")
    book.set_title("The Island")
    book.set_language("en")
    cover = epub.EpubHtml(title="Cover", file_name="cover.xhtml")
    cover.content = "<html><body><img src='cover.png' alt=''/></body></html>"
    items = [cover]
    for number, (title, text) in enumerate(CHAPTERS, 1):
        chapter = epub.EpubHtml(title=title, file_name=f"chapter{number}.xhtml")
        chapter.content = f"<html><body><h1>{title}</h1><p>{text}</p></body></html>"
        items.append(chapter)
    for item in items:
        book.add_item(item)
    book.toc = items[1:]
    book.spine = items
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    epub.write_epub(str(path), book)
    return path


def write_long_pdf(path: Path, pages: int) -> Path:
    """A PDF of `pages` copies of one page (`page_text(1)`): long to read, quick to write
    (PDFium copies the page; fpdf2 would lay out each one)."""
    import pypdfium2

    one = pypdfium2.PdfDocument(str(write_pdf(path.with_name("one-" + path.name), 1)))
    long = pypdfium2.PdfDocument.new()
    long.import_pages(one, [0] * pages)
    long.save(str(path))
    long.close()
    one.close()
    return path
