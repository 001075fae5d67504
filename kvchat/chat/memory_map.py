"""The memory map as text: what `kvchat sessions show --memory` prints and what the
app's memory screen draws (with colours), from a `kvchat.turns.MemoryReport` (the live
one of `ChatSession.memory_report()`, or one a snapshot saved). No tensors and no
Textual here.
"""

from __future__ import annotations

from kvchat.turns import MemoryReport, PartKept, SpanKept

# From (almost) nothing kept to everything kept: a shade and the share it starts at.
LEVELS = (("·", 0.0), ("░", 0.05), ("▒", 0.35), ("▓", 0.65), ("█", 0.995))
SHADES = "".join(mark for mark, _ in LEVELS)


def shade(kept: float) -> str:
    """The character for a share kept in [0, 1]."""
    return [mark for mark, start in LEVELS if kept >= start][-1] if kept >= 0 else LEVELS[0][0]


def legend() -> str:
    names = ["<5%", "<35%", "<65%", "<100%", "all"]
    return "  ".join(f"{mark} {name}" for (mark, _), name in zip(LEVELS, names))


def strip_cells(spans: list[SpanKept], width: int) -> list[int]:
    """For each of `width` cells, the index of the span it shows: cells share the
    tokens out in proportion, and every span gets at least one cell while there are
    cells for all of them (a short question after a long document stays visible)."""
    if not spans or width <= 0:
        return []
    lengths = [max(1, s.end - s.start) for s in spans]
    if len(spans) >= width:  # more spans than cells: each cell shows the span at its token
        total = sum(lengths)
        bounds, at = [], 0
        for n in lengths:
            at += n
            bounds.append(at)
        return [next(i for i, b in enumerate(bounds) if b > (c + 0.5) * total / width) for c in range(width)]
    spare = width - len(spans)
    total = sum(lengths)
    extra = [n * spare / total for n in lengths]
    cells = [1 + int(e) for e in extra]
    # Hand the cells lost to rounding to the largest remainders.
    for i in sorted(range(len(spans)), key=lambda i: extra[i] - int(extra[i]), reverse=True)[: width - sum(cells)]:
        cells[i] += 1
    return [i for i, n in enumerate(cells) for _ in range(n)]


def position_cells(count: int, width: int) -> list[int]:
    """For each of `width` cells, the index of the equal run of tokens (of `count`) it shows."""
    if count <= 0 or width <= 0:
        return []
    return [min(count - 1, int((c + 0.5) * count / width)) for c in range(width)]


def strip_text(spans: list[SpanKept], width: int) -> str:
    """The conversation as one line of shades, oldest on the left."""
    return "".join(shade(spans[i].kept) for i in strip_cells(spans, width))


def summary_line(report: MemoryReport) -> str:
    parts = [
        f"method {report.method}",
        f"budget {report.budget}",
        f"{report.tokens_seen:,} tokens seen",
        f"KV {report.kv_bytes / 1e6:.1f} MB",
    ]
    return " · ".join(parts)


def recall_lines(report: MemoryReport, runs: int = 8) -> list[str]:
    """The recall tier as its own lines: what it keeps on disk (apart from the KV in RAM)
    and what the last answer recalled, with the `runs` longest runs of recalled tokens.
    None when recall is off (or the report was saved before it existed)."""
    if not report.recall:
        return []
    disk = (
        f"disk tier: {report.cold_bytes / 1e6:.1f} MB of exact cold keys and values on disk "
        f"(not in the KV above) · recall {report.recall} tokens per KV head and step"
    )
    lines = [disk]
    if report.recall_steps is None:
        lines.append("last answer: none yet under this cache (a resumed session's tier starts empty)")
        return lines
    line = (
        f"last answer: {report.recalled:.1f} cold tokens per KV head and step recalled, over "
        f"{report.recall_steps:,} steps; {report.recalled_tokens:,} tokens by some layer"
    )
    shown = report.recalled_runs
    if shown:
        longest = sorted(shown, key=lambda run: run[0] - run[1])[:runs]
        line += "; by half the layers or more: " + ", ".join(f"{a:,}–{b:,}" for a, b in sorted(longest))
        if len(shown) > runs:
            line += ", …"
    return lines + [line]


def sliding_line(report: MemoryReport) -> str:
    """Which layers the model trained with a sliding window, and what they keep (empty
    when none does)."""
    windows = report.layer_windows
    sliding = [index for index, window in enumerate(windows) if window is not None]
    if not sliding:
        return ""
    sizes = sorted({window for window in windows if window is not None})
    size = " or ".join(f"{window:,}" for window in sizes)
    names = ", ".join(f"L{index:02d}" for index in sliding)
    return (
        f"sliding-window layers ({len(sliding)} of {len(windows)}: {names}): each sees only its last {size} "
        "tokens, as the model was trained, and keeps at most those, exact (no middle, no recall)"
    )


# A page or chapter counts as held from this share of its tokens on, and as gone below
# the lower one (the legend's ▓ and ░).
HELD = 0.65
GONE = 0.05
# Runs shown per file; more end in "…".
PART_RUNS = 12


