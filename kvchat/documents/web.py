"""HTML and saved web pages through BeautifulSoup (with lxml's parser): the page's main
text without its menus, banners, scripts and footers; headings, list items and table rows
keep their own lines. Also the chapters of an EPUB book, whole. Why BeautifulSoup and not
trafilatura or jusText: docs/decisions/0012-document-readers.md."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from kvchat.documents.base import Document, refused, whole
from kvchat.optional import require

# Never text a reader wants, wherever they are.
NEVER_TEXT = ["script", "style", "noscript", "template", "svg", "canvas", "iframe", "object", "button", "select"]
# Around the main text, never part of it: dropped from a page (not from a book's chapter).
AROUND = ["nav", "aside", "form", "dialog"]
# A container whose class or id says it holds site furniture, unless it also says it holds
# the content ("main-sidebar" goes, "content-sidebar" stays).
FURNITURE = re.compile(
    r"(^|[-_\s])(nav|navbar|navigation|menu|menubar|breadcrumbs?|sidebar|cookies?|consent|gdpr|banner|"
    r"header|footer|masthead|share|sharing|social|related|recommended|newsletter|subscribe|signup|promo|"
    r"advert|ads|sponsor(ed)?|popup|modal|comments?|pagination|pager|skip-link|toc)($|[-_\s])",
    re.IGNORECASE,
)
CONTENT = re.compile(r"(^|[-_\s])(content|article|main|body|post|entry|text)($|[-_\s])", re.IGNORECASE)
# Elements that start a line of their own.
BLOCKS = {
    "p", "div", "section", "article", "main", "header", "footer", "blockquote", "pre", "figure",
    "figcaption", "ul", "ol", "dl", "dt", "dd", "table", "thead", "tbody", "tr", "address",
    "h1", "h2", "h3", "h4", "h5", "h6", "li", "hr", "body", "html", "caption", "details", "summary",
}  # fmt: skip
# Furniture is a container, never an inline element (mdBook's heading links are
# `<a class="header">`).
CONTAINERS = {"div", "section", "header", "footer", "ul", "ol", "dl", "table", "p", "figure", "center"}
SPACES = re.compile(r"\s+")
# A heading or list item left without text.
BARE_MARK = re.compile(r"^(#+|-)$")


def read(path: Path, data: bytes) -> Document:
    text = html_text(data, page=True)
    if not text.strip():
        raise refused(path, "the page holds no text (its content may be drawn by scripts); save it as PDF or text")
    return whole(path, "html", text)


def parse(markup: bytes | str) -> Any:
    """The parsed tree; bytes are decoded by the page's own declared charset."""
    require("bs4")
    require("lxml")
    from bs4 import BeautifulSoup, XMLParsedAsHTMLWarning

    with warnings.catch_warnings():
        # A book's chapters are XHTML: read as HTML, as a browser does, they give the
        # same text, and the warning would reach the user's terminal.
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        return BeautifulSoup(markup, "lxml")


def html_text(markup: bytes | str, page: bool) -> str:
    """The text of an HTML document. `page`: a web page, whose main text is picked out of
    its menus, banners and footers; else (a book's chapter) everything that is text."""
    return extract(parse(markup), page)


def chapter(markup: bytes | str) -> tuple[str, str]:
    """A book chapter's (title, text): the title is its first heading's, else its <title>'s."""
    soup = parse(markup)
    heading = soup.find(["h1", "h2", "h3"]) or soup.find("title")
    title = " ".join(heading.get_text(" ").split()) if heading is not None else ""
    return title, extract(soup, page=False)


def extract(soup: Any, page: bool) -> str:
    for tag in soup(NEVER_TEXT):
        tag.decompose()
    root = soup.body or soup
    if page:
        root = main_part(soup) or root
        for tag in root(AROUND):
            tag.decompose()
        if root.name in ("body", "html", "[document]"):
            for tag in root(["header", "footer"]):
                tag.decompose()
        for tag in [t for t in root.find_all(True) if is_furniture(t)]:
            if not tag.decomposed:
                tag.decompose()
    return render(root)


def main_part(soup: Any) -> Any:
    """The element that holds the page's main text, where the page says which."""
    main = soup.find("main") or soup.find(attrs={"role": "main"})
    if main is not None:
        return main
    articles = soup.find_all("article")
    if articles:  # a blog post is one article; a listing page several: the longest
        return max(articles, key=lambda tag: len(tag.get_text()))
    return None


def is_furniture(tag: Any) -> bool:
    if tag.name not in CONTAINERS or tag.attrs is None:  # (None: dropped with a container)
        return False
    names = " ".join([*tag.get("class", []), tag.get("id", "")])
    return bool(names) and bool(FURNITURE.search(names)) and not CONTENT.search(names)


def render(root: Any) -> str:
    """The tree as lines: whitespace collapsed as a browser does (kept in <pre>), a line
    per block, `#` before headings and `- ` before list items."""
    from bs4 import NavigableString
    from bs4.element import Comment, Declaration, Doctype, ProcessingInstruction

    skipped = (Comment, Declaration, Doctype, ProcessingInstruction)
    out: list[str] = []

    def newline() -> None:
        if out and not out[-1].endswith("\n"):
            out[-1] = out[-1].rstrip(" ")
            out.append("\n")

    def walk(node: Any, pre: bool) -> None:
        for child in node.children:
            if isinstance(child, NavigableString):
                if isinstance(child, skipped):
                    continue
                text = str(child) if pre else SPACES.sub(" ", str(child))
                if not pre and (not out or out[-1].endswith(("\n", " "))):
                    text = text.lstrip(" ")
                if text:
                    out.append(text)
                continue
            name = child.name
            if name == "br":
                out.append("\n")
                continue
            if name in ("td", "th") and out and not out[-1].endswith("\n"):
                out.append(" | ")
            block = name in BLOCKS
            if block:
                newline()
                if name in ("h1", "h2", "h3", "h4", "h5", "h6"):
                    out.append("#" * int(name[1]) + " ")
                elif name == "li":
                    out.append("- ")
            walk(child, pre or name == "pre")
            if block:
                newline()

    walk(root, False)
    lines = "".join(out).split("\n")
    text = "\n".join(line.rstrip() for line in lines if not BARE_MARK.match(line.strip()))
    return re.sub(r"\n{3,}", "\n\n", text).strip()
