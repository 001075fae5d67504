"""`kvchat ask`: one turn, printed (streamed on a terminal) or as one JSON object; and
`kvchat compare`: one question under several methods, side by side."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from kvchat.cli import options
from kvchat.cli.options import (
    cache_settings,
    disk_note,
    method_params,
    open_store,
    read_documents,
    sampling_settings,
    system_choice,
)
from kvchat.cli.parser import UserError


def cmd_ask(args: argparse.Namespace) -> int:
    document = read_documents(args.file)
    if args.session is not None and args.no_save:
        raise UserError("--session needs the database; drop --no-save")
    store = None if args.no_save else open_store(args)
    try:
        return _ask(args, document, store)
    finally:
        if store is not None:
            store.close()  # (checkpoints the WAL; `finished` may leave without the interpreter's teardown)


def _ask(args: argparse.Namespace, document: str | None, store) -> int:
    from kvchat.chat.controller import Controller
    from kvchat.errors import InputTooLong

    system, given = system_choice(args)
    # The settings are checked before the model loads: a typo costs no waiting.
    settings, sampling = cache_settings(args), sampling_settings(args)
    chat = Controller(options.load_engine(args), store, settings, sampling, system=system, on_disk_note=disk_note)
    if args.session is not None:
        chat.open_saved(args.session)  # a snapshot from another model is rebuilt from the transcript
        if given:  # the saved session's own prompt, unless --system says otherwise: read again under it
            chat.set_system(system)
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    streamed = not args.json and sys.stdout.isatty()
    try:
        outcome = chat.send(
            args.question,
            document,
            on_token=(lambda piece: print(piece, end="", flush=True)) if streamed else None,
            cancel=cancel,
        )
    except InputTooLong as err:
        raise UserError(err.message("document", "a shorter file") if document else err.message("question")) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    result, m = outcome.result, outcome.result.metrics
    if args.json:
        about = chat.describe()
        print(
            json.dumps(
                {
                    "answer": result.text,
                    "prompt_tokens": m.prompt_tokens,
                    "new_tokens": m.new_tokens,
                    "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 2),
                    "decode_tokens_per_s": round(m.decode_tokens_per_s, 2),
                    "ttft_s": round(m.ttft_s, 4),
                    "kv_bytes": m.kv_bytes,
                    "full_kv_bytes": m.full_kv_bytes,
                    "rss_bytes": m.rss_bytes,
                    "cuda_bytes": m.cuda_bytes,
                    "cold_bytes": m.cold_bytes,
                    "recalled": round(m.recalled, 2),
                    "recall": about["recall"],
                    "method": about["method"],
                    "budget": about["budget"],
                    "model": about["model"],
                    "precision": about["precision"],
                    "session": about["session"],
                    "system": about["system"],
                    "stop_reason": result.stop_reason,
                    "prefill_mode": m.prefill_mode,
                    "tokens_seen": m.tokens_seen,
                    "memory": about["memory"],
                    "parts": about["parts"],
                }
            )
        )
    elif streamed:
        print()
    else:
        print(result.text)
    if outcome.save_error is not None:  # the answer above stands; the turn was not saved
        raise outcome.save_error
    return 130 if result.cancelled else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kvchat import compress
    from kvchat.chat import compare
    from kvchat.chat.controller import Controller
    from kvchat.errors import InputTooLong
    from kvchat.settings import name_list

    # Checked before the model loads: a typo costs no waiting.
    methods = compare.check_methods(compress.available() if args.methods is None else name_list(args.methods) or [])
    document = read_documents(args.file)
    settings, sampling, params = cache_settings(args), sampling_settings(args), method_params(args)
    chat = Controller(options.load_engine(args), None, settings, sampling, params, system=system_choice(args)[0])
    chatty = not args.json  # progress on stderr; the table alone goes to stdout

    def started(method: str) -> None:
        if chatty:
            print(
                f"kvchat: answering under {method} ({methods.index(method) + 1}/{len(methods)})…",
                file=sys.stderr,
                flush=True,
            )

    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        result = chat.compare(
            methods, question=args.question, document=document, on_start=started, cancel=cancel, keep_sessions=False
        )
    except InputTooLong as err:
        what = err.message("document", "a shorter file") if document else err.message("question")
        raise UserError(f"{what} (or leave that method out of --methods)") from None
    finally:
        signal.signal(signal.SIGINT, previous)
    if args.json:
        print(json.dumps([answer.as_json() for answer in result.answers]))
        if result.note:
            print(f"kvchat: note: {result.note}", file=sys.stderr)
    else:
        print(comparison_table(result))
    if result.cancelled:
        print(f"kvchat: stopped after {len(result.answers)} of {len(methods)} methods", file=sys.stderr)
        return 130
    return 0


def comparison_table(result) -> str:
    """The `kvchat compare` table: one row per method, the answer last (wrapped)."""
    import shutil
    import textwrap

    width = max(shutil.get_terminal_size((100, 24)).columns, 60)
    head = f"{'method':<10} {'KV MB':>7} {'TTFT s':>7} {'tok/s':>6}  "
    lines = [head + "answer", "-" * min(width, 100)]
    room = max(width - len(head), 20)
    for a in result.answers:
        text = " ".join(a.answer.split()) or "(no answer)"
        if a.stop_reason == "cancelled":
            text += " [stopped]"
        wrapped = textwrap.wrap(text, room) or [""]
        lines.append(
            f"{a.method:<10} {a.kv_bytes / 2**20:>7.2f} {a.ttft_s:>7.2f} {a.decode_tokens_per_s:>6.1f}  " + wrapped[0]
        )
        lines += [" " * len(head) + rest for rest in wrapped[1:]]
    if result.prefill_mode == "exact-then-compress":
        lines += textwrap.wrap(
            f"one exact prefill of {result.prompt_tokens:,} tokens ({result.prefill_s:.2f} s), "
            "forked to each method; TTFT = that prefill + the method's compression of it + its "
            "first token",
            min(width, 100),
        )
    if result.note:
        lines += textwrap.wrap(f"note: {result.note}", min(width, 100))
    return "\n".join(lines)
