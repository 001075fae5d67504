"""Which libraries read documents for `/file` and `--file` (docs/decisions/0012): their
speed, their text and their install weight, on generated files with known text and on
the real files this machine has.

Run it from the checkout with a Python that has every candidate installed, and point
`--venvs` at a folder holding one fresh virtual environment per candidate (`v-NAME`, NAME
as pip knows it; `v-empty`, none; `v-docs-extra`, kvchat's `docs` extra) for install
weight and import time:

    PYTHONPATH=. python docs/bench/readers/measure.py --venvs /tmp/measure --out /tmp/measure/out

The candidates: pypdfium2 and pypdf (PDF); trafilatura, jusText and BeautifulSoup, as
kvchat.documents.web uses it (HTML); python-docx (DOCX) and ebooklib (EPUB), which have no
well-kept rival, timed through kvchat.documents.
"""

from __future__ import annotations

import argparse
import difflib
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REAL_PDFS = [
    Path("/usr/share/doc/libtasn1-doc/libtasn1.pdf"),
    Path("/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf"),
]
RUST_BOOK = Path.home() / ".rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/html/book"
LIBFFI = Path("/usr/share/doc/libffi8/html")
IMPORTS = {
    "pypdfium2": "pypdfium2",
    "pypdf": "pypdf",
    "trafilatura": "trafilatura",
    "justext": "justext",
    "beautifulsoup4": "bs4",
    "python-docx": "docx",
    "ebooklib": "ebooklib.epub",
    "docs-extra": "pypdfium2, bs4, lxml.etree, docx, ebooklib.epub",
}


def best(fn, repeats: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, words(a), words(b), autojunk=False).ratio()


# -- the source text: the Python documentation that ships with the standard library --------
def source_pages(count: int, chars: int = 2400) -> list[str]:
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    text = text.encode("latin-1", "ignore").decode("latin-1")  # fpdf2's core fonts
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    pages, page = [], ""
    for paragraph in paragraphs:
        if len(page) + len(paragraph) > chars and page:
            pages.append(page)
            page = ""
            if len(pages) == count:
                break
        page += paragraph[:chars] + "\n"
    return pages


# -- PDF ---------------------------------------------------------------------------------------
def write_pdf(path: Path, pages: list[str]) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=9)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 4, text)
    pdf.output(str(path))


def pdfium_pages(path: Path) -> list[str]:
    import pypdfium2

    document = pypdfium2.PdfDocument(str(path))
    try:
        return [page.get_textpage().get_text_bounded() for page in document]
    finally:
        document.close()


def pypdf_pages(path: Path) -> list[str]:
    from pypdf import PdfReader

    return [page.extract_text() for page in PdfReader(str(path)).pages]


def pypdf_layout_pages(path: Path) -> list[str]:
    from pypdf import PdfReader

    return [page.extract_text(extraction_mode="layout") for page in PdfReader(str(path)).pages]


def kvchat_pages(path: Path) -> list[str]:
    """kvchat.documents's PDF reader, whole (its text split at its page markers)."""
    from kvchat.documents import read_document

    return re.split(r"^--- page \d+ ---$", read_document(path).text, flags=re.MULTILINE)[1:]


PDF_READERS = {
    "pypdfium2": pdfium_pages,
    "kvchat (pypdfium2)": kvchat_pages,
    "pypdf": pypdf_pages,
    "pypdf (layout)": pypdf_layout_pages,
}


def glued(text: str) -> int:
    """Runs of 25+ letters: words run together where a reader lost the spaces."""
    return len(re.findall(r"[A-Za-z]{25,}", text))


def measure_pdfs(work: Path) -> dict:
    pages = source_pages(300)
    generated = work / "generated.pdf"
    write_pdf(generated, pages)
    results: dict = {"generated": {"pages": len(pages), "bytes": generated.stat().st_size}}
    for name, read in PDF_READERS.items():
        seconds, got = best(lambda read=read: read(generated))
        assert isinstance(got, list)
        sample = range(0, len(pages), 10)
        results["generated"][name] = {
            "seconds": round(seconds, 3),
            "ms_per_page": round(1000 * seconds / len(pages), 2),
            "word_match": round(statistics.mean(similarity(pages[i], got[i]) for i in sample), 4),
            "glued": sum(glued(t) for t in got),
        }
    for real in REAL_PDFS:
        if not real.is_file():
            continue
        entry: dict = {"bytes": real.stat().st_size}
        texts = {}
        for name, read in PDF_READERS.items():
            seconds, got = best(lambda read=read, real=real: read(real))
            assert isinstance(got, list)
            texts[name] = got
            entry[name] = {
                "seconds": round(seconds, 3),
                "pages": len(got),
                "chars": sum(len(t) for t in got),
                "glued": sum(glued(t) for t in got),
                "page_3": got[min(2, len(got) - 1)][:600],
            }
        entry["pypdfium2_vs_pypdf"] = round(
            statistics.mean(similarity(a, b) for a, b in zip(texts["pypdfium2"], texts["pypdf"])), 4
        )
        results[real.name] = entry
    return results


