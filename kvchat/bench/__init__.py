"""`kvchat bench SUITE`: measurements, not tests. Each suite writes JSON, a markdown
table and PNG plots under `--out` (see `report.py`)."""

from __future__ import annotations

import argparse
import importlib

SUITES = {
    "speed": "speed", "attention": "attention", "recall": "recall", "resume": "resume", "fidelity": "fidelity",
}


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"{__name__}.{SUITES[args.suite]}")
    return module.run(args)
