"""Whole-process start of `kvchat ask "Say hi." --no-save`, several code trees side by side.

Each tree is a checkout of kvchat (a git worktree) put first on PYTHONPATH; every round
runs each tree once, in turn, so a machine that gets busier or quieter affects them alike.
All use the same data home (KVCHAT_HOME), whose converted model and int8 weight cache are
made by an untimed first run of each tree.

    python docs/bench/startup/bench.py base=/tmp/base-startup after=/tmp/after-startup \
        --rounds 5 --home /tmp/kvchat-bench-home --out docs/bench/startup/results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMAND = ["-m", "kvchat", "ask", "Say hi.", "--no-save"]


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(tree: str, home: str, cwd: str) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": tree, "KVCHAT_HOME": home}
    env.pop("OMP_NUM_THREADS", None)  # kvchat picks its own thread count, as for a user
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *COMMAND], check=False, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr}")
    return elapsed, done.stdout.strip()


def alternate(runs: dict[str, Callable[[], tuple[float, str]]], rounds: int) -> dict[str, Any]:
    """Each round calls every run once, in turn (a run: one whole timed process, returning
    its seconds and its answer). Returns the seconds, the load average before each run,
    their medians and the distinct answers, per name."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    loads: dict[str, list[float]] = {name: [] for name in runs}
    answers: dict[str, set[str]] = {name: set() for name in runs}
    for r in range(rounds):
        for name, run_once in runs.items():
            load = loadavg()[0]
            elapsed, answer = run_once()
            times[name].append(round(elapsed, 3))
            loads[name].append(load)
            answers[name].add(answer)
            print(f"round {r + 1} {name}: {elapsed:.2f} s (load {load:.2f})", flush=True)
    return {
        "seconds": times,
        "loadavg_1min_at_start": loads,
        "median_s": {name: round(statistics.median(t), 3) for name, t in times.items()},
        "answers": {name: sorted(a) for name, a in answers.items()},
    }


def write(result: dict[str, Any], out: Path) -> None:
    """`result` with the machine it ran on, as JSON; prints the medians."""
    result = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}, **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median_s"]))


def arguments(doc: str, what: str, help: str, rounds: int) -> argparse.Namespace:
    """The command line both start-up benches take: the things compared (`what`),
    `--rounds`, `--home` (the data home they share) and `--out` (the JSON report)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(what, nargs="+", help=help)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--home", required=True, help=f"the data home all {what} share")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__, "trees", "name=path of a kvchat checkout", rounds=5)
    trees = dict(t.split("=", 1) for t in args.trees)
    cwd = tempfile.mkdtemp(prefix="kvchat-bench-cwd-")  # not a checkout: `-m kvchat` must come from PYTHONPATH
    for name, tree in trees.items():  # untimed: builds the converted copy and weight cache
        print(f"warm-up {name}: {run(tree, args.home, cwd)[0]:.2f} s", flush=True)
    runs = {name: functools.partial(run, tree, args.home, cwd) for name, tree in trees.items()}
    write({
        "command": "python " + " ".join(COMMAND[:3]) + ' "Say hi." --no-save',
        "rounds": args.rounds,
        "trees": trees,
        **alternate(runs, args.rounds),
    }, args.out)


if __name__ == "__main__":
    main()
