"""Typed settings shared by the CLI, the app and the benchmarks, and the config file.

The CLI turns its options into these objects once; nothing past `kvchat.cli` sees an
argparse Namespace. The config file gives option defaults (the command line wins):

    # ~/.config/kvchat/config.toml (see `kvchat --help` for the path on this machine)
    model = "/models/SmolLM2-360M-Instruct"
    method = "h2o"
    budget = "25%"            # or "64MB": the whole KV cache in bytes
    window = 512
    dtype = "bfloat16"
    threads = 4
    recall = 32               # or "off": the recall tier, kvchat/recall/tier.py

`python -m kvchat.settings --write-readme` regenerates the README's hyperparameter
table from the methods' `Param` declarations.
"""

from __future__ import annotations

import math
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.errors import CommandError, SettingsError
from kvchat.paths import config_path, data_home

DEFAULT_METHOD = "window"
DEFAULT_BUDGET = "1024"
DEFAULT_WINDOW = 1024
DEFAULT_SINKS = 4
DEFAULT_BATCH = 64


# Sizes a byte budget may be given in (case-insensitive): KB/MB/GB are powers of 10,
# KiB/MiB/GiB powers of 2, as everywhere else.
BYTE_UNITS = {"KB": 10**3, "KIB": 2**10, "MB": 10**6, "MIB": 2**20, "GB": 10**9, "GIB": 2**30}
_UNIT_SPELLING = {"KB": "KB", "KIB": "KiB", "MB": "MB", "MIB": "MiB", "GB": "GB", "GIB": "GiB"}
BUDGET_FORMS = "entries per KV head (1024), a share of the tokens seen (25%) or a size (64MB, 64MiB, 1GB)"
DISK_BUDGET_FORMS = "a size (500MB, 2GB, 1.5GiB) or off"


