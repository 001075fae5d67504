"""`kvchat` with no command: the Textual app, or a plain line chat where Textual is missing."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvchat import __version__
from kvchat.cli import options
from kvchat.cli.options import (
    cache_settings,
    open_store,
    sampling_settings,
    system_choice,
)


def cmd_app(args: argparse.Namespace) -> int:
    settings = cache_settings(args)
    sampling = sampling_settings(args)
    system = system_choice(args)[0]
    store = open_store(args)
    if args.resume is not None:
        store.get_session(args.resume)
    try:
        try:
            from kvchat.tui.app import run_app
        except ImportError:
            return line_chat(options.load_engine(args), store, settings, sampling, system)
        # The app draws its first frame at once and calls the loader in a worker.
        # The loader's one-off notes (the first start's conversion) go to the status bar.
        run_app(
            lambda on_status: options.load_engine(args, on_status),
            store,
            settings,
            sampling,
            args.resume,
            system=system,
        )
    finally:
        store.close()  # the app's workers have finished: Textual's run waits for them
    return 0


def line_chat(engine, store, settings, sampling, system=None) -> int:
    """A plain line chat (used when the Textual app is unavailable)."""
    from kvchat.chat.controller import Controller

    chat = Controller(engine, store, settings, sampling, system=system, on_disk_note=options.disk_note)
    print(f"kvchat {__version__} · {chat.model_name} · method {settings.method} · Ctrl+D to quit")
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        if not text.strip():
            continue
        cancel = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_, cancel=cancel: cancel.set())
        try:
            outcome = chat.send(text, on_token=lambda p: print(p, end="", flush=True), cancel=cancel)
        finally:
            signal.signal(signal.SIGINT, previous)
        m = outcome.result.metrics
        print(
            f"\n  [{m.decode_tokens_per_s:.1f} tok/s · KV {m.kv_bytes / 2**20:.1f} MB · {m.tokens_seen:,} tokens seen]"
        )
        if outcome.save_error is not None:
            print(f"kvchat: not saved: {outcome.save_error}", file=sys.stderr)