def part_status(kept: float, recall: int) -> str:
    if kept >= HELD:
        return "held"
    if kept >= GONE:
        return "partly held"
    # With the recall tier every token that left the window is still on disk.
    return "on disk" if recall else "dropped"


def part_lines(report: MemoryReport) -> list[str]:
    """One line per attached file with pages or chapters, its runs of parts by what the
    cache holds of them: "paper.pdf: p. 1–3 held · p. 4–40 on disk" (none without)."""
    files: list[tuple[str, list[PartKept]]] = []
    for part in report.parts:
        if not files or files[-1][0] != part.document or files[-1][1][-1].end != part.start:
            files.append((part.document, []))
        files[-1][1].append(part)
    lines = []
    for name, parts in files:
        runs: list[tuple[str, str, str]] = []  # (first part, last part, status)
        for part in parts:
            status = part_status(part.kept, report.recall)
            if runs and runs[-1][2] == status:
                runs[-1] = (runs[-1][0], part.part, status)
            else:
                runs.append((part.part, part.part, status))
        shown = [f"{part_range(first, last)} {status}" for first, last, status in runs[:PART_RUNS]]
        lines.append(f"{name}: " + " · ".join(shown) + (" · …" if len(runs) > PART_RUNS else ""))
    return lines


def part_range(first: str, last: str) -> str:
    """ "p. 12–14" for parts "p. 12" to "p. 14"; "p. 7" for one."""
    return first if first == last else f"{first}–{last.rpartition(' ')[2]}"


def recalled_share(report: MemoryReport, index: int, by_position: bool = False) -> float | None:
    """The share of span `index`'s tokens (with `by_position`, of cell `index`'s) the last
    answer recalled, on average over the layers; None when no answer was logged."""
    counts = report.cell_recalled if by_position else report.span_recalled
    if not counts or index >= len(counts):
        return None
    if by_position:
        start, end = report.cell_bounds[index]
    else:
        start, end = report.spans[index].start, report.spans[index].end
    return counts[index] / max(1, end - start)


def held_tokens(report: MemoryReport) -> float:
    """Tokens represented, summed over spans (share kept × length)."""
    return sum(s.kept * (s.end - s.start) for s in report.spans)


def span_rows(report: MemoryReport) -> list[tuple[str, str, str, str]]:
    """(tokens, role, bar, percent) per span, for a table."""
    rows = []
    for span in report.spans:
        bar = "█" * int(round(span.kept * 10))
        rows.append((f"{span.start:,}–{span.end:,}", span.role, bar.ljust(10, "·"), f"{span.kept * 100:5.1f}%"))
    return rows


def memory_lines(report: MemoryReport, layers: bool = False, width: int = 60) -> list[str]:
    """The memory map as printable lines: a summary, the strip, one row per span and,
    with `layers`, one row per layer (its entries and its share of each span)."""
    lines = [summary_line(report), "", "messages " + strip_text(report.spans, width)]
    kept_by_position = report.cell_kept
    if kept_by_position:
        cells = position_cells(len(kept_by_position), width)
        lines.append("position " + "".join(shade(kept_by_position[i]) for i in cells))
    lines += ["         oldest on the left · kept: " + legend(), ""]
    recalled = recall_lines(report)
    if recalled:
        lines += recalled + [""]
    sliding = sliding_line(report)
    if sliding:
        lines += [sliding, ""]
    pages = part_lines(report)
    if pages:
        lines += pages + [""]
    counts = report.span_recalled
    rows = span_rows(report)
    wide = max((len(r[0]) for r in rows), default=6)
    # "recalled": the span's tokens a layer recalled for the last answer, on average.
    lines.append(f"{'#':>3}  {'tokens':<{wide}}  {'role':<9}  {'kept':<10}  share" + ("  recalled" if counts else ""))
    for i, (tokens, role, bar, percent) in enumerate(rows, 1):
        extra = f"  {counts[i - 1]:>8,.1f}" if counts and i - 1 < len(counts) else ""
        lines.append(f"{i:>3}  {tokens:<{wide}}  {role:<9}  {bar}  {percent}{extra}")
    if layers and report.layers:
        per_step = report.layer_recalled
        recalled_head = ", recalled per KV head and step" if per_step else ""
        title = f"per layer: MB held, middle budget (entries per KV head){recalled_head}, then % kept of span 1, 2, …"
        lines += ["", title]
        budgets = report.layer_budgets
        sizes = report.layer_bytes
        for index, shares in enumerate(report.layers):
            size = f"{sizes[index] / 1e6:6.2f}" if index < len(sizes) else "     ?"
            budget = f"{budgets[index]:>6,}" if index < len(budgets) else "     ?"
            window = report.layer_windows[index] if index < len(report.layer_windows) else None
            if window is not None:
                budget = "slides"
            if per_step:
                budget += f" {per_step[index]:5.1f}" if index < len(per_step) else "     ?"
            kept = " ".join(f"{share * 100:3.0f}" for share in shares)
            lines.append(f"L{index:02d} {size} {budget}  {kept}")
    return lines
