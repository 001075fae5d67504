"""Command line: `kvchat` (the app), `kvchat ask`, `kvchat compare`, `kvchat sessions ...`, `kvchat bench ...`.

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
from typing import Any, NoReturn

from kvchat import __version__

EXIT_USAGE = 2
MAX_DOCUMENT_BYTES = 64 << 20


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


class Parser(argparse.ArgumentParser):
    """argparse with kvchat's error style: one line naming the cause and the way out."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"kvchat: error: {message} (see `{self.prog} --help`)\n")


# -- options -------------------------------------------------------------------------
# Help texts hold no %(default)s: subcommand copies of the options carry SUPPRESS defaults
# (so an option given before the subcommand survives), and argparse cannot expand
# %(default)s for those. Each default is written into its help text instead.
def _help(text: str) -> str:
    return text.replace("%", "%%")


def _method_param_type(param, method: str):
    """argparse `type` for one declared hyperparameter: parse + check, argparse's error on failure."""

    def convert(text: str):
        try:
            return param.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{method}: ")) from None

    convert.__name__ = param.flag(method)
    return convert


def _recall_type(text: str) -> int:
    """argparse `type` of `--recall N|off`: the settings' parse, argparse's error on failure."""
    from kvchat.settings import parse_recall

    try:
        return parse_recall(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def builtin_defaults() -> dict[str, Any]:
    """Option defaults before the config file."""
    from kvchat.settings import DEFAULT_BATCH, DEFAULT_SINKS

    return {
        "model": None, "quant": None, "device": "auto", "dtype": "auto", "threads": None,
        "method": None, "budget": None, "window": None, "sinks": DEFAULT_SINKS,
        "batch": DEFAULT_BATCH, "prefill": "auto", "allocation": "auto", "max_new_tokens": 512, "temperature": 0.0,
        "top_p": 1.0, "seed": 0, "db": None, "system": None, "recall": None,  # None: the engine's default
    }


def method_names(hyperparameters: bool) -> list[str]:
    """The methods, for help texts: every registered one when the parser declares their
    hyperparameters (that imports them, and torch), else the built-in names."""
    from kvchat import compress

    return compress.available() if hyperparameters else list(compress.METHOD_MODULES)


def common_options(
    defaults: dict[str, Any], suppress: bool = False, hyperparameters: bool = True, recall: bool = True,
) -> argparse.ArgumentParser:
    """Options every command takes, with `defaults` (built-in + config file). Subcommand
    copies (`suppress`) leave unset options out of the namespace, so the top-level value
    (e.g. `kvchat --method h2o ask ...`) is kept. Without `hyperparameters`, the methods'
    own options (`--h2o-...`) are left out and no method is imported. Without `recall`,
    `--recall` is left out (`kvchat bench` has its own, a list of values)."""
    from kvchat.paths import sessions_db
    from kvchat.settings import DEFAULT_BUDGET, DEFAULT_METHOD, DEFAULT_RECALL, DEFAULT_WINDOW

    d = defaults
    p = Parser(add_help=False, argument_default=argparse.SUPPRESS if suppress else None)
    if not suppress:
        # The config file's system prompt is kept apart, so that a --system given on
        # the command line can be told from it (see `system_choice`).
        p.set_defaults(**{**d, "system": None, "config_system": d.get("system")})

    def add(group, *flags: str, help: str, **kwargs: Any) -> None:
        group.add_argument(*flags, help=_help(help), **kwargs)

    model = p.add_argument_group("model")
    add(model, "--model", metavar="PATH",
        help=f"local HF model folder or .gguf file (default: {d['model'] or 'embedded SmolLM2-135M-Instruct'})")
    add(model, "--quant", choices=["4bit", "8bit"], help="load weights through bitsandbytes (pip install -e .[quant])")
    add(model, "--device", help=f"auto (CUDA when present), cpu or cuda (default {d['device']})")
    add(model, "--dtype", help=(
        "auto (a CPU with native bf16: int8 weights + bf16 compute, the fast path; other CPUs: float32; "
        f"GPU: bf16), int8, float32 (the exact path), bfloat16 or float16 (default {d['dtype']})"))
    add(model, "--threads", type=int, metavar="N", help=(
        "intra-op CPU threads (default: "
        f"{d['threads'] or 'the cores other processes leave free, re-checked as it runs; OMP_NUM_THREADS fixes it too'})"))
    cache = p.add_argument_group("KV cache (design: docs/design.md; methods: docs/methods.md)")
    add(cache, "--method", help=f"compression method: {', '.join(method_names(hyperparameters))} (default {d['method'] or DEFAULT_METHOD})")
    add(cache, "--budget", help="middle entries per KV head (e.g. 1024), total share of tokens seen "
        "(e.g. 25%) or the whole KV cache in bytes (e.g. 64MB, 64MiB, 1GB; MB = 10^6 bytes, MiB = 2^20) "
        f"(default {d['budget'] or DEFAULT_BUDGET})")
    add(cache, "--allocation", choices=["auto", "uniform"], help=(
        "how a budget in bytes is shared across layers: auto = by how much each layer's attention output "
        "suffers when its middle is cut (measured once per model), "
        f"uniform = evenly (default {d['allocation']})"))
    add(cache, "--window", type=int, help=(
        f"exact recent tokens per KV head (default {d['window'] or DEFAULT_WINDOW}; a share budget (25%) shrinks it "
        "so that sinks and window take at most half of the budget, and so does a budget in bytes unless --window "
        "is given here or in the config file)"))
    add(cache, "--sinks", type=int, help=f"exact first tokens (attention sinks, default {d['sinks']})")
    add(cache, "--batch", type=int, help=f"tokens leaving the window per compressor call (default {d['batch']})")
    add(cache, "--prefill", choices=["auto", "exact-then-compress", "streaming"],
        help=f"how long input is prefilled (default {d['prefill']})")
    if recall:
        add(cache, "--recall", metavar="N|off", type=_recall_type, help=(
            "the recall tier: every token leaving the window is kept exact on disk, and each step attends to the "
            "N cold tokens per KV head its query ranks highest (default " + (f"{d['recall'] or 'off'})" if d["recall"]
            is not None else f"{DEFAULT_RECALL} on a CPU with kvchat's ranking kernel, else off)")))
    gen = p.add_argument_group("generation")
    add(gen, "--max-new-tokens", type=int, help=f"most tokens in an answer (default {d['max_new_tokens']})")
    add(gen, "--temperature", type=float, help=f"0 = greedy (default {d['temperature']})")
    add(gen, "--top-p", type=float, help=f"nucleus sampling mass (default {d['top_p']})")
    add(gen, "--seed", type=int, help=f"sampling and compressor seed (default {d['seed']})")
    add(gen, "--system", metavar="TEXT", help=(
        "the system prompt of a new session (a saved one keeps its own unless --system is given; \"\" = "
        f"the model's default) (default: {'the config file' if d.get('system') else 'the chat template'}'s)"))
    store = p.add_argument_group("sessions")
    add(store, "--db", metavar="PATH", help=f"session database (default: $KVCHAT_DB or {sessions_db()})")
    if not hyperparameters:
        return p
    from kvchat.compress import get

    params = p.add_argument_group("method hyperparameters (defaults and their sources: README, docs/methods.md)")
    for method in method_names(hyperparameters):
        for param in get(method).hyperparameters:
            params.add_argument(
                param.flag(method), dest=f"mp__{method}__{param.name}", metavar="V",
                type=_method_param_type(param, method), help=_help(param.help_line()),
            )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line. The methods' own options (`--h2o-...`) come from their
    declarations, which means importing every method and torch (a second or more): the
    parser declares them only when the command line names one, or asks for help, so
    that the app's first frame does not wait for torch."""
    from kvchat.compress import METHOD_MODULES

    method_flags = tuple(f"--{name}-" for name in METHOD_MODULES)
    wanted = any(a in ("-h", "--help") or a.startswith(method_flags) for a in argv)
    return build_parser(hyperparameters=wanted).parse_args(argv)


def config_epilog() -> str:
    from kvchat.paths import config_path, data_home
    from kvchat.settings import CONFIG_KEYS

    return (
        f"Data home: {data_home()} (set KVCHAT_HOME to move it; sessions/ and models/ live there).\n"
        f"Config file: {config_path()} (TOML; set KVCHAT_CONFIG to use another).\n"
        f"  keys: {', '.join(CONFIG_KEYS)}; the command line overrides them, e.g.\n"
        '    method = "h2o"\n    budget = "25%"\n    threads = 4'
    )


def build_parser(config: dict[str, Any] | None = None, hyperparameters: bool = True) -> argparse.ArgumentParser:
    """The `kvchat` parser; option defaults come from `config` (default: the config file).
    `hyperparameters` False leaves out the methods' own options (see `parse_args`)."""
    from kvchat.settings import read_config

    defaults = {**builtin_defaults(), **(read_config() if config is None else config)}
    common = common_options(defaults, suppress=True, hyperparameters=hyperparameters)
    parser = Parser(
        prog="kvchat",
        parents=[common_options(defaults, hyperparameters=hyperparameters)],
        description=(
            "Chat with a local LLM in your terminal. The KV cache stays small however long the "
            "conversation gets: exact first tokens + exact recent window + a compressed middle. "
            "Run without a command to open the chat app."
        ),
        epilog="Examples:\n  kvchat\n  kvchat ask \"What is the capital of France?\"\n"
        "  kvchat ask \"What does it say about X?\" --file paper.txt --method chelsea --budget 25%\n"
        "  kvchat compare \"What is it about?\" --file paper.txt --methods window,h2o,chelsea\n"
        "  kvchat sessions list\n  kvchat --resume 3\n\n" + config_epilog(),
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

    compare = sub.add_parser(
        "compare", parents=[common], help="one question under several methods, side by side (nothing is saved)",
        description=(
            "Answer one question under several compression methods: the question (and --file) is read once, "
            "exactly, and that prefill is forked to each method, which compresses it its own way and answers. "
            "Prints a table: method, KV MB, time to first token, decode tok/s and the answer. Nothing is saved "
            "to the session database. The time to first token counts the shared prefill, the method's "
            "compression of it and its first token. When the input is too big for one exact prefill, each "
            "method reads it by itself (streaming) and a note says so. Ctrl+C stops and prints what was done."
        ),
    )
    compare.add_argument("question")
    compare.add_argument("--file", metavar="DOC", help="a text document put before the question")
    compare.add_argument("--methods", metavar="A,B,C",
                         help=f"comma-separated methods (default: all: {','.join(method_names(hyperparameters))})")
    compare.add_argument("--json", action="store_true",
                         help="print a JSON list of {method, answer, kv_bytes, ttft_s, decode_tokens_per_s}")

    sessions = sub.add_parser("sessions", parents=[common],
                              help="list, search, show, export, branch or delete saved sessions")
    ss = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    ss.add_parser("list", parents=[common], help="saved sessions, newest first")
    found = ss.add_parser("search", parents=[common], help="sessions whose messages contain every word, newest first")
    found.add_argument("text", nargs="+", help="plain words, not a query language; the last one also matches longer "
                                               "words (put -- before text that starts with -)")
    found.add_argument("--limit", type=int, default=50, metavar="N", help="at most N sessions (default 50)")
    for action, text in (("show", "a session's transcript"), ("delete", "delete a session")):
        sp = ss.add_parser(action, parents=[common], help=text)
        sp.add_argument("id", type=int)
        if action == "show":
            sp.add_argument("--memory", action="store_true",
                            help="instead, the memory map: the share of each message (and document) the saved "
                                 "cache still represents")
            sp.add_argument("--layers", action="store_true", help="with --memory: the share per layer too")
    ex = ss.add_parser("export", parents=[common], help="export a session")
    ex.add_argument("id", type=int)
    ex.add_argument("--format", choices=["md", "json"], default="md", help="md (default) or json")
    br = ss.add_parser("branch", parents=[common], help="a new session sharing a session's first N turns",
                       description="Make a new session that shares the first N turns of session ID (a turn is one "
                       "of your messages and its answer, counted from 1 in transcript order; 0 = none). The "
                       "original stays as saved. The branch's cache is a copy of the saved one when N is the last "
                       "turn, else it is rebuilt from the transcript (the model loads; Ctrl+C stops and makes no "
                       "branch). Continue it with `kvchat ask --session NEW` or `kvchat --resume NEW`.")
    br.add_argument("id", type=int)
    br.add_argument("--at", type=int, required=True, metavar="N", help="turns shared with the original")

    from kvchat.paths import data_home

    # Its own --recall is a list (rows side by side), so the common one is left out here;
    # a --recall N given before `bench` still sets the cache's (args.recall).
    bench_common = common_options(defaults, suppress=True, hyperparameters=hyperparameters, recall=False)
    bench = sub.add_parser("bench", parents=[bench_common], help="benchmarks: speed, attention, recall, resume, "
                           "fidelity; summary: docs/benchmarks.md from the latest reports")
    bench.add_argument("suite", choices=["speed", "attention", "recall", "resume", "fidelity", "summary"])
    bench.add_argument("--out", help="folder for the JSON, markdown and PNG reports (default "
                       f"{data_home() / 'bench-out'}; summary: the folder it reads, default docs/bench)")
    bench.add_argument("--quick", action="store_true", help="a smaller grid (smoke runs)")
    bench.add_argument("--lengths", help="comma-separated context lengths (speed, recall, resume)")
    bench.add_argument("--contexts", help="speed: comma-separated contexts of the methods part (default "
                       "256,2048,6144,8192)")
    bench.add_argument("--skip-loop", action="store_true", help="speed: skip the start-up part (a whole process)")
    bench.add_argument("--parts", help="speed: comma-separated parts, start,methods,mass,threads,agreement (default "
                       "all), kernels (methods with the compiled kernels on and off); fidelity: "
                       "budgets,allocation,fluency (default all)")
    bench.add_argument("--tasks", help="recall: comma-separated tasks, needle and/or lines (default both)")
    bench.add_argument("--recall", dest="recall_values", metavar="N,M", help="recall: comma-separated cold tokens "
                       "recalled per KV head and step, each a row per method side by side (0 = without the recall "
                       "tier; default 0)")
    bench.add_argument("--methods", help="comma-separated methods (default: all)")
    return parser


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
    from kvchat.settings import DEFAULT_WINDOW, CacheOptions  # `recall`: when none was given (None: the engine's)

    return CacheOptions(
        method=args.method, budget=None if args.budget is None else str(args.budget),
        window=DEFAULT_WINDOW if args.window is None else args.window, window_given=args.window is not None,
        sinks=args.sinks, batch=args.batch, prefill=args.prefill, seed=args.seed, allocation=args.allocation,
        recall=recall if args.recall is None else args.recall, method_params=method_params(args),
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
        suite=args.suite, model=model_options(args), cache=cache_options(args, recall=0), quick=args.quick,
        lengths=int_list(args.lengths, "--lengths"), contexts=int_list(args.contexts, "--contexts"),
        skip_loop=args.skip_loop, tasks=name_list(args.tasks), methods=name_list(args.methods),
        parts=name_list(args.parts), recall=int_list(args.recall_values, "--recall"), **extra,
    )


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
    from kvchat.storage.db import Store, default_db_path

    return Store(args.db or default_db_path())


def load_engine(args: argparse.Namespace, on_status=None):
    from kvchat.model.engine import load_engine as load

    return load(model_options(args), on_status)


# -- commands --------------------------------------------------------------------------
def cmd_ask(args: argparse.Namespace) -> int:
    document = read_document(args.file) if args.file else None
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
    chat = Controller(load_engine(args), store, cache_settings(args), sampling_settings(args), system=system)
    if args.session is not None:
        chat.open_saved(args.session)  # a snapshot from another model is rebuilt from the transcript
        if given:  # the saved session's own prompt, unless --system says otherwise: read again under it
            chat.set_system(system)
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    streamed = not args.json and sys.stdout.isatty()
    try:
        outcome = chat.send(
            args.question, document, on_token=(lambda piece: print(piece, end="", flush=True)) if streamed else None,
            cancel=cancel,
        )
    except InputTooLong as err:
        raise UserError(err.message("document", "a shorter file") if document else err.message("question")) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    result, m = outcome.result, outcome.result.metrics
    if args.json:
        about = chat.describe()
        print(json.dumps({
            "answer": result.text, "prompt_tokens": m.prompt_tokens, "new_tokens": m.new_tokens,
            "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(m.decode_tokens_per_s, 2), "ttft_s": round(m.ttft_s, 4),
            "kv_bytes": m.kv_bytes, "full_kv_bytes": m.full_kv_bytes, "rss_bytes": m.rss_bytes,
            "cuda_bytes": m.cuda_bytes, "cold_bytes": m.cold_bytes, "recalled": round(m.recalled, 2),
            "recall": about["recall"], "method": about["method"], "budget": about["budget"],
            "model": about["model"], "precision": about["precision"], "session": about["session"],
            "system": about["system"],
            "stop_reason": result.stop_reason, "prefill_mode": m.prefill_mode, "tokens_seen": m.tokens_seen,
            "memory": about["memory"],
        }))
    elif streamed:
        print()
    else:
        print(result.text)
    if outcome.save_error is not None:  # the answer above stands; the turn was not saved
        raise outcome.save_error
    return 130 if result.cancelled else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kvchat.chat import compare
    from kvchat import compress
    from kvchat.chat.controller import Controller
    from kvchat.errors import InputTooLong
    from kvchat.settings import name_list

    # Checked before the model loads: a typo costs no waiting.
    methods = compare.check_methods(compress.available() if args.methods is None else name_list(args.methods) or [])
    document = read_document(args.file) if args.file else None
    chat = Controller(load_engine(args), None, cache_settings(args), sampling_settings(args), method_params(args),
                      system=system_choice(args)[0])
    chatty = not args.json  # progress on stderr; the table alone goes to stdout

    def started(method: str) -> None:
        if chatty:
            print(f"kvchat: answering under {method} ({methods.index(method) + 1}/{len(methods)})…",
                  file=sys.stderr, flush=True)

    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        result = chat.compare(methods, question=args.question, document=document, on_start=started, cancel=cancel,
                              keep_sessions=False)
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
        lines.append(f"{a.method:<10} {a.kv_bytes / 2**20:>7.2f} {a.ttft_s:>7.2f} {a.decode_tokens_per_s:>6.1f}  "
                     + wrapped[0])
        lines += [" " * len(head) + rest for rest in wrapped[1:]]
    if result.prefill_mode == "exact-then-compress":
        lines += textwrap.wrap(f"one exact prefill of {result.prompt_tokens:,} tokens ({result.prefill_s:.2f} s), "
                               "forked to each method; TTFT = that prefill + the method's compression of it + its "
                               "first token", min(width, 100))
    if result.note:
        lines += textwrap.wrap(f"note: {result.note}", min(width, 100))
    return "\n".join(lines)


def cmd_sessions(args: argparse.Namespace) -> int:
    store = open_store(args)
    if args.action == "list":
        rows = store.list_sessions()
        if not rows:
            print("no saved sessions yet; `kvchat` or `kvchat ask` creates one")
        for r in rows:
            origin = f"  ({r.origin()})" if r.origin() else ""
            print(f"{r.id:>4}  {r.updated[:16].replace('T', ' ')}  {r.method:<9} {r.tokens:>7,} tok  {r.message_count:>3} msg  {r.title}{origin}")
    elif args.action == "search":
        print(search_lines(store, " ".join(args.text), args.limit))
    elif args.action == "show" and args.memory:
        print(memory_table(store, args.id, args.layers))
    elif args.action == "show":
        from kvchat.chat.persist import system_from_meta

        system = system_from_meta(store.get_session(args.id).params)
        if system:
            print(f"system: {system}")
        print(store.export_session(args.id, "md"))
    elif args.action == "export":
        print(store.export_session(args.id, args.format))
    elif args.action == "branch":
        return cmd_branch(args, store)
    elif args.action == "delete":
        title = store.get_session(args.id).title
        store.delete_session(args.id)
        print(f"deleted session {args.id} ({title})")
    return 0


def cmd_branch(args: argparse.Namespace, store) -> int:
    """`kvchat sessions branch ID --at N`: prints the new session's id and how its cache
    was obtained. The model is loaded only when the cache must be rebuilt; Ctrl+C stops
    the rebuild, and then no branch is left behind."""
    from kvchat.chat.controller import Controller
    from kvchat.errors import Cancelled

    chat = Controller(lambda: load_engine(args), store, cache_settings(args), sampling_settings(args))
    shown: list[int] = []  # progress printed on a terminal: a line to end

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            shown.append(done)
            print(f"\rkvchat: rebuilding the branch's cache: {done:,} / {total:,} tokens", end="", file=sys.stderr,
                  flush=True)

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

    title = store.get_session(session_id).title
    meta = store.snapshot_meta(session_id)
    memory = (meta or {}).get("memory")
    if memory is None:
        raise UserError(
            f"session {session_id} has no saved memory map (saved by an older kvchat or never answered); "
            f"continue it once (`kvchat ask --session {session_id} ...` or `kvchat --resume {session_id}`) to record one"
        )
    return "\n".join([f"session {session_id}: {title}"] + memory_lines(memory, layers))


def cmd_bench(args: argparse.Namespace) -> int:
    from kvchat import bench

    if args.suite == "summary":
        from kvchat.bench import summary

        return summary.main([] if args.out is None else ["--bench", args.out])
    return bench.run(bench_options(args))


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
            return line_chat(load_engine(args), store, settings, sampling, system)
        # The app draws its first frame at once and calls the loader in a worker.
        # The loader's one-off notes (the first start's conversion) go to the status bar.
        run_app(lambda on_status: load_engine(args, on_status), store, settings, sampling, args.resume,
                system=system)
    finally:
        store.close()  # the app's workers have finished: Textual's run waits for them
    return 0


def line_chat(engine, store, settings, sampling, system=None) -> int:
    """A plain line chat (used when the Textual app is unavailable)."""
    from kvchat.chat.controller import Controller

    chat = Controller(engine, store, settings, sampling, system=system)
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
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
        try:
            outcome = chat.send(text, on_token=lambda p: print(p, end="", flush=True), cancel=cancel)
        finally:
            signal.signal(signal.SIGINT, previous)
        m = outcome.result.metrics
        print(f"\n  [{m.decode_tokens_per_s:.1f} tok/s · KV {m.kv_bytes / 2**20:.1f} MB · {m.tokens_seen:,} tokens seen]")
        if outcome.save_error is not None:
            print(f"kvchat: not saved: {outcome.save_error}", file=sys.stderr)


def finished(code: int, own_process: bool) -> int:
    """The end of a command that loaded the model (`ask`, `compare`, the app), its output
    printed and its store closed. When the process is kvchat's own (not a caller's
    `main([...])`) and no thread Python would wait for runs, exit at once: the teardown of
    torch's, transformers' and Textual's objects does nothing the OS does not do, and took
    0.1-0.25 s after `ask`, 0.15-0.2 s after the app's Ctrl+Q (session 12)."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if not own_process or others:
        return code
    sys.stdout.flush()  # (a closed pipe raises here, and `main` stops quietly)
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    from kvchat.errors import ModelError, StoreError
    from kvchat.optional import INSTALL, MissingPackage

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.command == "ask":
            return finished(cmd_ask(args), own_process=argv is None)
        if args.command == "compare":
            return finished(cmd_compare(args), own_process=argv is None)
        if args.command == "sessions":
            return cmd_sessions(args)
        if args.command == "bench":
            return cmd_bench(args)
        return finished(cmd_app(args), own_process=argv is None)
    except (UserError, ModelError, StoreError, ValueError, MissingPackage) as err:
        print(f"kvchat: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top not in INSTALL:
            raise
        print(f"kvchat: error: {MissingPackage(top)}", file=sys.stderr)
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
