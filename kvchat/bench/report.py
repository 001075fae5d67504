"""Benchmark reports: one JSON file, one markdown table and PNG plots per suite."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """What the numbers were measured on (quote it with them)."""
    import os

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write(out: str | Path, suite: str, rows: list[dict[str, Any]], columns: list[str], *,
          title: str, notes: str = "", extra: dict[str, Any] | None = None) -> Path:
    """Write `<suite>.json` and `<suite>.md` under `out`; returns the folder."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    meta = machine()
    (folder / f"{suite}.json").write_text(json.dumps({"suite": suite, "machine": meta, "rows": rows, **(extra or {})}, indent=1))
    md = [f"# {title}", "", f"Machine: {meta['processor']}, {meta['cpus']} CPUs, torch {meta['torch']}"
          f"{', ' + meta['cuda'] if meta['cuda'] else ''}; {meta['date']}.", ""]
    if notes:
        md += [notes, ""]
    md += [markdown_table(rows, columns), ""]
    (folder / f"{suite}.md").write_text("\n".join(md))
    return folder


def plot(out: str | Path, name: str, series: dict[str, tuple[list[float], list[float]]], *,
         xlabel: str, ylabel: str, title: str, logx: bool = False) -> Path:
    """A line plot, one line per series label -> (xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out) / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
