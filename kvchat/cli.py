"""Command line: `kvchat` (the app), `kvchat ask`, `kvchat sessions ...`, `kvchat bench ...`.

Every user error ends as one line on stderr naming the cause and the way out, exit
code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from . import __version__

EXIT_USAGE = 2
MAX_DOCUMENT_BYTES = 64 << 20


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


# -- options -------------------------------------------------------------------------
def _method_params() -> list[tuple[str, str, Any, str]]:
    """(method, param, default, help) for every registered method's hyperparameters."""
    from . import compress

    rows = []
    for name in compress.available():
        cls = compress.get(name)
        for param, default in cls.defaults.items():
            rows.append((name, param, default, cls.param_help.get(param, "")))
    return rows


def _parse_value(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if default is None:
        for cast in (int, float):
            try:
                return cast(text)
            except ValueError:
                pass
    return text


def common_options(suppress: bool = False) -> argparse.ArgumentParser:
    """Options every command takes. Subcommand copies use SUPPRESS defaults so that an
    option given before the subcommand is not reset by the subcommand's default."""
    from .cache import DEFAULT_BATCH, DEFAULT_BUDGET, DEFAULT_SINKS, DEFAULT_WINDOW
    from .compress import available

    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS if suppress else None)
    model = p.add_argument_group("model")
    model.add_argument("--model", metavar="PATH", help="local HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    model.add_argument("--quant", choices=["4bit", "8bit"], help="load weights through bitsandbytes")
    model.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    model.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    cache = p.add_argument_group("KV cache")
    cache.add_argument("--method", default=None, help=f"compression method: {', '.join(available())} (default: window)")
    cache.add_argument("--budget", default=DEFAULT_BUDGET, help="middle entries per KV head (e.g. 1024) or total share of tokens seen (e.g. 25%%)")
    cache.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="exact recent tokens per KV head (default %(default)s)")
    cache.add_argument("--sinks", type=int, default=DEFAULT_SINKS, help="exact first tokens (attention sinks, default %(default)s)")
    cache.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="tokens leaving the window per compressor call (default %(default)s)")
    cache.add_argument("--prefill", default="auto", choices=["auto", "exact-then-compress", "streaming"], help="how long input is prefilled")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=512)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    store = p.add_argument_group("sessions")
    store.add_argument("--db", metavar="PATH", help="session database (default: $KVCHAT_DB or sessions/kvchat.db)")
    params = p.add_argument_group("method hyperparameters (defaults from each paper)")
    for method, param, default, text in _method_params():
        flag = f"--{method}-{param.replace('_', '-')}"
        params.add_argument(
            flag, dest=f"mp__{method}__{param}", default=None, metavar="V",
            type=lambda s, d=default: _parse_value(s, d),
            help=f"{text} (default: {default})".replace("%", "%%"),
        )
    if suppress:
        for action in p._actions:
            action.default = argparse.SUPPRESS
    return p


