"""Launch to first frame of `kvchat` in a real terminal (tmux), two checkouts side by
side: the commit the session started from and the working tree, alternating runs.

    python docs/bench/first-frame/side_by_side.py BASE_CHECKOUT [RUNS]

BASE_CHECKOUT is a `git worktree add` of the older commit; both run on this venv's
Python with the same data home (the converted model is shared). The first frame is the
app drawn with its status bar while the model still loads ("loading model" shows).
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def first_frame(checkout: Path, db: Path, timeout: float = 60.0) -> float:
    socket = f"kvchat-frame-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = f"cd {shlex.quote(str(checkout))} && {shlex.quote(sys.executable)} -m kvchat --db {shlex.quote(str(db))}"
    try:
        start = time.perf_counter()
        subprocess.run([*tmux, "new-session", "-d", "-s", "app", "-x", "110", "-y", "34", "-e", "TERM=xterm-256color",
                        command], check=True, env=env)
        while time.perf_counter() - start < timeout:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "app"], capture_output=True, text=True).stdout
            if "│" in screen and ("loading model" in screen or "ready" in screen):
                return time.perf_counter() - start
            time.sleep(0.01)
        raise RuntimeError(f"{checkout}: no frame within {timeout:.0f} s")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        time.sleep(0.5)


def main(base: str, runs: int = 5) -> None:
    checkouts = {"before": Path(base).resolve(), "after": REPO}
    times: dict[str, list[float]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(runs):
            for name, checkout in checkouts.items():
                times[name].append(first_frame(checkout, Path(folder) / f"{name}{i}.db"))
    print("| checkout | best s | median s | runs |\n|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {len(values)} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
