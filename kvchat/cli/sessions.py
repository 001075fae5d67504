"""`kvchat sessions ...`: list, search, show (the transcript or the memory map), export,
branch and delete saved sessions."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from kvchat.cli import options
from kvchat.cli.options import (
    cache_settings,
    open_store,
    sampling_settings,
)
from kvchat.cli.parser import UserError
from kvchat.settings import human_size


def cmd_sessions(args: argparse.Namespace) -> int:
    store = open_store(args)
    if args.action == "list":
        print(list_lines(store))
    elif args.action == "search":
        print(search_lines(store, " ".join(args.text), args.limit))
    elif args.action == "show" and args.memory:
        print(memory_table(store, args.id, args.layers))
    elif args.action == "show":
        from kvchat.chat.persist import system_from_meta

        row = store.get_session(args.id)
        print(f"on disk: {disk_cell(row)}")
        system = system_from_meta(row.params)
        if system:
            print(f"system: {system}")
        print(store.export_session(args.id, "md"))
    elif args.action == "export":
        print(store.export_session(args.id, args.format))
    elif args.action == "branch":
        return cmd_branch(args, store)
    elif args.action == "delete":
        row = store.get_session(args.id)
        store.delete_session(args.id)  # and gives its space back to the file system
        print(f"deleted session {args.id} ({row.title}, {human_size(row.disk_bytes)})")
    return 0


def cmd_branch(args: argparse.Namespace, store) -> int:
    """`kvchat sessions branch ID --at N`: prints the new session's id and how its cache
    was obtained. The model is loaded only when the cache must be rebuilt; Ctrl+C stops
    the rebuild, and then no branch is left behind."""
    from kvchat.chat.controller import Controller
    from kvchat.errors import Cancelled

    settings, sampling = cache_settings(args), sampling_settings(args)
    chat = Controller(lambda: options.load_engine(args), store, settings, sampling, on_disk_note=options.disk_note)
    shown: list[int] = []  # progress printed on a terminal: a line to end

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            shown.append(done)
            print(
                f"\rkvchat: rebuilding the branch's cache: {done:,} / {total:,} tokens",
                end="",
                file=sys.stderr,
                flush=True,
            )

    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        outcome = chat.branch(args.id, args.at, progress, cancel, open_it=False)
    except Cancelled:
        print("kvchat: stopped; no branch was made", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
        if shown:
            print(file=sys.stderr)
    print(f"session {outcome.session_id}: branch of session {outcome.origin_id} at turn {outcome.at}; {outcome.how}")
    return 0


def disk_cell(row) -> str:
    """What a session takes on disk, and whether the disk budget dropped its recall tier."""
    size = human_size(row.disk_bytes)
    if row.tier_dropped:
        return f"{size} (recall tier dropped {row.tier_dropped[:10]} under the disk budget)"
    return f"{size} (recall tier {human_size(row.cold_bytes)})" if row.cold_bytes else size


def list_lines(store) -> str:
    """`kvchat sessions list`: a line per session, newest first (id, last update, method,
    tokens, messages, bytes on disk, title, and where a branch came from or that its
    recall tier was dropped), then what they take together and the file's size."""
    rows = store.list_sessions()
    if not rows:
        return "no saved sessions yet; `kvchat` or `kvchat ask` creates one"
    lines = []
    for r in rows:
        notes = [note for note in (r.origin(), "recall tier dropped" if r.tier_dropped else "") if note]
        lines.append(
            f"{r.id:>4}  {r.updated[:16].replace('T', ' ')}  {r.method:<9} {r.tokens:>7,} tok  {r.message_count:>3} msg"
            f"  {human_size(r.disk_bytes):>8}  {r.title}" + (f"  ({'; '.join(notes)})" if notes else "")
        )
    total = sum(r.disk_bytes for r in rows)
    budget = f" (disk budget {human_size(store.disk_budget)})" if store.disk_budget else ""
    lines.append(
        f"{len(rows)} session{'s' if len(rows) > 1 else ''}, {human_size(total)}{budget}; "
        f"the file {store.path} takes {human_size(store.file_bytes())}"
    )
    return "\n".join(lines)


def search_lines(store, text: str, limit: int) -> str:
    """`kvchat sessions search`: one line per matching session (id, last update, title,
    the text around its best match; matched words bold on a terminal), or why none."""
    from kvchat.storage.search import match_query

    if not match_query(text):
        raise UserError(f"nothing to search for in {text!r}: give words (letters or digits)")
    rows = store.search(text, limit=max(1, limit))
    if not rows:
        return f"no saved session has a message matching {text!r}"
    bold = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    lines = []
    for r in rows:
        snippet, end = "", 0
        for start, stop in r.marks:
            word = r.snippet[start:stop]
            snippet += r.snippet[end:start] + (f"\x1b[1m{word}\x1b[0m" if bold else word)
            end = stop
        snippet += r.snippet[end:]
        title = r.title if len(r.title) <= 40 else r.title[:39] + "…"
        lines.append(f"{r.id:>4}  {r.updated[:16].replace('T', ' ')}  {title}  {snippet}")
    return "\n".join(lines)


def memory_table(store, session_id: int, layers: bool = False) -> str:
    """The memory map saved with the session's newest snapshot, as a text table."""
    from kvchat.chat.memory_map import memory_lines
    from kvchat.turns import MemoryReport

    title = store.get_session(session_id).title
    meta = store.snapshot_meta(session_id)
    memory = (meta or {}).get("memory")
    if memory is None:
        raise UserError(
            f"session {session_id} has no saved memory map (saved by an older kvchat or never answered); "
            f"continue it once (`kvchat ask --session {session_id} ...` or `kvchat --resume {session_id}`) to record one"
        )
    return "\n".join([f"session {session_id}: {title}"] + memory_lines(MemoryReport.from_dict(memory), layers))
