"""What the status bar shows: cache and memory figures plus speeds, as plain data.

`LiveTurn` is written by the generation thread (plain int/float attributes, so a read
from the UI thread sees either the old or the new value, never a torn one) and read by
the status timer a few times a second; nothing is pushed to the UI per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvchat.turns import SessionStats

# Decimal megabytes, as `--budget 64MB`, the memory map and `kvchat sessions show` count
# them, so the status bar agrees with them (MiB under the name MB would read 27.2 "MB"
# beside the map's 28.6 MB).
MB = 1_000_000


@dataclass
class LiveTurn:
    """Progress of the turn being generated, as the worker thread sees it."""

    started: float = field(default_factory=time.perf_counter)
    prefill_done: int = 0
    prefill_total: int = 0
    prefill_finished: float | None = None
    first_token: float | None = None
    pieces: int = 0  # text pieces streamed (about one per token)
    last_piece: float | None = None

    def on_progress(self, done: int, total: int) -> None:
        self.prefill_done, self.prefill_total = done, total
        if done >= total:
            self.prefill_finished = time.perf_counter()

    def on_piece(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            if self.prefill_finished is None:
                self.prefill_finished = now
        self.pieces += 1
        self.last_piece = now

    def speeds(self) -> Speeds:
        ttft = self.first_token - self.started if self.first_token is not None else None
        prefill = None
        if self.prefill_done and self.prefill_finished is not None:
            prefill = self.prefill_done / max(self.prefill_finished - self.started, 1e-9)
        elif self.prefill_done:
            prefill = self.prefill_done / max(time.perf_counter() - self.started, 1e-9)
        decode = None
        if self.first_token is not None and self.pieces > 1 and self.last_piece is not None:
            decode = (self.pieces - 1) / max(self.last_piece - self.first_token, 1e-9)
        return Speeds(decode, prefill, ttft)


@dataclass
class Speeds:
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    ttft_s: float | None = None

    @classmethod
    def from_metrics(cls, metrics: Any) -> Speeds:
        """From an engine TurnMetrics (the exact figures of a finished turn)."""
        return cls(
            metrics.decode_tokens_per_s if metrics.new_tokens else None,
            metrics.prefill_tokens_per_s if metrics.prompt_tokens else None,
            metrics.ttft_s if metrics.new_tokens else None,
        )


@dataclass
class StatusReport:
    stats: SessionStats  # the cache and memory figures
    speeds: Speeds
    activity: str  # "ready", "generating", "reading 4,096 / 20,000 tokens", ...

    @classmethod
    def from_stats(cls, stats: SessionStats, speeds: Speeds, activity: str) -> StatusReport:
        return cls(stats, speeds, activity)

    def cache_line(self) -> str:
        s = self.stats
        if s.full_kv_bytes:
            share = f"{s.kv_bytes / s.full_kv_bytes:.0%} of full {megabytes(s.full_kv_bytes)}"
        else:
            share = "empty"
        kv = f"KV {megabytes(s.kv_bytes)} ({share})"
        if s.recall:  # the disk tier apart from the KV in RAM
            kv += f" + {megabytes(s.cold_bytes)} on disk · recall {s.recall}/head"
        memory = f"RAM {megabytes(s.rss_bytes)}"
        if s.cuda_bytes:
            memory += f" · GPU {megabytes(s.cuda_bytes)}"
        return (
            f"{s.method} · budget {s.budget} │ {s.tokens_seen:,} seen → {s.entries_per_head:,} kept/head"
            f" │ {kv} │ {memory}"
        )

    def speed_line(self) -> str:
        s = self.speeds
        decode = "decode – tok/s" if s.decode_tokens_per_s is None else f"decode {s.decode_tokens_per_s:.1f} tok/s"
        prefill = (
            "prefill – tok/s" if s.prefill_tokens_per_s is None else f"prefill {s.prefill_tokens_per_s:,.0f} tok/s"
        )
        ttft = "TTFT –" if s.ttft_s is None else f"TTFT {s.ttft_s:.2f} s"
        return f"{self.activity} │ {decode} │ {prefill} │ {ttft}"


def megabytes(count: int) -> str:
    if count >= 10_000 * MB:
        return f"{count / (1000 * MB):.0f} GB"
    if count >= 1000 * MB:
        return f"{count / (1000 * MB):.1f} GB"
    return f"{count / MB:.1f} MB"
