"""The memory map: what the cache still holds of each message and document.

Draws the plain report of `ChatSession.memory_report()` (via the controller; no
tensors here): a strip of the whole conversation coloured by the share each span still
has in the cache, one row per span, and the same strip per layer with that layer's
entries, so differences between layers (and a budget's allocation) show. With the
recall tier on, the tier on disk has its own lines (its bytes, apart from the KV in RAM,
and what the last answer recalled), a "recalled" row and column show which tokens that
answer brought back, and each layer row its recalled tokens per KV head and step. An
attached file with pages or chapters gets a line saying which of them the cache holds. The
app refreshes it after every turn, method switch, rebuild and resume while it is open.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from kvchat.chat.memory_map import (
    held_tokens,
    legend,
    part_lines,
    position_cells,
    recall_lines,
    recalled_share,
    shade,
    strip_cells,
    summary_line,
)
from kvchat.turns import MemoryReport

# Share kept -> colour, from nothing kept (red) through half (yellow) to all (green).
_STOPS = ((0.0, (200, 60, 60)), (0.5, (220, 190, 60)), (1.0, (70, 180, 90)))
ROLE_LABELS = {"system": "system", "user": "you", "document": "document", "assistant": "model"}


def kept_colour(kept: float) -> str:
    kept = min(1.0, max(0.0, kept))
    for (a, ca), (b, cb) in zip(_STOPS, _STOPS[1:]):
        if kept <= b:
            t = (kept - a) / (b - a)
            r, g, bl = (round(x + (y - x) * t) for x, y in zip(ca, cb))
            return f"rgb({r},{g},{bl})"
    return "rgb(70,180,90)"


def strip(shares: list[float], cells: list[int]) -> Text:
    """One row of cells, each the shade and colour of the span it shows."""
    text = Text()
    for index in cells:
        kept = shares[index]
        text.append(shade(kept), Style(color=kept_colour(kept)))
    return text


class MemoryScreen(Screen[None]):
    """Opened with F2 from the chat; Esc (or F2) goes back. Ctrl+T and Ctrl+O switch the
    method from here too, so that what a method keeps can be watched changing."""

    BINDINGS = [
        Binding("escape,f2,q", "close", "Back to chat"),
        Binding("l", "toggle_layers", "Layers", tooltip="show or hide the per-layer rows"),
    ]

    def __init__(self, report: MemoryReport | None = None) -> None:
        super().__init__()
        self.report = report
        self.show_layers = True

    def compose(self) -> ComposeResult:
        yield Static(
            "Memory map — what the cache still holds (oldest left, newest right)", id="memory-title", markup=False
        )
        yield Static("", id="memory-summary", markup=False)
        with VerticalScroll(id="memory-body"):
            yield Static("", id="memory-spans")
            yield Static("", id="memory-layers")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#memory-body").focus()
        self.draw()

    def on_resize(self) -> None:
        self.draw()

    def show(self, report: MemoryReport | None) -> None:
        """New numbers (after a turn, a switch, a rebuild or a resume)."""
        self.report = report
        self.draw()

    def action_close(self) -> None:
        self.dismiss()

    def action_toggle_layers(self) -> None:
        self.show_layers = not self.show_layers
        self.draw()

    def strip_width(self) -> int:
        # Labels (11), a gap, the body's padding and its scrollbar.
        return max(10, self.size.width - 17)

    def draw(self) -> None:
        if not self.is_mounted:
            return
        summary = self.query_one("#memory-summary", Static)
        spans_view = self.query_one("#memory-spans", Static)
        layers_view = self.query_one("#memory-layers", Static)
        report = self.report
        if report is None:
            summary.update("reading the cache…")
            spans_view.update("")
            layers_view.update("")
            return
        spans = report.spans
        if not spans:
            summary.update(summary_line(report))
            spans_view.update(Text("Nothing seen yet: send a message, then look again."))
            layers_view.update("")
            return
        seen = spans[-1].end
        held = held_tokens(report)
        summary.update(f"{summary_line(report)} · holds {held:,.0f} of {seen:,} tokens ({held / max(1, seen):.0%})")
        width = self.strip_width()
        cells = position_cells(len(report.cell_kept), width)
        spans_view.update(self.render_spans(report, strip_cells(spans, width), cells))
        layers_view.update(self.render_layers(report, cells) if self.show_layers else "")

    def render_spans(self, report: MemoryReport, span_cells: list[int], cells: list[int]) -> Group:
        spans = report.spans
        whole = Table.grid(padding=(0, 1))
        whole.add_column(no_wrap=True, width=11)
        whole.add_column(no_wrap=True)
        whole.add_row("messages", strip([s.kept for s in spans], span_cells))
        if cells:
            whole.add_row("position", strip(report.cell_kept, cells))
        recalled = [recalled_share(report, i, by_position=True) for i in range(len(report.cell_kept))]
        if cells and recalled and recalled[0] is not None:
            # Which tokens the last answer brought back from disk, by position (same cells).
            whole.add_row("recalled", strip([float(x or 0.0) for x in recalled], cells))
        whole.add_row("", Text("oldest on the left · kept: " + legend(), style="dim"))
        table = Table(box=None, padding=(0, 1), show_edge=False, expand=False, header_style="bold")
        table.add_column("#", justify="right")
        table.add_column("tokens", no_wrap=True)
        table.add_column("part", no_wrap=True)
        table.add_column("kept", no_wrap=True)
        table.add_column("share", justify="right")
        counts = report.span_recalled
        if counts:
            table.add_column("recalled", justify="right")
        for number, span in enumerate(spans, 1):
            kept = span.kept
            bar = Text("█" * round(kept * 10), style=kept_colour(kept)) + Text(
                "·" * (10 - round(kept * 10)), style="dim"
            )
            row: list[str | Text] = [
                str(number),
                f"{span.start:,}–{span.end:,}",
                ROLE_LABELS.get(span.role, span.role),
                bar,
                f"{kept:.0%}",
            ]
            if counts:
                row.append(f"{counts[number - 1]:,.1f}" if number - 1 < len(counts) else "")
            table.add_row(*row)
        parts: list[RenderableType] = [whole, Text("")]
        disk = recall_lines(report)
        if disk:  # the tier on disk, apart from the KV in RAM
            parts += [Text("\n".join(disk)), Text("")]
        pages = part_lines(report)
        if pages:  # what the cache holds of each page or chapter of an attached file
            parts += [Text("\n".join(pages)), Text("")]
        return Group(*parts, table)

    def render_layers(self, report: MemoryReport, cells: list[int]) -> Group:
        layers = report.cell_layers
        if not layers or not cells:
            return Group()
        entries = report.layer_entries
        layer_bytes = report.layer_bytes
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, width=11)
        grid.add_column(no_wrap=True)
        for index, shares in enumerate(layers):
            label = f"L{index:02d} {entries[index]:>6,}" if index < len(entries) else f"L{index:02d}"
            if index < len(layer_bytes):
                label = f"L{index:02d} {layer_bytes[index] / 1e6:5.2f}M"
            grid.add_row(label, strip([float(x) for x in shares], cells))
        unit = "MB held" if layer_bytes else "entries per KV head"
        title = Text(f"by position, per layer (layer, {unit}) — L hides", style="bold")
        parts: list[RenderableType] = [Text(""), title, grid]
        budgets = report.layer_budgets
        if layer_bytes and budgets:
            low, high = min(budgets), max(budgets)
            spread = "the same for every layer" if low == high else f"from {low:,} to {high:,} by layer"
            parts.append(Text(f"middle budget {spread} (entries per KV head; budget {report.budget})", style="dim"))
        per_step = report.layer_recalled
        if per_step:  # below the grid: a column would take cells from every strip
            parts.append(
                Text(
                    "last answer, cold tokens recalled per KV head and step: "
                    + " · ".join(f"L{i:02d} {x:.1f}" for i, x in enumerate(per_step)),
                    style="dim",
                )
            )
        return Group(*parts)
