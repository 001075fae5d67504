"""From parsed options to what the commands hand the chat service: settings, the text of
the documents given with --file, the session store and the loaded engine."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.errors import Cancelled
from kvchat.turns import plural

if TYPE_CHECKING:
    from kvchat.documents import ReadProgress


# -- from options to settings ---------------------------------------------------------------
def method_params(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{method: {param: value}} for the hyperparameters given on the command line."""
    result: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("mp__") and value is not None:
            _, method, param = key.split("__", 2)
            result.setdefault(method, {})[param] = value
    return result


def model_options(args: argparse.Namespace):
    from kvchat.settings import ModelOptions

    return ModelOptions(model=args.model, quant=args.quant, device=args.device, dtype=args.dtype, threads=args.threads)


def cache_options(args: argparse.Namespace, recall: int | None = None):
    from kvchat.settings import (  # `recall`: when none was given (None: the engine's)
        DEFAULT_WINDOW,
        CacheOptions,
    )

    return CacheOptions(
        method=args.method,
        budget=None if args.budget is None else str(args.budget),
        window=DEFAULT_WINDOW if args.window is None else args.window,
        window_given=args.window is not None,
        sinks=args.sinks,
        batch=args.batch,
        prefill=args.prefill,
        seed=args.seed,
        allocation=args.allocation,
        recall=recall if args.recall is None else args.recall,
        method_params=method_params(args),
    )


def cache_settings(args: argparse.Namespace):
    return cache_options(args).for_method()


def system_choice(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(the system prompt, whether --system was given): the command line's, else the
    config file's (not given, so a saved session keeps its own)."""
    if args.system is not None:
        return args.system, True
    return getattr(args, "config_system", None), False


def sampling_settings(args: argparse.Namespace):
    from kvchat.settings import SamplingSettings

    return SamplingSettings(args.max_new_tokens, args.temperature, args.top_p).checked()


def bench_options(args: argparse.Namespace):
    from kvchat.settings import BenchOptions, int_list, name_list

    extra = {} if args.out is None else {"out": Path(args.out).expanduser()}
    return BenchOptions(  # rows without recall unless asked for, whatever the chat's default
        suite=args.suite,
        model=model_options(args),
        cache=cache_options(args, recall=0),
        quick=args.quick,
        lengths=int_list(args.lengths, "--lengths"),
        contexts=int_list(args.contexts, "--contexts"),
        skip_loop=args.skip_loop,
        tasks=name_list(args.tasks),
        methods=name_list(args.methods),
        parts=name_list(args.parts),
        recall=int_list(args.recall_values, "--recall"),
        **extra,
    )


def read_documents(paths: list[str] | None) -> str | None:
    """The text of every --file, in the order given (None for none). A folder gives its
    readable files in name order, and says on stderr which it took and which it left out.
    On a terminal, a PDF's pages and a book's chapters show as progress on stderr. Ctrl+C
    stops the reading between two pages (`KeyboardInterrupt`: `kvchat: interrupted`): a
    signal raised inside the PDF library's C calls would leave it half closed."""
    if not paths:
        return None
    from kvchat.documents import read_document, read_folder  # (the readers' imports: only with --file)

    texts = []
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        for given in paths:
            path = Path(given).expanduser()
            progress = reading_progress(path.name) if sys.stderr.isatty() else None
            try:
                if path.is_dir():
                    folder = read_folder(path, progress, cancel)
                    texts.append(folder.text)
                    names = ", ".join(document.name for document in folder.documents)
                    skipped = f"; {folder.skipped_note()}" if folder.skipped else ""
                    note = f"--file {given}: {plural(len(folder.documents), 'file')} in name order ({names}){skipped}"
                    print(f"kvchat: {note}", file=sys.stderr)
                else:
                    texts.append(read_document(path, progress, cancel).text)
            finally:
                if progress is not None:
                    print("\r\033[K", end="", file=sys.stderr, flush=True)  # the progress line goes
    except Cancelled:
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGINT, previous)
    return "\n".join(texts)


def reading_progress(name: str) -> ReadProgress:
    def show(done: int, total: int) -> None:
        print(f"\rkvchat: reading {name}: {done:,} of {total:,}", end="", file=sys.stderr, flush=True)

    return show


def open_store(args: argparse.Namespace):
    from kvchat.storage.db import Store, default_db_path

    return Store(args.db or default_db_path(), disk_budget=getattr(args, "disk_budget", None), on_rewrite=rewriting)


def rewriting(size: int) -> None:
    """Before the one rewrite of a database older than kvchat's incremental auto-vacuum."""
    from kvchat.settings import human_size

    print(
        f"kvchat: rewriting the sessions database ({human_size(size)}) once, so that deleting a session gives "
        "its disk space back; this takes 10-40 s a GB",
        file=sys.stderr,
        flush=True,
    )


def disk_note(line: str) -> None:
    """What the disk budget did after a save: one line on stderr, beside the answer."""
    print(f"kvchat: {line}", file=sys.stderr)


def load_engine(args: argparse.Namespace, on_status=None):
    from kvchat.model.engine import load_engine as load

    return load(model_options(args), on_status)
