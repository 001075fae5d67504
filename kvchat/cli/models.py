"""`kvchat models`: the models already on this disk (the embedded one, the Hugging Face
hub cache, Ollama, LM Studio), each by the name `--model` takes, with its family, its
size and whether kvchat runs it. Offline and from headers only: no weight is read and
torch is not imported, so it answers at once."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvchat.errors import ModelError
from kvchat.model.families import SUPPORTED, WHY_NOT
from kvchat.model.preflight import model_family
from kvchat.model.sources import ModelSource, installed, looked_in
from kvchat.settings import human_size


@dataclass(frozen=True)
class Row:
    """One model found, as listed (and as `--json` writes it)."""

    model: str | None  # what to pass to --model (None: the default, pass nothing)
    name: str
    source: str  # "embedded", "huggingface", "ollama" or "lmstudio"
    path: str
    family: str  # the config's `model_type`, or the GGUF's architecture as one
    bytes: int
    size: str
    supported: bool
    why_not: str | None  # why kvchat cannot run it


def cmd_models(args: argparse.Namespace) -> int:
    rows, skipped = listing()
    if args.json:
        print(json.dumps({"models": [asdict(r) for r in rows], "skipped": skipped, "looked_in": looked_in()}, indent=1))
    else:
        print(table(rows, skipped))
    return 0


def listing() -> tuple[list[Row], list[str]]:
    """(the models found, a note for each entry that could not be read)."""
    found = installed()
    rows, skipped = [], list(found.skipped)
    for source in found.models:
        try:
            rows.append(row(source))
        except (ModelError, OSError) as err:
            skipped.append(f"{source.name}: {err}")
    return rows, skipped


def row(source: ModelSource) -> Row:
    """A model's line: its family from its config or GGUF header, its bytes on disk."""
    family = model_family(source.path)
    why_not = None
    if family not in SUPPORTED:
        why_not = WHY_NOT.get(family, f"kvchat runs {', '.join(SUPPORTED)}")
    size = disk_bytes(source.path)
    return Row(
        model=None if source.store == "embedded" else source.name,
        name=source.name,
        source=source.store,
        path=str(source.path),
        family=family,
        bytes=size,
        size=human_size(size),
        supported=why_not is None,
        why_not=why_not,
    )


def disk_bytes(path: Path) -> int:
    """A file's size, or the sum of a folder's files (a hub snapshot's links followed to
    their blobs)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def table(rows: list[Row], skipped: list[str]) -> str:
    """The listing as text: a row per model, then the entries skipped, then where kvchat
    looked when it found nothing but the embedded model."""
    names = ["(no --model)" if r.model is None else r.model for r in rows]
    width = max([len("--model"), *map(len, names)])
    family = max([len("family"), *(len(r.family) for r in rows)])
    lines = [f"{'--model':<{width}}  {'family':<{family}}  {'size':>9}"]
    for name, r in zip(names, rows):
        note = f"the embedded {r.name}" if r.source == "embedded" else ""
        if r.why_not is not None:
            note = f"not supported: {r.why_not}"
        lines.append(f"{name:<{width}}  {r.family:<{family}}  {r.size:>9}  {note}".rstrip())
    lines += [f"skipped {note}" for note in skipped]
    if all(r.source == "embedded" for r in rows):
        where = looked_in()
        lines.append(
            f"no {'other ' if rows else ''}models found; looked in the Hugging Face cache "
            f"({', '.join(where['huggingface'])}), Ollama ({', '.join(where['ollama'])}) "
            f"and LM Studio ({', '.join(where['lmstudio'])})"
        )
    return "\n".join(lines)
