"""An attached file's pages in the conversation: each page's tokens are known from its
marker line, the memory map says which pages the cache holds, a saved session keeps them.
The text lines run on plain reports; the rest on the real embedded model."""

from __future__ import annotations

import json

import pytest
from document_files import page_text, write_pdf

from kvchat.chat.memory_map import memory_lines, part_lines
from kvchat.documents import read_document
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.turns import MemoryReport, PartKept, user_message

QUESTION = "What does page 2 say?"


def report_of(parts: list[PartKept], recall: int = 0) -> MemoryReport:
    return MemoryReport(
        spans=[],
        layers=[],
        cell_bounds=[],
        cell_kept=[],
        cell_layers=[],
        layer_entries=[],
        layer_budgets=[],
        layer_bytes=[],
        method="h2o",
        budget="25%",
        tokens_seen=parts[-1].end if parts else 0,
        kv_bytes=0,
        recall=recall,
        parts=parts,
    )


def pages(name: str, kept: list[float], start: int = 0, size: int = 10) -> list[PartKept]:
    return [PartKept(start + i * size, start + (i + 1) * size, name, f"p. {i + 1}", k) for i, k in enumerate(kept)]


# -- the lines -------------------------------------------------------------------------------
def test_runs_of_pages_are_named_by_what_the_cache_holds_of_them():
    report = report_of(pages("paper.pdf", [0.0, 0.0, 0.3, 0.9, 1.0]), recall=32)
    assert part_lines(report) == ["paper.pdf: p. 1–2 on disk · p. 3 partly held · p. 4–5 held"]


def test_without_the_recall_tier_a_page_the_cache_lost_is_dropped():
    assert part_lines(report_of(pages("paper.pdf", [0.01, 1.0]))) == ["paper.pdf: p. 1 dropped · p. 2 held"]


def test_each_file_has_its_own_line_even_under_the_same_name():
    first = pages("notes.pdf", [1.0, 1.0])
    second = pages("notes.pdf", [0.0], start=25)  # after the second file's heading
    assert part_lines(report_of(first + second)) == ["notes.pdf: p. 1–2 held", "notes.pdf: p. 1 dropped"]


def test_a_report_without_pages_has_no_page_lines_and_saves_none():
    report = report_of([])
    assert part_lines(report) == [] and "parts" not in report.as_dict()


# -- the real model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    folder = tmp_path_factory.mktemp("paper")
    texts = [" ".join([page_text(n)] * 12) for n in range(1, 7)]  # six pages, ~100 tokens each
    return read_document(write_pdf(folder / "paper.pdf", texts))


@pytest.fixture(scope="module")
def asked(engine, paper):
    """The six-page paper and a question, answered under `window` with room for about
    two pages: the first pages leave the cache, the last ones stay."""
    session = engine.new_session(CacheSettings(method="window", budget="16", window=200, sinks=4, batch=16))
    session.send(user_message(QUESTION, paper.text), SamplingSettings(max_new_tokens=4), document=paper.text)
    return session


def test_every_page_gets_the_tokens_from_its_marker_to_the_next(asked):
    parts = asked.parts
    assert [(p.document, p.part) for p in parts] == [("paper.pdf", f"p. {n}") for n in range(1, 7)]
    assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
    decode = asked.engine.tokenizer.decode
    for number, part in enumerate(parts, 1):
        text = decode(asked.token_ids[part.start : part.end])
        assert text.strip().startswith(f"--- page {number} ---") and page_text(number) in text


def test_the_pages_lie_inside_the_document_span(asked):
    document = next(span for span in asked.spans if span.role == "document")
    assert document.start <= asked.parts[0].start and asked.parts[-1].end == document.end


def test_the_memory_map_says_the_first_pages_were_dropped_and_the_last_are_held(asked):
    report = asked.memory_report()
    kept = [part.kept for part in report.parts]
    assert kept[0] < 0.05 and kept[-1] == 1.0
    line = part_lines(report)[0]
    assert line.startswith("paper.pdf: p. 1") and line.endswith("p. 6 held") and "dropped" in line
    assert line in memory_lines(report)


def test_a_saved_report_keeps_its_pages(asked):
    report = asked.memory_report(cell_layers=False)
    assert MemoryReport.from_dict(json.loads(json.dumps(report.as_dict()))).parts == report.parts


def test_a_resumed_session_keeps_its_pages(engine, asked, store):
    from kvchat.chat import persist

    session_id = persist.new_session_row(store, asked, "paper")
    persist.save_snapshot(store, session_id, asked)
    resumed, _ = persist.resume(store, engine, session_id)
    assert resumed.parts == asked.parts
    assert resumed.memory_report().parts == asked.memory_report().parts


def test_a_conversation_read_again_from_its_transcript_keeps_no_pages(engine, paper):
    # A new system prompt reads the transcript again as one text per message: the
    # document is not told from the question there, nor its pages from each other.
    session = engine.new_session(CacheSettings(method="window", budget="16", window=200, sinks=4, batch=16))
    session.send(user_message(QUESTION, paper.text), SamplingSettings(max_new_tokens=2), document=paper.text)
    session.set_system("You answer in one word.")
    assert session.parts == [] and session.memory_report().parts == []
