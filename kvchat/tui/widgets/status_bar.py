"""The status bar: method, budget, cache and memory figures, speeds, and a sparkline
of the KV cache size over the session. It is refreshed by the app's timer (a few
times a second while the model works), never once per token."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from kvchat.tui.status import StatusReport

# The sparkline keeps the most recent samples only: it shows a trend, not a history.
TREND_SAMPLES = 40


class StatusBar(Vertical):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.plain_text = ""  # what the bar shows, as plain text (tests read it)
        self.kv_trend: list[float] = []

    def compose(self) -> ComposeResult:
        yield Static("starting…", id="status-cache", markup=False)
        with Horizontal(id="status-speed-row"):
            yield Static("", id="status-speed", markup=False)
            yield Static("KV MB", id="trend-label", markup=False)
            yield Sparkline([], id="kv-sparkline")

    def show(self, report: StatusReport) -> None:
        cache_line, speed_line = report.cache_line(), report.speed_line()
        text = f"{cache_line}\n{speed_line}"
        if text != self.plain_text:
            self.plain_text = text
            self.query_one("#status-cache", Static).update(cache_line)
            self.query_one("#status-speed", Static).update(speed_line)

    def show_text(self, line: str) -> None:
        """One plain line instead of the cache numbers (before the model is loaded)."""
        text = f"{line}\n"
        if text != self.plain_text:
            self.plain_text = text
            self.query_one("#status-cache", Static).update(line)
            self.query_one("#status-speed", Static).update("")

    def add_trend_sample(self, kv_mb: float) -> None:
        self.kv_trend = (self.kv_trend + [kv_mb])[-TREND_SAMPLES:]
        self.query_one("#kv-sparkline", Sparkline).data = list(self.kv_trend)
        self.query_one("#trend-label", Static).update(f"KV {kv_mb:.1f} MB ")