# -- HTML --------------------------------------------------------------------------------------
BOILERPLATE = [
    "Home Products Pricing Blog Careers Contact us",
    "We use cookies to improve your experience. Accept all cookies or manage preferences.",
    "Subscribe to our newsletter for weekly updates on gardening and seeds.",
    "Copyright 2026 Example Gardens Limited. All rights reserved. Privacy policy and terms of use.",
    "Related articles: Ten tips for tomatoes, Why compost matters, Winter pruning explained.",
    "Share this article on Facebook, Twitter, LinkedIn or by email.",
]
MAIN = [
    "Growing beans on a balcony takes a deep pot, a sunny wall and a little patience.",
    "Sow the seeds two centimetres deep in late spring, once the nights stay above ten degrees.",
    "Water the pot in the morning so that the leaves dry before the evening, which keeps mildew away.",
    "A bamboo cane or a string tied to the railing gives the climbing varieties something to hold.",
    "Pick the pods while they are still thin: the plant then keeps flowering for weeks.",
    "Dwarf varieties need no support and suit a windy corner better than climbers do.",
]


def made_page() -> str:
    """A saved web page as CMSs write them: menus and banners in plain divs, a script."""
    paragraphs = "".join(f"<p>{p}</p>" for p in MAIN)
    return (
        "<html><head><title>Beans on a balcony</title><script>var tracking = 'load analytics now';</script>"
        "<style>.menu{color:red}</style></head><body>"
        f'<div class="top-menu"><a href="/">{BOILERPLATE[0]}</a></div>'
        f'<div id="cookie-banner"><span>{BOILERPLATE[1]}</span><button>Accept</button></div>'
        '<div class="content"><h1>Beans on a balcony</h1>'
        f"{paragraphs}</div>"
        f'<div class="sidebar"><div class="newsletter">{BOILERPLATE[2]}</div>'
        f'<div class="related">{BOILERPLATE[4]}</div><div class="share">{BOILERPLATE[5]}</div></div>'
        f'<div class="footer">{BOILERPLATE[3]}</div>'
        "<script>document.write('more tracking code here');</script></body></html>"
    )


def extract_trafilatura(html: str) -> str:
    import trafilatura

    return trafilatura.extract(html, include_comments=False, include_tables=True, favor_recall=True) or ""


def extract_justext(html: str) -> str:
    import justext

    paragraphs = justext.justext(html.encode("utf-8"), justext.get_stoplist("English"))
    return "\n".join(p.text for p in paragraphs if not p.is_boilerplate)


def extract_soup(html: str) -> str:
    """kvchat's own: BeautifulSoup with lxml's parser, kvchat.documents.web."""
    from kvchat.documents.web import html_text

    return html_text(html, page=True)


HTML_EXTRACTORS = {"trafilatura": extract_trafilatura, "justext": extract_justext, "beautifulsoup4": extract_soup}


def found(line: str, text: str) -> bool:
    """`line` is in `text`, whatever the white space (readers space inline code apart or not)."""
    return "".join(line.split()) in "".join(text.split())


