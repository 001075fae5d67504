"""What a turn gives back, as plain data: its text and token ids, its metrics, and the
spans of the conversation each fed token belongs to. No torch here: front ends and the
store read these without loading the model's stack."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvchat.model.session import ChatSession

ProgressFn = Callable[[int, int], None]
TokenFn = Callable[[str], None]


def user_message(question: str, document: str | None = None) -> str:
    """The text sent for `question` about `document`: the document, when given, comes first."""
    return question if not document else f"{document.rstrip()}\n\n{question}"


# -- an attached file's outline ------------------------------------------------------------
# A file's text starts with a heading line that names it, and a paged or chaptered file has
# a marker line before each page or chapter. The model reads them ("what does page 7
# say?"), and the model side finds them again in the text to tell which tokens belong to
# which page (`document_outline`), so the memory map can say which pages the cache holds.
PART_SHORT = {"page": "p.", "chapter": "ch."}
_HEADING = re.compile(r"^=== (?P<name>.+?)(?: · [\d,]+ (?:pages?|chapters?))? ===$", re.MULTILINE)
_MARKER = re.compile(r"^--- (?P<kind>page|chapter) (?P<number>\d+)(?::[^\n]*)? ---$", re.MULTILINE)


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def document_heading(name: str, parts: int = 0, part: str = "") -> str:
    """The first line of an attached file: `=== paper.pdf · 42 pages ===` (`=== notes.txt ===`
    for a file without pages or chapters)."""
    return f"=== {name} · {plural(parts, part)} ===" if parts and part else f"=== {name} ==="


def part_marker(part: str, number: int, title: str = "") -> str:
    """The line before a page or chapter: `--- page 7 ---`, `--- chapter 3: The Storm ---`."""
    title = " ".join(title.split())
    return f"--- {part} {number}: {title} ---" if title else f"--- {part} {number} ---"


@dataclass(frozen=True)
class OutlineEntry:
    """Where a file or one of its pages or chapters starts in a document's text."""

    at: int  # character offset
    document: str  # the file's name
    part: str  # "p. 7", "ch. 3"; "" for the file's heading (tokens before its first part)


def document_outline(text: str) -> list[OutlineEntry]:
    """The headings and part markers of `text`, in order (none in a pasted text)."""
    found = [(m.start(), m.group("name"), "") for m in _HEADING.finditer(text)]
    found += [(m.start(), "", f"{PART_SHORT[m.group('kind')]} {m.group('number')}") for m in _MARKER.finditer(text)]
    entries: list[OutlineEntry] = []
    document = ""
    for at, name, part in sorted(found):
        document = name or document
        if part and not document:
            continue  # a marker-like line in a pasted text, not an attached file's
        entries.append(OutlineEntry(at, document, part))
    return entries


@dataclass
class TurnMetrics:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    compress_s: float = 0.0
    kv_bytes: int = 0
    full_kv_bytes: int = 0
    entries_per_head: int = 0
    tokens_seen: int = 0
    rss_bytes: int = 0
    cuda_bytes: int = 0
    prefill_mode: str = ""
    # The recall tier (kvchat/recall/tier.py; 0 when off): bytes of exact cold keys and values
    # on disk (kv_bytes counts RAM only), and cold tokens attended per KV head and step
    # during the answer, averaged over its decode steps and the layers.
    cold_bytes: int = 0
    recalled: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Span:
    """Fed tokens [start, end) that belong to one part of one message."""

    start: int
    end: int
    role: str  # system | user | document | assistant
    message: int  # index into ChatSession.messages

    def as_list(self) -> list[Any]:
        return [self.start, self.end, self.role, self.message]


@dataclass(frozen=True)
class DocumentPart:
    """Fed tokens [start, end) of one page or chapter ("p. 7") of an attached file."""

    start: int
    end: int
    document: str
    part: str
    message: int  # index into ChatSession.messages

    def as_list(self) -> list[Any]:
        return [self.start, self.end, self.document, self.part, self.message]


@dataclass(frozen=True)
class MemorySpan:
    """A span and the share of its tokens the cache still represents: `kept` averaged
    over layers and KV heads, `layers` per layer."""

    start: int
    end: int
    role: str
    message: int
    kept: float
    layers: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        """The public shape (`kvchat ask --json`'s "memory")."""
        return {"start": self.start, "end": self.end, "role": self.role, "kept": round(self.kept, 4)}


