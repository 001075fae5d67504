"""A fake engine with frozen metrics, for the snapshot tests only (deterministic
pictures). Every behaviour test uses the real embedded model."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.turns import MemoryReport, SessionStats, TurnMetrics, TurnResult

ANSWER_PIECES = [
    "The capital of France is **Paris**.",
    " A compressed cache keeps:\n\n",
    "- the first tokens (*sinks*),\n",
    "- a window of recent tokens,\n",
    "- and a compressed `middle`.",
]
FROZEN_METRICS = TurnMetrics(
    prompt_tokens=1234,
    new_tokens=42,
    prefill_s=0.5,
    prefill_tokens_per_s=2468.0,
    ttft_s=0.52,
    decode_s=1.4,
    decode_tokens_per_s=30.0,
    kv_bytes=3 * 2**20,
    full_kv_bytes=12 * 2**20,
    entries_per_head=196,
    tokens_seen=1276,
    rss_bytes=900 * 2**20,
    prefill_mode="streaming",
)


# Compare view (Ctrl+G): each method's frozen answer and cache size.
COMPARE_ANSWERS = {
    "full": "Paris is the capital of France.",
    "window": "The capital of France is Paris, on the Seine.",
    "h2o": "Paris. It has been the capital since 987.",
    "chelsea": "France's capital is **Paris**.",
}
COMPARE_KV = {"full": 12 * 2**20, "window": 3 * 2**20 // 2, "h2o": 3 * 2**20, "chelsea": 9 * 2**20 // 4}
COMPARE_METRICS = replace(FROZEN_METRICS, ttft_s=0.5, decode_tokens_per_s=30.0)


class FakeCache:
    def __init__(self, method: str) -> None:
        self.method = method

    def nbytes(self) -> int:
        return COMPARE_KV.get(self.method, 2**20)


class FakeSession:
    def __init__(self, settings: CacheSettings, system: str | None = None) -> None:
        self.settings = settings
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.token_ids: list[int] = []
        self.turns = 0
        self.threads: list[str] = []  # the thread each turn and memory map was read on

    def send(
        self,
        text: str,
        sampling: SamplingSettings | None = None,
        on_token=None,
        on_progress=None,
        cancel: threading.Event | None = None,
        document: str | None = None,
    ) -> TurnResult:
        self.threads.append(threading.current_thread().name)
        self.messages.append({"role": "user", "content": text})
        for piece in ANSWER_PIECES:
            if on_token is not None:
                on_token(piece)
        answer = "".join(ANSWER_PIECES)
        self.messages.append({"role": "assistant", "content": answer})
        self.token_ids.extend(range(FROZEN_METRICS.tokens_seen))
        self.turns += 1
        return TurnResult(answer, list(range(FROZEN_METRICS.new_tokens)), replace(FROZEN_METRICS), stop_reason="end")

    # -- what kvchat.chat.compare calls: one prefill, forks, replies ---------------------------
    @property
    def cache(self) -> FakeCache:
        return FakeCache(self.settings.method)

    def prompt_ids(self, text: str, history=None) -> list[int]:
        return list(range(len(text.split())))

    def spans_from_messages(self) -> list:
        return []

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        pass

    def prefill_mode(self, count: int) -> str:
        return "exact-then-compress"

    def feed(self, ids, on_progress=None, cancel=None, hold: bool = False):
        self.token_ids.extend(ids)
        return None, "exact-then-compress"

    def feed_transcript(self, ids, messages, on_progress=None, cancel=None, hold: bool = False):
        logits, mode = self.feed(ids, on_progress, cancel, hold=hold)
        self.messages = [dict(m) for m in messages]
        return logits, mode

    def fork(self, settings: CacheSettings) -> FakeSession:
        twin = FakeSession(settings, self.system)
        twin.messages = [dict(m) for m in self.messages]
        twin.token_ids = list(self.token_ids)
        twin.turns = self.turns
        return twin

    def reply(self, logits, sampling=None, on_token=None, cancel=None) -> TurnResult:
        answer = COMPARE_ANSWERS.get(self.settings.method, "An answer.")
        words = answer.split(" ")
        for piece in [word + " " for word in words[:-1]] + words[-1:]:
            if on_token is not None:
                on_token(piece)
        self.messages.append({"role": "assistant", "content": answer})
        self.turns += 1
        return TurnResult(answer, [1] * 9, replace(COMPARE_METRICS), stop_reason="end")

    def switch_method(self, method: str, params: dict[str, Any] | None = None) -> None:
        self.settings.method = method
        self.settings.params = dict(params or {})

    def rebuild(self, on_progress=None, cancel=None) -> None:
        pass

    def memory_report(self) -> MemoryReport:
        """A frozen memory map: a long document mostly compressed away, the latest turn
        held whole, layers that differ."""
        self.threads.append(threading.current_thread().name)
        spans = [
            {"start": 0, "end": 24, "role": "system", "kept": 0.62},
            {"start": 24, "end": 1180, "role": "document", "kept": 0.21},
            {"start": 1180, "end": 1192, "role": "user", "kept": 0.93},
            {"start": 1192, "end": 1234, "role": "assistant", "kept": 1.0},
            {"start": 1234, "end": 1250, "role": "user", "kept": 1.0},
        ][: 5 if self.turns else 0]
        layers = [[round(min(1.0, s["kept"] * (0.6 + 0.1 * (layer % 9))), 4) for s in spans] for layer in range(12)]
        # By position: 25 runs of 50 tokens; older runs less kept, deeper layers keep more.
        kept = [round(min(1.0, 0.1 + 0.9 * (i / 24) ** 3), 4) for i in range(25)] if spans else []
        cells = {
            "bounds": [[50 * i, 50 * (i + 1)] for i in range(len(kept))],
            "kept": kept,
            "layers": [[round(min(1.0, k * (0.7 + 0.05 * layer)), 4) for k in kept] for layer in range(12)]
            if spans
            else [],
        }
        return MemoryReport.from_dict(
            {
                "spans": spans,
                "layers": layers if spans else [],
                "cells": cells,
                "layer_entries": [196 + 8 * (layer % 5) for layer in range(12)],
                "method": self.settings.method,
                "budget": self.settings.budget,
                "tokens_seen": 1250 if spans else 0,
                "kv_bytes": FROZEN_METRICS.kv_bytes,
            }
        )

    def stats(self) -> SessionStats:
        m = FROZEN_METRICS
        seen = m.tokens_seen * self.turns
        return SessionStats(
            method=self.settings.method,
            budget=self.settings.budget,
            tokens_seen=seen,
            entries_per_head=m.entries_per_head if seen else 0,
            kv_bytes=m.kv_bytes * self.turns,
            full_kv_bytes=m.full_kv_bytes * self.turns,
            rss_bytes=m.rss_bytes,
            cuda_bytes=0,
        )


class FakeEngine:
    loaded = SimpleNamespace(name="FakeLM-135M", device=SimpleNamespace(type="cpu"))

    def __init__(self) -> None:
        self.new_session_threads: list[str] = []  # the thread each session was made on

    def new_session(self, settings: CacheSettings | None = None, *, system: str | None = None) -> FakeSession:
        self.new_session_threads.append(threading.current_thread().name)
        return FakeSession(settings or CacheSettings(), system)

    def count_tokens(self, text: str) -> int:
        return len(text.split())