def page_truth(html: str) -> tuple[list[str], list[str]]:
    """(main paragraphs, navigation link texts) of a real documentation page."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "lxml")
    links = []
    for nav in soup.select("nav, .nav-panel, .header, .sidebar"):
        links += [a.get_text(" ", strip=True) for a in nav.find_all("a")]
        nav.decompose()
    for tag in soup(["script", "style"]):
        tag.decompose()
    # mdBook pages hold a keyboard help pop-up outside <main>: not the page's text.
    root = soup.find("main") or soup
    paragraphs = [p.get_text(" ", strip=True) for p in root.find_all("p")]
    return [p for p in paragraphs if len(p.split()) >= 6], [t for t in links if len(t.split()) >= 3]


def measure_html() -> dict:
    results: dict = {}
    page = made_page()
    for name, extract in HTML_EXTRACTORS.items():
        text = extract(page)
        results.setdefault("made page", {})[name] = {
            "main_found": sum(found(p, text) for p in MAIN) / len(MAIN),
            "boilerplate_found": sum(found(b, text) for b in BOILERPLATE) / len(BOILERPLATE),
            "script_found": "tracking" in text,
        }
    corpora = {
        "rust book (mdBook)": sorted(RUST_BOOK.glob("ch0[3-6]-*.html"))[:12],
        "libffi manual (texinfo)": sorted(LIBFFI.glob("*.html"))[:12],
    }
    for corpus, files in corpora.items():
        if not files:
            continue
        pages = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        truths = [page_truth(p) for p in pages]
        for name, extract in HTML_EXTRACTORS.items():
            seconds, texts = best(lambda extract=extract, pages=pages: [extract(p) for p in pages])
            assert isinstance(texts, list)
            main = [found(p, t) for (ps, _), t in zip(truths, texts) for p in ps]
            leak = [
                any(found(link, line) for line in t.splitlines()) for (_, ls), t in zip(truths, texts) for link in ls
            ]
            results.setdefault(corpus, {"pages": len(pages)})[name] = {
                "ms_per_page": round(1000 * seconds / len(pages), 2),
                "main_paragraphs_found": round(sum(main) / max(1, len(main)), 4),
                "nav_links_found": round(sum(leak) / max(1, len(leak)), 4),
            }
    return results


# -- DOCX and EPUB: speed only ----------------------------------------------------------------
def measure_docx_epub(work: Path) -> dict:
    import docx
    from ebooklib import epub

    from kvchat.documents import read_document

    pages = source_pages(300)
    path = work / "generated.docx"
    document = docx.Document()
    for text in pages:
        for paragraph in text.splitlines():
            document.add_paragraph(paragraph)
    document.save(str(path))
    seconds, _ = best(lambda: read_document(path))
    results = {"docx": {"paragraphs": sum(len(t.splitlines()) for t in pages), "seconds": round(seconds, 3)}}

    book = epub.EpubBook()
    book.set_identifier("measure")
    book.set_title("Measure")
    chapters = []
    for index in range(0, len(pages), 10):
        chapter = epub.EpubHtml(title=f"Chapter {index // 10 + 1}", file_name=f"c{index}.xhtml")
        chapter.content = "".join(f"<p>{p}</p>" for t in pages[index : index + 10] for p in t.splitlines())
        book.add_item(chapter)
        chapters.append(chapter)
    book.spine = chapters
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    path = work / "generated.epub"
    epub.write_epub(str(path), book)

    def read_epub() -> str:
        return read_document(path).text

    seconds, _ = best(read_epub)
    results["epub"] = {"chapters": len(chapters), "seconds": round(seconds, 3)}
    return results


# -- install weight and import time, one fresh venv per candidate ---------------------------------
def site_kb(venv: Path) -> int:
    site = next(venv.glob("lib/python3*/site-packages"))
    return int(subprocess.run(["du", "-sk", str(site)], capture_output=True, text=True).stdout.split()[0])


def import_ms(python: Path, module: str, repeats: int = 7) -> float:
    def run(code: str) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([str(python), "-c", code], check=True)
            times.append(time.perf_counter() - start)
        return min(times)

    return round(1000 * (run(f"import {module}") - run("pass")), 1)


def measure_installs(venvs: Path) -> dict:
    empty = site_kb(venvs / "v-empty")
    results = {}
    for package, module in IMPORTS.items():
        venv = venvs / f"v-{package}"
        if not venv.is_dir():
            continue
        frozen = subprocess.run([str(venv / "bin/pip"), "list", "--format=freeze"], capture_output=True, text=True)
        results[package] = {
            "installed_mb": round((site_kb(venv) - empty) / 1000, 1),
            "packages": [line for line in frozen.stdout.split() if not line.startswith(("pip==", "setuptools=="))],
            "import_ms": import_ms(venv / "bin/python", module),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venvs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "commit": commit,
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "installs": measure_installs(args.venvs),
        # kvchat's readers load their libraries only when a file of theirs is read.
        "kvchat_documents_import_ms": import_ms(Path(sys.executable), "kvchat.documents"),
        "pdf": measure_pdfs(work),
        "html": measure_html(),
        "docx_epub": measure_docx_epub(work),
    }
    for path in work.iterdir():
        path.unlink()
    work.rmdir()
    (args.out / "readers.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
