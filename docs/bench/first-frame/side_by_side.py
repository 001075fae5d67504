"""Launch to first frame of `kvchat` in a real terminal (tmux), two checkouts side by
side: the commit the session started from and the working tree, alternating runs.

    python docs/bench/first-frame/side_by_side.py BASE_CHECKOUT [RUNS]

BASE_CHECKOUT is a `git worktree add` of the older commit; both run on this venv's
Python with the same data home (the converted model is shared). The first frame is the
app drawn with its status bar while the model still loads ("loading model" shows).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvchat.bench.speed import first_frame_s

REPO = Path(__file__).resolve().parents[3]


def main(base: str, runs: int = 5) -> None:
    checkouts = {"before": Path(base).resolve(), "after": REPO}
    times: dict[str, list[float]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(runs):
            for name, checkout in checkouts.items():
                times[name].append(first_frame_s(None, str(Path(folder) / f"{name}{i}.db"), checkout=checkout))
                time.sleep(0.5)
    print("| checkout | best s | median s | runs |\n|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {len(values)} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