def build_parser() -> argparse.ArgumentParser:
    common = common_options(suppress=True)
    parser = argparse.ArgumentParser(
        prog="kvchat",
        parents=[common_options()],
        description=(
            "Chat with a local LLM in your terminal. The KV cache stays small however long the "
            "conversation gets: exact first tokens + exact recent window + a compressed middle. "
            "Run without a command to open the chat app."
        ),
        epilog="Examples:\n  kvchat\n  kvchat ask \"What is the capital of France?\"\n"
        "  kvchat ask \"What does it say about X?\" --file paper.txt --method chelsea --budget 25%\n"
        "  kvchat sessions list\n  kvchat --resume 3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvchat {__version__}")
    parser.add_argument("--resume", type=int, metavar="ID", help="open a saved session in the app")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ask = sub.add_parser("ask", parents=[common], help="one non-interactive turn; prints the answer")
    ask.add_argument("question")
    ask.add_argument("--file", metavar="DOC", help="a text document put before the question")
    ask.add_argument("--json", action="store_true", help="print one JSON object (answer + metrics)")
    ask.add_argument("--session", type=int, metavar="ID", help="continue a saved session")
    ask.add_argument("--no-save", action="store_true", help="do not save the turn as a session")

    sessions = sub.add_parser("sessions", parents=[common], help="list, show, export or delete saved sessions")
    ss = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    ss.add_parser("list", parents=[common], help="saved sessions, newest first")
    for action, text in (("show", "a session's transcript"), ("delete", "delete a session")):
        sp = ss.add_parser(action, parents=[common], help=text)
        sp.add_argument("id", type=int)
    ex = ss.add_parser("export", parents=[common], help="export a session")
    ex.add_argument("id", type=int)
    ex.add_argument("--format", choices=["md", "json"], default="md")

    bench = sub.add_parser("bench", parents=[common], help="benchmarks: speed, attention, recall, resume")
    bench.add_argument("suite", choices=["speed", "attention", "recall", "resume", "fidelity"])
    bench.add_argument("--out", default="bench-out", help="folder for the JSON, markdown and PNG reports")
    bench.add_argument("--quick", action="store_true", help="a smaller grid (smoke runs)")
    bench.add_argument("--lengths", help="comma-separated context lengths (speed, recall, resume)")
    bench.add_argument("--contexts", help="speed: comma-separated contexts of the methods part (default 1k-16k)")
    bench.add_argument("--skip-loop", action="store_true", help="speed: skip the loop-vs-generate part")
    bench.add_argument("--tasks", help="recall: comma-separated tasks, needle and/or lines (default both)")
    bench.add_argument("--methods", help="comma-separated methods (default: all)")
    return parser


def method_params(args: argparse.Namespace, method: str) -> dict[str, Any]:
    prefix = f"mp__{method}__"
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}


def cache_settings(args: argparse.Namespace):
    from .cache import DEFAULT_METHOD, Budget
    from .compress import get
    from .engine import CacheSettings

    method = args.method or DEFAULT_METHOD
    get(method)  # unknown method -> ValueError with the list
    Budget.parse(args.budget)
    if args.window < 1 or args.sinks < 0:
        raise UserError("--window must be at least 1 and --sinks at least 0")
    return CacheSettings(
        method=method, budget=args.budget, window=args.window, sinks=args.sinks, batch=args.batch,
        params=method_params(args, method), seed=args.seed, prefill_mode=args.prefill,
    )


def sampling_settings(args: argparse.Namespace):
    from .engine import SamplingSettings

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    return SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)


