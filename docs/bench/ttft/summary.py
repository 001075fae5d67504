"""Tables and plots from results.jsonl (bench.py's runs): per tree, method and context the
median time to first token over the runs, its ratio to float32 `generate` (median of the
same tree's runs at that context) and to `window`, the median CPU seconds, and the load
average seen; greedy agreement of the fast path with float32 after the 2k and 6k documents.

    .venv/bin/python docs/bench/ttft/summary.py      # writes ttft.json/.md/.png, agreement.*
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    from kvchat.bench import report

    runs = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in runs if r["tree"] != "exact"]
    cells: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for r in timed:
        cells[(r["tree"], r["method"], r["context"])].append(r)
    median = {key: statistics.median(r["ttft_s"] for r in rs) for key, rs in cells.items()}
    rows = []
    for (tree, method, context), rs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        gen = median.get((tree, "generate (fp32)", context))
        window = median.get((tree, "window", context))
        ttft = median[(tree, method, context)]
        rows.append({
            "context": context, "method": method, "tree": tree, "runs": len(rs),
            "ttft_s": ttft, "ttft_vs_generate": ttft / gen if gen else None,
            "ttft_vs_window": ttft / window if window and method != "generate (fp32)" else None,
            "cpu_s": statistics.median(r["cpu_s"] for r in rs),
            "threads": "/".join(str(t) for t in sorted({r["threads"] for r in rs})),
            "load1": f"{min(r['load1'] for r in rs):.1f}-{max(r['load1'] for r in rs):.1f}",
        })
    report.write(HERE, "ttft", rows,
                 ["context", "method", "tree", "runs", "ttft_s", "ttft_vs_generate", "ttft_vs_window", "cpu_s",
                  "threads", "load1"],
                 title="Time to first token of an essay document: every method on the fast path (base vs after) "
                       "against float32 transformers (its first token)",
                 notes="Medians over the runs of each tree, the trees run alternately on a shared 2-core box "
                       "(load1: the 1-minute load average at the runs). ttft_vs_generate: against the same tree's "
                       "float32 generate median at that context. Budget 1024 middle entries, window 1024, 4 sinks.")
    for tree in sorted({r["tree"] for r in timed}):
        series = {}
        for method in sorted({r["method"] for r in timed}):
            points = sorted((c, t) for (tr, m, c), t in median.items() if tr == tree and m == method)
            if points:
                series[method] = ([c for c, _ in points], [t for _, t in points])
        report.plot(HERE, f"ttft_{tree}", series, xlabel="context tokens", ylabel="time to first token (s)",
                    title=f"Time to first token ({tree})")
    # Greedy agreement after the documents: the fast path's tokens against float32's.
    greedy = defaultdict(list)
    for r in runs:
        if "greedy" in r:
            greedy[(r["tree"], r["context"])].append(r["greedy"])
    agreement = []
    for (tree, context), lists in sorted(greedy.items()):
        if tree == "exact" or ("exact", context) not in greedy:
            continue
        ref = greedy[("exact", context)][0]
        for tokens in lists:
            prefix = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
            agreement.append({"tree": tree, "context": context, "identical": tokens == ref,
                              "agreeing_prefix": prefix, "tokens": len(ref)})
    if agreement:
        report.write(HERE, "agreement", agreement, ["tree", "context", "identical", "agreeing_prefix", "tokens"],
                     title="Greedy tokens after the document (method full), fast path against float32")


if __name__ == "__main__":
    main()
