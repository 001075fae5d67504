"""`kvchat bench speed --parts kernels`: kvchat's compiled kernels on against off.

The speed suite's `methods` part runs in a fresh `kvchat` process per side, the same command
line with `--parts methods`: once with the kernels on (`KVCHAT_KERNELS` unset) and once with
`KVCHAT_KERNELS=off` (every compiled kernel off: each caller takes its Python twin), in rounds
whose order alternates (on, off, then off, on). Each side's time to first token, decode
tokens/s and later turn are the medians of its rounds, and the report gives their ratios per
method and context. A value of `KVCHAT_KERNELS` in this run's environment (`-greedy,-summary`,
say) is the off side's instead of `off`: the A/B of some kernels only.

    kvchat bench speed --parts kernels --methods window,subgen,bumblebee --contexts 4096 --recall 32

`generate (fp32)` runs none of kvchat's kernels: its ratios show how far the box's noise
moves a row between the two sides.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvchat.bench import report

VARIABLE = "KVCHAT_KERNELS"
OFF = "off"
ROUNDS = 2
QUICK_ROUNDS = 1
# The methods part's measures compared: each its name in the report, and whether it is a
# time or a rate (the speed-up is off over on for a time, on over off for a rate: above 1,
# the kernels help).
MEASURES = {
    "ttft_s": ("ttft", "time"),
    "decode_tok_s": ("decode", "rate"),
    "next_turn_ttft_s": ("next_turn_ttft", "time"),
}
# Options of this run the sides replace: their values are not carried over.
REPLACED = ("--parts", "--out")


def side_arguments(argv: Sequence[str], out: Path) -> list[str]:
    """The arguments of one side: this run's (`argv`, without the program) with `--parts`
    and `--out` replaced by the methods part alone, written into `out`. Every other option
    stays as typed, before or after `bench speed`."""
    if "bench" not in argv or "speed" not in argv[list(argv).index("bench") + 1 :]:
        raise ValueError(
            "the kernels part runs this command line again: start it as `kvchat bench speed --parts kernels ...`"
        )
    args: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in REPLACED:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in REPLACED)):
            args.append(arg)
    return [*args, "--parts", "methods", "--out", str(out)]


def off_value(env: dict[str, str] | None = None) -> str:
    """What the off side sets `KVCHAT_KERNELS` to: this run's value when it has one, else "off"."""
    value = (os.environ if env is None else env).get(VARIABLE, "").strip()
    return value or OFF


def side_environment(on: bool, off: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with `KVCHAT_KERNELS` unset (on) or set to `off`."""
    result = {k: v for k, v in (os.environ if env is None else env).items() if k != VARIABLE}
    if not on:
        result[VARIABLE] = off
    return result


def order(rounds: int) -> list[bool]:
    """The sides in the order they run: on, off, off, on, on, off, ... (True = on)."""
    return [side for r in range(rounds) for side in ((True, False) if r % 2 == 0 else (False, True))]


def compare(on_runs: list[list[dict[str, Any]]], off_runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (method, context) of the on side's rows: each measure's median over the
    rounds on either side, and the speed-up of the kernels."""

    def by_row(runs: list[list[dict[str, Any]]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
        found: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rows in runs:
            for row in rows:
                found.setdefault((row["method"], row["context"]), []).append(row)
        return found

    on, off = by_row(on_runs), by_row(off_runs)
    table = []
    for key, on_rows in on.items():
        if key not in off:
            continue
        row: dict[str, Any] = {"method": key[0], "context": key[1], "context_tokens": on_rows[0]["context_tokens"]}
        for measure, (name, kind) in MEASURES.items():
            on_values = [r[measure] for r in on_rows if measure in r]
            off_values = [r[measure] for r in off[key] if measure in r]
            if not on_values or not off_values:
                continue
            a, b = statistics.median(on_values), statistics.median(off_values)
            row[f"{name}_on"], row[f"{name}_off"] = a, b
            row[f"{name}_speedup"] = (a / b if kind == "rate" else b / a) if min(a, b) > 0 else float("nan")
        row["rounds"] = min(len(on_rows), len(off[key]))
        table.append(row)
    return table


COLUMNS = [
    "method",
    "context",
    "context_tokens",
    "ttft_on",
    "ttft_off",
    "ttft_speedup",
    "decode_on",
    "decode_off",
    "decode_speedup",
    "next_turn_ttft_on",
    "next_turn_ttft_off",
    "next_turn_ttft_speedup",
    "rounds",
]


def spawn(command: list[str], env: dict[str, str]) -> int:
    """Run `command` in `env`, its output on this process's; its exit status."""
    return subprocess.run(command, env=env, check=False).returncode


def run_side(args: list[str], on: bool, off: str, out: Path) -> list[dict[str, Any]]:
    """One side: `python -m kvchat ARGS` (its rows print as it goes), then its rows."""
    label = "kernels on" if on else f"{VARIABLE}={off}"
    print(f"-- {label}: kvchat {' '.join(args)}", flush=True)
    status = spawn([sys.executable, "-m", "kvchat", *args], side_environment(on, off))
    if status != 0:
        raise RuntimeError(f"the {label} side failed (exit status {status}): kvchat {' '.join(args)}")
    return json.loads((out / "speed_methods.json").read_text())["rows"]


def run(out: str | Path, quick: bool, argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Both sides in alternating rounds, then `speed_kernels.json` and `.md` under `out`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    off = off_value()
    rounds = QUICK_ROUNDS if quick else ROUNDS
    runs: dict[bool, list[list[dict[str, Any]]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="kvchat-kernels-") as folder:
        for number, on in enumerate(order(rounds)):
            side_out = Path(folder) / str(number)
            runs[on].append(run_side(side_arguments(argv, side_out), on, off, side_out))
    rows = compare(runs[True], runs[False])
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    report.write(
        out,
        "speed_kernels",
        rows,
        COLUMNS,
        title=f"kvchat's compiled kernels on against {VARIABLE}={off}",
        notes=(
            f"The speed suite's methods part (`--parts methods`, the rest of this command line as given) in a "
            f"new process per side: kernels on ({VARIABLE} unset) and {VARIABLE}={off}, "
            + (
                f"in {rounds} rounds of alternating order (on, off, then off, on). "
                if rounds > 1
                else "in one round (on, then off). "
            )
            + "*_on and *_off are "
            "the medians of each side's rounds (ttft and next_turn_ttft in seconds, decode in tokens/s); "
            "*_speedup = how many times faster with the kernels (above 1: they help). `generate (fp32)` runs "
            "none of kvchat's kernels: its ratios show the box's noise between the two sides."
        ),
        extra={"off": off, "rounds": rounds, "on_rows": runs[True], "off_rows": runs[False]},
    )
    return rows