def parse_disk_budget(value: str | int | None) -> int | None:
    """`--disk-budget` and the `disk_budget` config key: the bytes the saved sessions may
    take (kvchat/storage/disk.py), or None for no bound ("off", "none" or unset). A
    whole number is bytes."""
    if value is None:
        return None
    raw = str(value).strip()
    if raw.lower() in ("off", "none"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", raw)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in BYTE_UNITS):
        raise SettingsError(f"disk budget {raw!r}: give {DISK_BUDGET_FORMS}")
    size = math.floor(float(match.group(1)) * BYTE_UNITS.get(unit, 1))
    if size < 1:
        raise SettingsError(f"disk budget {raw!r}: a size must be more than 0; give {DISK_BUDGET_FORMS}")
    return size


def human_size(count: int) -> str:
    """Bytes as people read them, in powers of 10 (as --budget's MB and GB are)."""
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Budget:
    """`1024` = middle entries per KV head; `25%` = total kept per KV head (sinks + window
    + middle) as a share of the tokens seen; `64MB` = the total KV bytes of the session,
    every layer, sinks and window included (docs/design.md, "Budgets").

    A byte budget has `unit` set ("MB", "MiB", ...) and `value` in bytes."""

    value: float
    percent: bool
    unit: str = ""

    @property
    def in_bytes(self) -> bool:
        return bool(self.unit)

    @staticmethod
    def parse(text: str | int) -> Budget:
        raw = str(text).strip()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", raw)
        if match:
            pct = float(match.group(1))
            if not 0 < pct <= 100:
                raise ValueError(f"budget {raw!r}: a percentage must be in (0, 100]")
            return Budget(pct / 100, True)
        if raw.isdigit():
            return Budget(int(raw), False)
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)", raw)
        if match:
            unit = match.group(2).upper()
            if unit not in BYTE_UNITS:
                raise ValueError(f"budget {raw!r}: unknown unit {match.group(2)!r}; use KB, KiB, MB, MiB, GB or GiB")
            size = float(match.group(1)) * BYTE_UNITS[unit]
            if size < 1:
                raise ValueError(f"budget {raw!r}: a size must be more than 0")
            return Budget(math.floor(size), False, _UNIT_SPELLING[unit])
        raise ValueError(f"budget {raw!r}: give {BUDGET_FORMS}")

    def split(self, tokens_seen: int, sinks: int, window: int, keeps_middle: bool = True) -> tuple[int, int]:
        """(middle budget, effective window) for the tokens seen so far. A method that
        keeps no middle gets the whole share as its window (equal memory). A byte budget
        is split by the cache, which knows what an entry costs (`CompressedCache.targets`)."""
        if self.in_bytes:
            raise ValueError("a budget in bytes is split by the cache (CompressedCache.targets)")
        if not self.percent:
            return int(self.value), window
        # The relative nudge undoes float error: 0.35 * 100 is 34.999..., not 35.
        total = max(1, math.floor(self.value * tokens_seen * (1 + 1e-12)))
        if not keeps_middle:
            return 0, max(1, total - sinks)
        middle = max(total - sinks - window, total // 2)
        return middle, max(1, total - sinks - middle)

    def __str__(self) -> str:
        if self.in_bytes:
            return f"{self.value / BYTE_UNITS[self.unit.upper()]:.12g}{self.unit}"
        return f"{self.value * 100:g}%" if self.percent else str(int(self.value))


# Tokens per forward pass of a prefill (what a progress bar counts in).
PREFILL_CHUNK = 512
# exact-then-compress is used while the exact prefill's KV fits this many bytes.
DEFAULT_PREFILL_MEMORY = 1 << 30
PREFILL_MODES = ("auto", "exact-then-compress", "streaming")
# How a budget in bytes is shared across layers (docs/design.md, "Budgets"): by the
# measured need of each layer (measured by kvchat/calibration/calibrate.py), or evenly.
ALLOCATIONS = ("auto", "uniform")


# The recall tier (kvchat/recall/tier.py): cold tokens recalled per KV head and forward pass.
# When `--recall` is not given (None in the settings) the engine decides
# (`Engine.default_recall`): DEFAULT_RECALL on a CPU running kvchat's own ranking kernel
# (kvchat/native/__init__.py: AVX512-VNNI or AVX2), where every method with recall decodes
# at 0.82-1.0x of its speed without and a later turn's first token comes at 0.98-1.15x of
# its time without (a 2-core Zen 5); off elsewhere, where PyTorch's path decoded `window`
# at 0.72-0.82x and other CPUs were not measured
# (docs/decisions/0007-c-kernels-with-python-twins.md). Recall finds the needles the
# compressors lose (docs/decisions/0001-recall-ranks-4-bit-keys.md).
DEFAULT_RECALL = 32
RECALL_OFF = ("off", "0")
RECALL_FORMS = "a number of cold tokens recalled per KV head and step (e.g. 32) or off"


def parse_recall(value: str | int) -> int:
    """`--recall`, the `recall` config key and `/recall`: "off" (or 0) is 0, a whole number
    N >= 1 is N. Raises SettingsError naming the value and the forms it may take."""
    if isinstance(value, bool):  # TOML true/false: neither says how many tokens
        raise SettingsError(f"recall {value!r}: give {RECALL_FORMS}")
    raw = str(value).strip().lower()
    if raw in RECALL_OFF:
        return 0
    try:
        count = int(raw)
    except ValueError:
        raise SettingsError(f"recall {str(value)!r}: give {RECALL_FORMS}") from None
    if count < 0:
        raise SettingsError(f"recall {count}: must be off (0) or at least 1 token; give {RECALL_FORMS}")
    return count


def recall_argument(text: str) -> str:
    """The argument of `/recall N|off` as a count ("0": off; "": none given, show the
    setting). Raises CommandError for anything else."""
    if not text.strip():
        return ""
    try:
        return str(parse_recall(text))
    except SettingsError as err:
        raise CommandError(f"/recall: {err}") from None


def recall_text(recall: int) -> str:
    """How a recall setting is shown: "off" or "32/head"."""
    return "off" if not recall else f"{recall}/head"


# -- what the engine takes ---------------------------------------------------------
@dataclass
class CacheSettings:
    method: str = DEFAULT_METHOD
    budget: str = DEFAULT_BUDGET
    window: int = DEFAULT_WINDOW
    sinks: int = DEFAULT_SINKS
    batch: int = DEFAULT_BATCH
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    prefill_mode: str = "auto"  # auto | exact-then-compress | streaming
    prefill_memory: int = DEFAULT_PREFILL_MEMORY
    allocation: str = "auto"  # auto | uniform: a byte budget's split across layers
    # Cold tokens recalled per KV head and forward pass (kvchat/recall/tier.py); 0 = off; None:
    # the engine's default (`Engine.default_recall`, what the command line leaves unset).
    recall: int | None = 0
    # A byte budget may shrink the window (sinks + window take at most half of it) when
    # the user left --window unset; False keeps the window as given, or refuses.
    fit_window: bool = False


@dataclass
class SamplingSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    def checked(self) -> SamplingSettings:
        if self.max_new_tokens < 1:
            raise SettingsError("--max-new-tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise SettingsError("--temperature must be >= 0 and --top-p in (0, 1]")
        return self


# -- what the user chose -----------------------------------------------------------
@dataclass(frozen=True)
class ModelOptions:
    """Which model to load and how."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    quant: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None  # intra-op threads; None: the free cores (kvchat/runtime.py)


@dataclass(frozen=True)
class CacheOptions:
    """The cache choices, for any method: `for_method` gives the engine's CacheSettings."""

    method: str | None = None  # None: the default method
    budget: str | None = None  # None: not given (a suite may pick its own)
    window: int = DEFAULT_WINDOW
    window_given: bool = True  # False: --window left unset, so a byte budget may shrink it
    sinks: int = DEFAULT_SINKS
    batch: int = DEFAULT_BATCH
    prefill: str = "auto"
    seed: int = 0
    allocation: str = "auto"
    recall: int | str | None = 0  # cold tokens recalled per KV head and step; 0 = off; None: the engine's default
    method_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # {method: {param: value}}

    def for_method(self, method: str | None = None, budget: str | None = None) -> CacheSettings:
        """Settings for `method` (default: the chosen one), checked; `budget` replaces an
        unset budget."""
        from kvchat.compress import check_name

        name = method or self.method or DEFAULT_METHOD
        check_name(name)  # unknown method -> ValueError naming the choices
        chosen = self.budget or budget or DEFAULT_BUDGET
        Budget.parse(chosen)
        if self.window < 1 or self.sinks < 0 or self.batch < 1:
            raise SettingsError("--window and --batch must be at least 1 and --sinks at least 0")
        if self.prefill not in PREFILL_MODES:
            raise SettingsError(f"prefill {self.prefill!r}: choose one of {', '.join(PREFILL_MODES)}")
        if self.allocation not in ALLOCATIONS:
            raise SettingsError(f"allocation {self.allocation!r}: choose one of {', '.join(ALLOCATIONS)}")
        return CacheSettings(
            method=name,
            budget=chosen,
            window=self.window,
            sinks=self.sinks,
            batch=self.batch,
            params=dict(self.method_params.get(name, {})),
            seed=self.seed,
            prefill_mode=self.prefill,
            allocation=self.allocation,
            fit_window=not self.window_given,
            recall=None if self.recall is None else parse_recall(self.recall),
        )


@dataclass(frozen=True)
class BenchOptions:
    """One `kvchat bench SUITE` run."""

    suite: str
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    out: Path = field(default_factory=lambda: data_home() / "bench-out")
    quick: bool = False
    lengths: tuple[int, ...] | None = None
    contexts: tuple[int, ...] | None = None
    skip_loop: bool = False
    tasks: tuple[str, ...] | None = None
    methods: tuple[str, ...] | None = None
    parts: tuple[str, ...] | None = None  # speed: which parts to run
    recall: tuple[int, ...] | None = None  # recall: recall values side by side (0 = off); None: off only


def int_list(text: str | None, option: str) -> tuple[int, ...] | None:
    """ "1024,2048" -> (1024, 2048); None stays None."""
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SettingsError(f"{option} {text!r}: give comma-separated whole numbers, e.g. 1024,4096") from None


def name_list(text: str | None) -> tuple[str, ...] | None:
    return tuple(part.strip() for part in text.split(",") if part.strip()) if text else None


def system_prompt(text: str | None) -> str | None:
    """The system prompt `text` sets: None when it is unset or blank (the chat
    template's own default then applies)."""
    return text if text is not None and text.strip() else None


# -- the config file -----------------------------------------------------------------
# key -> (accepted TOML types, what it sets). Each key is the default of the option of
# the same name (with - for _).
CONFIG_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "model folder, GGUF file, Hugging Face repo id or ollama:NAME[:TAG]"),
    "method": ((str,), "compression method"),
    "budget": ((str, int), 'middle entries per KV head (1024), a share ("25%") or a size ("64MB")'),
    "allocation": ((str,), "auto or uniform: how a budget in bytes is shared across layers"),
    "window": ((int,), "exact recent tokens per KV head"),
    "sinks": ((int,), "exact first tokens"),
    "dtype": ((str,), "auto, int8, float32, bfloat16 or float16"),
    "device": ((str,), "auto, cpu or cuda"),
    "threads": ((int,), "torch intra-op threads"),
    "system": ((str,), "the system prompt of new sessions"),
    "recall": (
        (str, int),
        'cold tokens recalled per KV head and step (32), or "off" (default: 32 on a CPU '
        "with kvchat's ranking kernel, else off)",
    ),
    "disk_budget": (
        (str, int),
        'the disk the saved sessions may take ("2GB"); past it, the recall tiers of the least '
        "recently used sessions are dropped (default: no bound)",
    ),
}


