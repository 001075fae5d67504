"""The memory map as text: what `kvchat sessions show --memory` prints and what the
app's memory screen draws (with colours). Works on the plain report that
`ChatSession.memory_report()` makes and every snapshot saves:

    {"spans": [{"start", "end", "role", "kept"}, ...],  # every token seen, in order
     "layers": [[kept per span] per layer],
     "layer_entries": [entries per KV head per layer], "method", "budget", ...,
     # the recall tier (kvchat/recall/tier.py), when on: its disk bytes and, once an answer
     # was logged, what that answer recalled (`CompressedCache.recall_report`)
     "recall", "cold_bytes", "recalled", "layer_recalled", "recalled_tokens",
     "span_recalled", "cell_recalled", "recalled_runs"}

No tensors and no Textual here.
"""

from __future__ import annotations

from typing import Any

# From (almost) nothing kept to everything kept: a shade and the share it starts at.
LEVELS = (("·", 0.0), ("░", 0.05), ("▒", 0.35), ("▓", 0.65), ("█", 0.995))
SHADES = "".join(mark for mark, _ in LEVELS)


def shade(kept: float) -> str:
    """The character for a share kept in [0, 1]."""
    return [mark for mark, start in LEVELS if kept >= start][-1] if kept >= 0 else LEVELS[0][0]


def legend() -> str:
    names = ["<5%", "<35%", "<65%", "<100%", "all"]
    return "  ".join(f"{mark} {name}" for (mark, _), name in zip(LEVELS, names))


def strip_cells(spans: list[dict[str, Any]], width: int) -> list[int]:
    """For each of `width` cells, the index of the span it shows: cells share the
    tokens out in proportion, and every span gets at least one cell while there are
    cells for all of them (a short question after a long document stays visible)."""
    if not spans or width <= 0:
        return []
    lengths = [max(1, s["end"] - s["start"]) for s in spans]
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


def strip_text(spans: list[dict[str, Any]], width: int) -> str:
    """The conversation as one line of shades, oldest on the left."""
    return "".join(shade(spans[i]["kept"]) for i in strip_cells(spans, width))


def summary_line(report: dict[str, Any]) -> str:
    seen = int(report.get("tokens_seen", report["spans"][-1]["end"] if report.get("spans") else 0))
    parts = [f"method {report.get('method', '?')}", f"budget {report.get('budget', '?')}", f"{seen:,} tokens seen"]
    if "kv_bytes" in report:
        parts.append(f"KV {report['kv_bytes'] / 1e6:.1f} MB")
    return " · ".join(parts)


def recall_lines(report: dict[str, Any], runs: int = 8) -> list[str]:
    """The recall tier as its own lines: what it keeps on disk (apart from the KV in RAM)
    and what the last answer recalled, with the `runs` longest runs of recalled tokens.
    None when recall is off (or the report was saved before it existed)."""
    if not report.get("recall"):
        return []
    disk = (f"disk tier: {report.get('cold_bytes', 0) / 1e6:.1f} MB of exact cold keys and values on disk "
            f"(not in the KV above) · recall {report['recall']} tokens per KV head and step")
    lines = [disk]
    if "recalled" not in report:
        lines.append("last answer: none yet under this cache (a resumed session's tier starts empty)")
        return lines
    line = (f"last answer: {report['recalled']:.1f} cold tokens per KV head and step recalled, over "
            f"{report.get('recall_steps', 0):,} steps; {report.get('recalled_tokens', 0):,} tokens by some layer")
    shown = report.get("recalled_runs") or []
    if shown:
        longest = sorted(shown, key=lambda run: run[0] - run[1])[:runs]
        line += "; by half the layers or more: " + ", ".join(f"{a:,}–{b:,}" for a, b in sorted(longest))
        if len(shown) > runs:
            line += ", …"
    return lines + [line]


def recalled_share(report: dict[str, Any], index: int, key: str = "span_recalled") -> float | None:
    """The share of span (or cell, `key` "cell_recalled") `index`'s tokens the last answer
    recalled, on average over the layers; None when no answer was logged."""
    counts = report.get(key)
    if not counts or index >= len(counts):
        return None
    if key == "span_recalled":
        span = report["spans"][index]
        size = span["end"] - span["start"]
    else:
        start, end = report["cells"]["bounds"][index]
        size = end - start
    return counts[index] / max(1, size)


def held_tokens(report: dict[str, Any]) -> float:
    """Tokens represented, summed over spans (share kept × length)."""
    return sum(s["kept"] * (s["end"] - s["start"]) for s in report.get("spans", []))


def span_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(tokens, role, bar, percent) per span, for a table."""
    rows = []
    for span in report.get("spans", []):
        tokens = f"{span['start']:,}–{span['end']:,}"
        kept = float(span["kept"])
        bar = "█" * int(round(kept * 10))
        rows.append((tokens, span["role"], bar.ljust(10, "·"), f"{kept * 100:5.1f}%"))
    return rows


def memory_lines(report: dict[str, Any], layers: bool = False, width: int = 60) -> list[str]:
    """The memory map as printable lines: a summary, the strip, one row per span and,
    with `layers`, one row per layer (its entries and its share of each span)."""
    spans = report.get("spans", [])
    lines = [summary_line(report), "", "messages " + strip_text(spans, width)]
    kept_by_position = (report.get("cells") or {}).get("kept") or []
    if kept_by_position:
        cells = position_cells(len(kept_by_position), width)
        lines.append("position " + "".join(shade(kept_by_position[i]) for i in cells))
    lines += ["         oldest on the left · kept: " + legend(), ""]
    recalled = recall_lines(report)
    if recalled:
        lines += recalled + [""]
    counts = report.get("span_recalled")
    rows = span_rows(report)
    wide = max((len(r[0]) for r in rows), default=6)
    # "recalled": the span's tokens a layer recalled for the last answer, on average.
    lines.append(f"{'#':>3}  {'tokens':<{wide}}  {'role':<9}  {'kept':<10}  share" + ("  recalled" if counts else ""))
    for i, (tokens, role, bar, percent) in enumerate(rows, 1):
        extra = f"  {counts[i - 1]:>8,.1f}" if counts and i - 1 < len(counts) else ""
        lines.append(f"{i:>3}  {tokens:<{wide}}  {role:<9}  {bar}  {percent}{extra}")
    if layers and report.get("layers"):
        per_step = report.get("layer_recalled") or []
        recalled_head = ", recalled per KV head and step" if per_step else ""
        title = f"per layer: MB held, middle budget (entries per KV head){recalled_head}, then % kept of span 1, 2, …"
        lines += ["", title]
        budgets = report.get("layer_budgets") or []
        sizes = report.get("layer_bytes") or []
        for index, shares in enumerate(report["layers"]):
            size = f"{sizes[index] / 1e6:6.2f}" if index < len(sizes) else "     ?"
            budget = f"{budgets[index]:>6,}" if index < len(budgets) else "     ?"
            if per_step:
                budget += f" {per_step[index]:5.1f}" if index < len(per_step) else "     ?"
            cells = " ".join(f"{share * 100:3.0f}" for share in shares)
            lines.append(f"L{index:02d} {size} {budget}  {cells}")
    return lines