def read_document(path: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--file {path}: no such file")
    if p.stat().st_size > MAX_DOCUMENT_BYTES:
        raise UserError(f"--file {path}: larger than {MAX_DOCUMENT_BYTES >> 20} MB; split it")
    data = p.read_bytes()
    if b"\x00" in data[:8192]:
        raise UserError(f"--file {path}: not a text file (binary content); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--file {path}: not UTF-8 text; convert it first") from None


def open_store(args: argparse.Namespace):
    from .store import Store, default_db_path

    return Store(args.db or default_db_path())


def load_engine(args: argparse.Namespace):
    from .engine import Engine
    from .models import load_model

    return Engine(load_model(args.model, device=args.device, dtype=args.dtype, quant=args.quant))


# -- commands --------------------------------------------------------------------------
def cmd_ask(args: argparse.Namespace) -> int:
    from . import persist

    document = read_document(args.file) if args.file else None
    sampling = sampling_settings(args)
    settings = cache_settings(args)
    store = None if args.no_save else open_store(args)
    if args.session is not None and store is None:
        raise UserError("--session needs the database; drop --no-save")
    engine = load_engine(args)
    text = persist_text = engine_text(document, args.question)
    if args.session is not None:
        try:
            session, _ = persist.resume(store, engine, args.session)
        except persist.SnapshotMismatch as err:
            session, _ = persist.rebuild(store, engine, args.session, settings, reason=str(err))
        session_id = args.session
    else:
        session = engine.new_session(settings)
        session_id = None
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    streamed = not args.json and sys.stdout.isatty()
    try:
        result = session.send(
            text, sampling, on_token=(lambda piece: print(piece, end="", flush=True)) if streamed else None,
            cancel=cancel,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    if store is not None:
        if session_id is None:
            session_id = persist.new_session_row(store, session, persist.title_for(args.question))
        persist.save_turn(store, session_id, session, persist_text, result)
    m = result.metrics
    if args.json:
        print(json.dumps({
            "answer": result.text, "prompt_tokens": m.prompt_tokens, "new_tokens": m.new_tokens,
            "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(m.decode_tokens_per_s, 2), "ttft_s": round(m.ttft_s, 4),
            "kv_bytes": m.kv_bytes, "full_kv_bytes": m.full_kv_bytes, "rss_bytes": m.rss_bytes,
            "cuda_bytes": m.cuda_bytes, "method": session.cache.method, "budget": str(session.cache.budget),
            "model": engine.loaded.name, "session": session_id, "stop_reason": result.stop_reason,
            "prefill_mode": m.prefill_mode, "tokens_seen": m.tokens_seen,
        }))
    elif streamed:
        print()
    else:
        print(result.text)
    return 130 if result.cancelled else 0


def engine_text(document: str | None, question: str) -> str:
    from .engine import ChatSession

    return ChatSession.user_message(question, document)


def cmd_sessions(args: argparse.Namespace) -> int:
    store = open_store(args)
    if args.action == "list":
        rows = store.list_sessions()
        if not rows:
            print("no saved sessions yet; `kvchat` or `kvchat ask` creates one")
        for r in rows:
            print(f"{r.id:>4}  {r.updated[:16].replace('T', ' ')}  {r.method:<9} {r.tokens:>7,} tok  {r.message_count:>3} msg  {r.title}")
    elif args.action == "show":
        print(store.export_session(args.id, "md"))
    elif args.action == "export":
        print(store.export_session(args.id, args.format))
    elif args.action == "delete":
        title = store.get_session(args.id).title
        store.delete_session(args.id)
        print(f"deleted session {args.id} ({title})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run(args)


def cmd_app(args: argparse.Namespace) -> int:
    settings = cache_settings(args)
    sampling = sampling_settings(args)
    store = open_store(args)
    if args.resume is not None:
        store.get_session(args.resume)
    engine = load_engine(args)
    try:
        from .tui.app import run_app
    except ImportError:
        return line_chat(engine, store, settings, sampling)
    run_app(engine, store, settings, sampling, args.resume)
    return 0


def line_chat(engine, store, settings, sampling) -> int:
    """A plain line chat (used when the Textual app is unavailable)."""
    from . import persist

    session = engine.new_session(settings)
    session_id = None
    print(f"kvchat {__version__} · {engine.loaded.name} · method {settings.method} · Ctrl+D to quit")
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        if not text.strip():
            continue
        cancel = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
        try:
            result = session.send(text, sampling, on_token=lambda p: print(p, end="", flush=True), cancel=cancel)
        finally:
            signal.signal(signal.SIGINT, previous)
        m = result.metrics
        print(f"\n  [{m.decode_tokens_per_s:.1f} tok/s · KV {m.kv_bytes / 2**20:.1f} MB · {m.tokens_seen:,} tokens seen]")
        if session_id is None:
            session_id = persist.new_session_row(store, session, persist.title_for(text))
        persist.save_turn(store, session_id, session, text, result)


def main(argv: list[str] | None = None) -> int:
    from .models import ModelError
    from .store import StoreError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "ask":
            return cmd_ask(args)
        if args.command == "sessions":
            return cmd_sessions(args)
        if args.command == "bench":
            return cmd_bench(args)
        return cmd_app(args)
    except (UserError, ModelError, StoreError, ValueError) as err:
        print(f"kvchat: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and friends: stop quietly.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0


if __name__ == "__main__":
    sys.exit(main())