def read_config(path: Path | None = None) -> dict[str, Any]:
    """Option defaults from the TOML config file ({} when there is none). A malformed
    file, an unknown key or a value of the wrong type is a SettingsError naming both."""
    path = config_path() if path is None else path
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SettingsError(f"config {path}: not valid TOML ({err}); fix or remove the file") from None
    except OSError as err:
        raise SettingsError(f"config {path}: cannot be read ({err.strerror})") from None
    values: dict[str, Any] = {}  # each of a type CONFIG_KEYS allows (checked below)
    for key, value in data.items():
        if key not in CONFIG_KEYS:
            raise SettingsError(f"config {path}: unknown key {key!r}; known keys: {', '.join(CONFIG_KEYS)}")
        types, _ = CONFIG_KEYS[key]
        if not isinstance(value, types) or isinstance(value, bool):
            wanted = " or ".join("a string" if t is str else "a whole number" for t in types)
            raise SettingsError(f"config {path}: key {key!r} must be {wanted}, got {value!r}")
        values[key] = str(value) if key == "budget" else value
    if "budget" in values:
        try:
            Budget.parse(values["budget"])
        except ValueError as err:
            raise SettingsError(f"config {path}: key 'budget': {err}") from None
    if "recall" in values:
        try:
            values["recall"] = parse_recall(values["recall"])
        except SettingsError as err:
            raise SettingsError(f"config {path}: key 'recall': {err}") from None
    if "disk_budget" in values:
        try:
            values["disk_budget"] = parse_disk_budget(values["disk_budget"])
        except SettingsError as err:
            raise SettingsError(f"config {path}: key 'disk_budget': {err}") from None
    if values.get("allocation", "auto") not in ALLOCATIONS:
        raise SettingsError(f"config {path}: key 'allocation' must be one of {', '.join(ALLOCATIONS)}")
    return values


# -- the README's hyperparameter table ---------------------------------------------------
TABLE_START = "<!-- hyperparameters: generated by `python -m kvchat.settings --write-readme` -->"
TABLE_END = "<!-- /hyperparameters -->"


def hyperparameter_table() -> str:
    """The markdown table of every method's hyperparameters, from their declarations."""
    from kvchat.compress import available, get

    lines = ["| option | default | meaning (source of the default) |", "|---|---|---|"]
    for method in available():
        for param in get(method).hyperparameters:
            meaning = param.help.replace("|", "\\|")
            lines.append(f"| `{param.flag(method)}` | {param.shown_default} | {meaning} ({param.source}) |")
    return "\n".join(lines)


def readme_with_table(readme: str) -> str:
    """`readme` with the text between the table markers replaced by the current table."""
    start, end = readme.index(TABLE_START) + len(TABLE_START), readme.index(TABLE_END)
    return readme[:start] + "\n" + hyperparameter_table() + "\n" + readme[end:]


def main(argv: list[str]) -> int:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    if argv != ["--write-readme"]:
        print("usage: python -m kvchat.settings --write-readme", file=sys.stderr)
        return 2
    readme.write_text(readme_with_table(readme.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