def group_spans(labels: list[str], offset: int, message: int) -> list[Span]:
    """Runs of equal labels as spans, the first token at index `offset`."""
    spans: list[Span] = []
    for i, label in enumerate(labels):
        if spans and spans[-1].role == label and spans[-1].end == offset + i:
            spans[-1] = replace(spans[-1], end=offset + i + 1)
        else:
            spans.append(Span(offset + i, offset + i + 1, label, message))
    return spans


@dataclass
class TurnResult:
    text: str
    token_ids: list[int]
    metrics: TurnMetrics
    cancelled: bool = False
    stop_reason: str = "end"  # end | length | cancelled
    prompt_ids: list[int] = field(default_factory=list)  # the prompt tokens actually fed


# -- one question under several methods (kvchat.chat.compare) --------------------------------
SHARED = "exact-then-compress"
SEPARATE = "streaming"
JSON_KEYS = ("method", "answer", "kv_bytes", "ttft_s", "decode_tokens_per_s")


@dataclass
class MethodAnswer:
    """One method's answer and its figures.

    `ttft_s`: from the start of the comparison's prefill to this method's first token,
    as if the user had asked under this method alone: the prefill it waited on (the
    shared one, or its own in the streaming fallback) + its fork (copy and re-stream of
    the held prefill into the method) + the method's compression of the held prefill +
    choosing the first token. The other methods' answers, produced in between, are not
    counted."""

    method: str
    answer: str
    kv_bytes: int  # the method's cache after its answer (cache.nbytes())
    ttft_s: float
    decode_tokens_per_s: float
    new_tokens: int = 0
    prefill_s: float = 0.0  # the prefill this answer waited on
    compress_s: float = 0.0  # fork + compressing the held prefill (0 in the streaming fallback)
    stop_reason: str = "end"  # end | length | cancelled
    session: ChatSession | None = field(default=None, repr=False, compare=False)

    def as_json(self) -> dict[str, Any]:
        """Exactly the keys of `kvchat compare --json`."""
        return {
            "method": self.method,
            "answer": self.answer,
            "kv_bytes": self.kv_bytes,
            "ttft_s": round(self.ttft_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
        }


@dataclass
class Comparison:
    answers: list[MethodAnswer]
    prompt_tokens: int  # every token read for the question (history included)
    prefill_mode: str  # SHARED: one exact prefill forked; SEPARATE: one prefill per method
    prefill_s: float  # the shared prefill; 0.0 in the streaming fallback (each answer has its own)
    note: str = ""
    cancelled: bool = False


@dataclass(frozen=True)
class SessionStats:
    """A conversation's cache and memory figures, as the status bar shows them: method,
    budget, tokens seen, middle entries per KV head, the KV cache's bytes in RAM (and what
    the full cache would take), the process's RSS and CUDA bytes, and the recall tier's
    tokens per KV head and step (0: off) and bytes on disk."""

    method: str
    budget: str
    tokens_seen: int
    entries_per_head: int
    kv_bytes: int
    full_kv_bytes: int
    rss_bytes: int
    cuda_bytes: int
    recall: int = 0
    cold_bytes: int = 0


@dataclass(frozen=True)
class SpanKept:
    """Tokens [start, end) of one message part and the share of them the cache holds."""

    start: int
    end: int
    role: str
    kept: float


@dataclass(frozen=True)
class PartKept:
    """Tokens [start, end) of a page or chapter of an attached file, and the share held."""

    start: int
    end: int
    document: str
    part: str
    kept: float


@dataclass
class MemoryReport:
    """The memory map: what the cache still holds of each message part and of each equal
    run of tokens, per layer and overall, and what the last answer recalled from disk.
    Every snapshot saves it (`as_dict`, without the per-layer cells), and `kvchat
    sessions show --memory` reads a saved one back (`from_dict`), old ones included."""

    spans: list[SpanKept]
    layers: list[list[float]]  # per layer: the share kept of each span
    cell_bounds: list[list[int]]  # equal runs of tokens [start, end), oldest first
    cell_kept: list[float]  # the share kept of each run, over every layer
    cell_layers: list[list[float]]  # per layer, of each run ([] when not asked for)
    layer_entries: list[int]  # middle entries per KV head, per layer
    layer_budgets: list[int]  # middle entries each layer may keep
    layer_bytes: list[int]
    method: str
    budget: str
    tokens_seen: int
    kv_bytes: int
    # The recall tier (0: off): its tokens per KV head and step and its bytes on disk,
    # then, once an answer was logged (`recall_steps` not None), what it recalled.
    recall: int = 0
    cold_bytes: int = 0
    recall_steps: int | None = None
    recalled: float = 0.0
    layer_recalled: list[float] = field(default_factory=list)
    recalled_tokens: int = 0
    span_recalled: list[float] = field(default_factory=list)
    cell_recalled: list[float] = field(default_factory=list)
    recalled_runs: list[list[int]] = field(default_factory=list)
    # Per layer, the model's own sliding window (None: the layer sees every earlier token);
    # [] when no layer slides.
    layer_windows: list[int | None] = field(default_factory=list)
    # The pages and chapters of attached files, oldest first ([] when none).
    parts: list[PartKept] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The saved shape (plain JSON)."""
        cells: dict[str, Any] = {"bounds": self.cell_bounds, "kept": self.cell_kept}
        if self.cell_layers:
            cells["layers"] = self.cell_layers
        saved = {
            "spans": [asdict(span) for span in self.spans],
            "layers": self.layers,
            "cells": cells,
            "layer_entries": self.layer_entries,
            "layer_budgets": self.layer_budgets,
            "layer_bytes": self.layer_bytes,
            "method": self.method,
            "budget": self.budget,
            "tokens_seen": self.tokens_seen,
            "kv_bytes": self.kv_bytes,
            "recall": self.recall,
            "cold_bytes": self.cold_bytes,
        }
        if self.layer_windows:
            saved["layer_windows"] = self.layer_windows
        if self.parts:
            saved["parts"] = [asdict(part) for part in self.parts]
        if self.recall_steps is not None:
            saved.update(
                recall_steps=self.recall_steps,
                recalled=self.recalled,
                layer_recalled=self.layer_recalled,
                recalled_tokens=self.recalled_tokens,
                span_recalled=self.span_recalled,
                cell_recalled=self.cell_recalled,
                recalled_runs=self.recalled_runs,
            )
        return saved

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> MemoryReport:
        """A saved report; keys an older kvchat did not save take their empty values."""
        spans = [
            SpanKept(int(s["start"]), int(s["end"]), str(s["role"]), float(s["kept"])) for s in saved.get("spans", [])
        ]
        cells = saved.get("cells") or {}
        return cls(
            spans=spans,
            layers=list(saved.get("layers", [])),
            cell_bounds=list(cells.get("bounds", [])),
            cell_kept=list(cells.get("kept", [])),
            cell_layers=list(cells.get("layers", [])),
            layer_entries=list(saved.get("layer_entries", [])),
            layer_budgets=list(saved.get("layer_budgets", [])),
            layer_bytes=list(saved.get("layer_bytes", [])),
            method=str(saved.get("method", "?")),
            budget=str(saved.get("budget", "?")),
            tokens_seen=int(saved.get("tokens_seen", spans[-1].end if spans else 0)),
            kv_bytes=int(saved.get("kv_bytes", 0)),
            layer_windows=list(saved.get("layer_windows", [])),
            parts=[
                PartKept(int(p["start"]), int(p["end"]), str(p["document"]), str(p["part"]), float(p["kept"]))
                for p in saved.get("parts", [])
            ],
            recall=int(saved.get("recall", 0) or 0),
            cold_bytes=int(saved.get("cold_bytes", 0)),
            recall_steps=int(saved["recall_steps"]) if "recall_steps" in saved else None,
            recalled=float(saved.get("recalled", 0.0)),
            layer_recalled=list(saved.get("layer_recalled", [])),
            recalled_tokens=int(saved.get("recalled_tokens", 0)),
            span_recalled=list(saved.get("span_recalled", [])),
            cell_recalled=list(saved.get("cell_recalled", [])),
            recalled_runs=list(saved.get("recalled_runs", [])),
        )
