"""`docs/benchmarks.md`, generated from the latest report of each suite, and the README's
performance table.

Reads `<bench>/<suite>/<suite>*.json` beside the markdown each suite wrote (`report.write`)
for speed, fidelity, recall, resume and attention, and writes one page: per suite, each
report's title, machine, commit and command, its notes and table as the suite wrote them,
and links to its plots. When the README holds the markers `<!-- bench:start -->` and
`<!-- bench:end -->`, what lies between them becomes a short table from the speed suite's
methods part: time to first token and decode tokens/s per method at the contexts measured,
with the machine and commit. Reports written before reports named their commit and command
say "not recorded" there.

    python -m kvchat.bench.summary [--bench docs/bench] [--output docs/benchmarks.md] [--readme README.md]
    kvchat bench summary [--out docs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from kvchat.bench import report

SUITES = {
    "speed": "Speed: time to first token, decode and start-up",
    "fidelity": "Fidelity: next-token KL and perplexity against the full cache",
    "recall": "Recall: needle and line retrieval",
    "resume": "Resume: a saved session against recomputing it",
    "attention": "Attention: output error per method and layer",
}
# Reports shown first within a suite's folder (the rest follow by name).
FIRST = ["speed_methods", "speed_kernels", "speed_start", "fidelity", "recall", "resume", "attention"]
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# Header lines a suite writes under its title, replaced here by the report's own fields.
HEADER = re.compile(r"^(Machine|Commit|Command):")
# Rows of the README's table: leave out what only one context measures.
README_SKIP = {"window (streaming prefill)"}


def reports(folder: Path, suite: str) -> list[tuple[Path, dict[str, Any]]]:
    """The suite's reports in `folder`: (JSON path, its data), in `FIRST`'s order."""
    found = []
    for path in sorted(folder.glob(f"{suite}*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "rows" in data:
            found.append((path, data))
    rank = {name: i for i, name in enumerate(FIRST)}
    return sorted(found, key=lambda item: (rank.get(item[0].stem, len(rank)), item[0].stem))


def body(markdown: str) -> tuple[str, list[str]]:
    """A report's markdown as (its title, the lines after its header): notes, table and
    any sections, their headings moved two levels down (the report's title becomes a
    third-level heading, under the page's suite)."""
    lines = markdown.splitlines()
    title = lines[0].removeprefix("# ").strip() if lines and lines[0].startswith("# ") else ""
    rest = lines[1:] if title else lines
    while rest and (not rest[0].strip() or HEADER.match(rest[0])):
        rest = rest[1:]
    return title, ["##" + line if re.match(r"^#+ ", line) else line for line in rest]


def link(path: Path, page: Path) -> str:
    """`path` relative to the folder of `page`, with forward slashes."""
    return Path(os.path.relpath(path, page.parent)).as_posix()


def section(path: Path, data: dict[str, Any], page: Path) -> list[str]:
    """One report on the page."""
    md = path.with_suffix(".md")
    title, lines = body(md.read_text()) if md.exists() else ("", [])
    version = f" (kvchat {data['kvchat_version']})" if data.get("kvchat_version") else ""
    command = report.as_typed(data)
    files = [f"[{path.name}]({link(path, page)})"] + ([f"[{md.name}]({link(md, page)})"] if md.exists() else [])
    out = [
        f"### {title or path.stem}",
        "",
        f"- Machine: {report.describe_machine(data.get('machine', {}))}",
        f"- Commit: {data.get('commit') or report.NOT_RECORDED}{version}",
        "- Command: " + (f"`{command}`" if command != report.NOT_RECORDED else command),
        f"- Report: {', '.join(files)}",
        *([f"- Note: {data['provenance']}"] if data.get("provenance") else []),
        "",
    ]
    if not lines:
        out += [report.markdown_table(data["rows"], list(data["rows"][0]) if data["rows"] else []), ""]
    return out + lines + ([""] if lines and lines[-1].strip() else [])


def page(bench: Path, output: Path) -> str:
    """The whole of `docs/benchmarks.md`."""
    out = [
        "# Benchmarks",
        "",
        "Generated from the latest report of each suite under "
        f"[{link(bench, output)}/]({link(bench, output)}/) by `python -m kvchat.bench.summary` (`make bench` "
        "runs every suite, then this). Each report names the machine, the commit and the command that made it; "
        "run the command to measure again. Numbers from one machine compare with each other only; ratios are "
        "quoted between rows measured side by side in one run.",
        "",
    ]
    out += [f"- [{title}](#{anchor(title)})" for title in SUITES.values()] + [""]
    for suite, title in SUITES.items():
        out += [f"## {title}", ""]
        folder = bench / suite
        # A suite's reports, and those of runs kept side by side in its subfolders.
        parts = [folder, *sorted(p for p in folder.iterdir() if p.is_dir())] if folder.is_dir() else []
        if not any(reports(part, suite) for part in parts):
            out += [f"No report yet: `make bench` writes it into `{link(folder, output)}/`.", ""]
            continue
        for part in parts:
            for path, data in reports(part, suite):
                out += section(path, data, output)
            plots = sorted(part.glob("*.png"))
            if plots:
                out += ["Plots: " + ", ".join(f"[{p.stem}]({link(p, output)})" for p in plots) + ".", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def context_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def performance_table(data: dict[str, Any], readme: Path, page_path: Path) -> list[str]:
    """The README's table from a speed_methods report: per method, time to first token and
    decode tokens/s at each context, then the machine, commit and command."""
    rows = [r for r in data["rows"] if r["method"] not in README_SKIP]
    contexts = sorted({r["context"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["context"]): r for r in rows}
    head = ["method"] + [f"{what}, {context_label(c)}" for c in contexts for what in ("first token", "decode")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in methods:
        values = []
        for c in contexts:
            r = cell.get((method, c), {})
            values += [
                f"{r['ttft_s']:.2f} s" if "ttft_s" in r else "",
                f"{r['decode_tok_s']:.1f} tok/s" if "decode_tok_s" in r else "",
            ]
        lines.append("| " + " | ".join([method, *values]) + " |")
    command = report.as_typed(data)
    made = f"`{command}`" if command != report.NOT_RECORDED else f"command {report.NOT_RECORDED}"
    lines += [
        "",
        f"Measured on {report.describe_machine(data.get('machine', {}))}. Commit "
        f"{data.get('commit') or report.NOT_RECORDED}, {made}. "
        f"Every report: [{link(page_path, readme)}]({link(page_path, readme)}).",
    ]
    return lines


def fill_readme(readme: Path, table: list[str]) -> bool:
    """Replace what lies between the markers with `table`; False when the README or a
    marker is missing."""
    try:
        text = readme.read_text()
    except OSError:
        return False
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return False
    filled = text[: start + len(START)] + "\n" + "\n".join(table) + "\n" + text[end:]
    if filled != text:
        readme.write_text(filled)
    return True


def write(bench: Path, output: Path, readme: Path | None) -> list[Path]:
    """Write the page, and the README's table when it has the markers; the files written."""
    if not bench.is_dir():
        raise ValueError(f"{bench}: no such folder of benchmark reports (`make bench` writes them)")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page(bench, output))
    written = [output]
    speed = [data for path, data in reports(bench / "speed", "speed") if path.stem == "speed_methods"]
    if readme is not None and speed and fill_readme(readme, performance_table(speed[0], readme, output)):
        written.append(readme)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.bench.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", default="docs/bench", help="the reports, one folder per suite (default docs/bench)")
    parser.add_argument("--output", help="the page to write (default: benchmarks.md beside the reports' folder)")
    parser.add_argument(
        "--readme",
        help="the README whose markers get the performance table (default: README.md in the folder above the page's)",
    )
    args = parser.parse_args(argv)
    bench = Path(args.bench)
    output = Path(args.output) if args.output else bench.parent / "benchmarks.md"
    readme = Path(args.readme) if args.readme else output.parent.parent / "README.md"
    for path in write(bench, output, readme):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main())
    except ValueError as err:
        sys.exit(f"python -m kvchat.bench.summary: error: {err}")
