"""The `kvchat` parser: every command, its options and their defaults (built-in, then
the config file, then the command line). Errors are one line naming the cause and the way
out (`Parser.error`), exit code 2."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from kvchat import __version__

EXIT_USAGE = 2


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


def _disk_budget_type(text: str) -> int | None:
    """argparse `type` of `--disk-budget SIZE|off`: the settings' parse, argparse's error on failure."""
    from kvchat.settings import parse_disk_budget

    try:
        return parse_disk_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def builtin_defaults() -> dict[str, Any]:
    """Option defaults before the config file."""
    from kvchat.settings import DEFAULT_BATCH, DEFAULT_SINKS

    return {
        "model": None,
        "quant": None,
        "device": "auto",
        "dtype": "auto",
        "threads": None,
        "method": None,
        "budget": None,
        "window": None,
        "sinks": DEFAULT_SINKS,
        "batch": DEFAULT_BATCH,
        "prefill": "auto",
        "allocation": "auto",
        "max_new_tokens": 512,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "db": None,
        "system": None,
        "recall": None,  # None: the engine's default
        "disk_budget": None,  # None: no bound
    }


def method_names(hyperparameters: bool) -> list[str]:
    """The methods, for help texts: every registered one when the parser declares their
    hyperparameters (that imports them, and torch), else the built-in names."""
    from kvchat import compress

    return compress.available() if hyperparameters else list(compress.METHOD_MODULES)


def common_options(
    defaults: dict[str, Any],
    suppress: bool = False,
    hyperparameters: bool = True,
    recall: bool = True,
) -> Parser:
    """Options every command takes, with `defaults` (built-in + config file). Subcommand
    copies (`suppress`) leave unset options out of the namespace, so the top-level value
    (e.g. `kvchat --method h2o ask ...`) is kept. Without `hyperparameters`, the methods'
    own options (`--h2o-...`) are left out and no method is imported. Without `recall`,
    `--recall` is left out (`kvchat bench` has its own, a list of values)."""
    from kvchat.paths import sessions_db
    from kvchat.settings import (
        DEFAULT_BUDGET,
        DEFAULT_METHOD,
        DEFAULT_RECALL,
        DEFAULT_WINDOW,
        human_size,
    )

    d = defaults
    p = Parser(add_help=False, argument_default=argparse.SUPPRESS if suppress else None)
    if not suppress:
        # The config file's system prompt is kept apart, so that a --system given on
        # the command line can be told from it (see `system_choice`).
        p.set_defaults(**{**d, "system": None, "config_system": d.get("system")})

    def add(group, *flags: str, help: str, **kwargs: Any) -> None:
        group.add_argument(*flags, help=_help(help), **kwargs)

    model = p.add_argument_group("model")
    add(
        model,
        "--model",
        metavar="MODEL",
        help=(
            "a local HF model folder or GGUF file, a repo id in the Hugging Face cache (Org/Name[@REVISION]), "
            "ollama:NAME[:TAG] or lmstudio:PUBLISHER/REPO; `kvchat models` lists what is on this machine "
            f"(default: {d['model'] or 'embedded SmolLM2-135M-Instruct'})"
        ),
    )
    add(model, "--quant", choices=["4bit", "8bit"], help="load weights through bitsandbytes (pip install -e .[quant])")
    add(model, "--device", help=f"auto (CUDA when present), cpu or cuda (default {d['device']})")
    add(
        model,
        "--dtype",
        help=(
            "auto (a CPU with native bf16: int8 weights + bf16 compute, the fast path; other CPUs: float32; "
            f"GPU: bf16), int8, float32 (the exact path), bfloat16 or float16 (default {d['dtype']})"
        ),
    )
    add(
        model,
        "--threads",
        type=int,
        metavar="N",
        help=(
            "intra-op CPU threads (default: "
            f"{d['threads'] or 'the cores other processes leave free, re-checked as it runs; OMP_NUM_THREADS fixes it too'})"
        ),
    )
    cache = p.add_argument_group("KV cache (design: docs/design.md; methods: docs/methods.md)")
    add(
        cache,
        "--method",
        help=f"compression method: {', '.join(method_names(hyperparameters))} (default {d['method'] or DEFAULT_METHOD})",
    )
    add(
        cache,
        "--budget",
        help="middle entries per KV head (e.g. 1024), total share of tokens seen "
        "(e.g. 25%) or the whole KV cache in bytes (e.g. 64MB, 64MiB, 1GB; MB = 10^6 bytes, MiB = 2^20) "
        f"(default {d['budget'] or DEFAULT_BUDGET})",
    )
    add(
        cache,
        "--allocation",
        choices=["auto", "uniform"],
        help=(
            "how a budget in bytes is shared across layers: auto = by how much each layer's attention output "
            "suffers when its middle is cut (measured once per model), "
            f"uniform = evenly (default {d['allocation']})"
        ),
    )
    add(
        cache,
        "--window",
        type=int,
        help=(
            f"exact recent tokens per KV head (default {d['window'] or DEFAULT_WINDOW}; a share budget (25%) shrinks it "
            "so that sinks and window take at most half of the budget, and so does a budget in bytes unless --window "
            "is given here or in the config file)"
        ),
    )
    add(cache, "--sinks", type=int, help=f"exact first tokens (attention sinks, default {d['sinks']})")
    add(cache, "--batch", type=int, help=f"tokens leaving the window per compressor call (default {d['batch']})")
    add(
        cache,
        "--prefill",
        choices=["auto", "exact-then-compress", "streaming"],
        help=f"how long input is prefilled (default {d['prefill']})",
    )
    if recall:
        add(
            cache,
            "--recall",
            metavar="N|off",
            type=_recall_type,
            help=(
                "the recall tier: every token leaving the window is kept on disk (8-bit keys, 4-bit values), and each step attends to the "
                "N cold tokens per KV head its query ranks highest (default "
                + (
                    f"{d['recall'] or 'off'})"
                    if d["recall"] is not None
                    else f"{DEFAULT_RECALL} on a CPU with kvchat's ranking kernel, else off)"
                )
            ),
        )
    gen = p.add_argument_group("generation")
    add(gen, "--max-new-tokens", type=int, help=f"most tokens in an answer (default {d['max_new_tokens']})")
    add(gen, "--temperature", type=float, help=f"0 = greedy (default {d['temperature']})")
    add(gen, "--top-p", type=float, help=f"nucleus sampling mass (default {d['top_p']})")
    add(gen, "--seed", type=int, help=f"sampling and compressor seed (default {d['seed']})")
    add(
        gen,
        "--system",
        metavar="TEXT",
        help=(
            'the system prompt of a new session (a saved one keeps its own unless --system is given; "" = '
            f"the model's default) (default: {'the config file' if d.get('system') else 'the chat template'}'s)"
        ),
    )
    store = p.add_argument_group("sessions")
    add(store, "--db", metavar="PATH", help=f"session database (default: $KVCHAT_DB or {sessions_db()})")
    add(
        store,
        "--disk-budget",
        metavar="SIZE|off",
        type=_disk_budget_type,
        help=(
            "the disk the saved sessions may take (e.g. 2GB); after a save past it, the recall tiers of the "
            "least recently used other sessions are dropped (their transcripts and caches stay) (default "
            f"{human_size(d['disk_budget']) if d['disk_budget'] else 'off'})"
        ),
    )
    if not hyperparameters:
        return p
    from kvchat.compress import get

    params = p.add_argument_group("method hyperparameters (defaults and their sources: README, docs/methods.md)")
    for method in method_names(hyperparameters):
        for param in get(method).hyperparameters:
            params.add_argument(
                param.flag(method),
                dest=f"mp__{method}__{param.name}",
                metavar="V",
                type=_method_param_type(param, method),
                help=_help(param.help_line()),
            )
    return p


def store_options(defaults: dict[str, Any]) -> Parser:
    """The one option of the `sessions` actions that never load a model: the database."""
    from kvchat.paths import sessions_db

    p = Parser(add_help=False, argument_default=argparse.SUPPRESS)
    p.add_argument_group("sessions").add_argument(
        "--db", metavar="PATH", help=_help(f"session database (default: $KVCHAT_DB or {sessions_db()})")
    )
    return p


class VersionAction(argparse.Action):
    """`--version`: kvchat's version and which of its compiled kernels run here."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        from kvchat import native

        print(f"kvchat {__version__}\nkernels:\n{native.describe_status()}")
        parser.exit(0)


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


FILE_HELP = (
    "a document put before the question: text, Markdown or code, PDF, HTML, Word (.docx) or EPUB (those four "
    "need the docs extra); a folder gives its readable files in name order; repeat for several, in order"
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
        epilog='Examples:\n  kvchat\n  kvchat ask "What is the capital of France?"\n'
        '  kvchat ask "What does it say about X?" --file paper.txt --method chelsea --budget 25%\n'
        '  kvchat compare "What is it about?" --file paper.txt --methods window,h2o,chelsea\n'
        "  kvchat sessions list\n  kvchat models\n  kvchat --resume 3\n\n" + config_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=VersionAction, help="kvchat's version and which compiled kernels run")
    parser.add_argument("--resume", type=int, metavar="ID", help="open a saved session in the app")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ask = sub.add_parser("ask", parents=[common], help="one non-interactive turn; prints the answer")
    ask.add_argument("question")
    ask.add_argument("--file", metavar="DOC", action="append", help=FILE_HELP)
    ask.add_argument("--json", action="store_true", help="print one JSON object (answer + metrics)")
    ask.add_argument("--session", type=int, metavar="ID", help="continue a saved session")
    ask.add_argument("--no-save", action="store_true", help="do not save the turn as a session")

    compare = sub.add_parser(
        "compare",
        parents=[common],
        help="one question under several methods, side by side (nothing is saved)",
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
    compare.add_argument("--file", metavar="DOC", action="append", help=FILE_HELP)
    compare.add_argument(
        "--methods",
        metavar="A,B,C",
        help=f"comma-separated methods (default: all: {','.join(method_names(hyperparameters))})",
    )
    compare.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of {method, answer, kv_bytes, ttft_s, decode_tokens_per_s}",
    )

    # Only `branch` may load the model (to rebuild a cache): the other actions take --db alone.
    store_only = store_options(defaults)
    sessions = sub.add_parser(
        "sessions", parents=[store_only], help="list, search, show, export, branch or delete saved sessions"
    )
    ss = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    ss.add_parser("list", parents=[store_only], help="saved sessions, newest first")
    found = ss.add_parser(
        "search", parents=[store_only], help="sessions whose messages contain every word, newest first"
    )
    found.add_argument(
        "text",
        nargs="+",
        help="plain words, not a query language; the last one also matches longer "
        "words (put -- before text that starts with -)",
    )
    found.add_argument("--limit", type=int, default=50, metavar="N", help="at most N sessions (default 50)")
    for action, text in (("show", "a session's transcript"), ("delete", "delete a session")):
        sp = ss.add_parser(action, parents=[store_only], help=text)
        sp.add_argument("id", type=int)
        if action == "show":
            sp.add_argument(
                "--memory",
                action="store_true",
                help="instead, the memory map: the share of each message (and document) the saved "
                "cache still represents",
            )
            sp.add_argument("--layers", action="store_true", help="with --memory: the share per layer too")
    ex = ss.add_parser("export", parents=[store_only], help="export a session")
    ex.add_argument("id", type=int)
    ex.add_argument("--format", choices=["md", "json"], default="md", help="md (default) or json")
    br = ss.add_parser(
        "branch",
        parents=[common],
        help="a new session sharing a session's first N turns",
        description="Make a new session that shares the first N turns of session ID (a turn is one "
        "of your messages and its answer, counted from 1 in transcript order; 0 = none). The "
        "original stays as saved. The branch's cache is a copy of the saved one when N is the last "
        "turn, else it is rebuilt from the transcript (the model loads; Ctrl+C stops and makes no "
        "branch). Continue it with `kvchat ask --session NEW` or `kvchat --resume NEW`.",
    )
    br.add_argument("id", type=int)
    br.add_argument("--at", type=int, required=True, metavar="N", help="turns shared with the original")

    models = sub.add_parser(
        "models",
        help="the models on this machine, by the name --model takes",
        description="List the models already on this machine, offline, from their headers: the embedded "
        "model, the Hugging Face hub cache, Ollama and LM Studio. Each row gives the name to pass to --model, "
        "the family (model_type), the size on disk, and why kvchat cannot run it where it cannot.",
    )
    models.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: models (model, name, source, path, family, bytes, size, supported, "
        "why_not), skipped, looked_in",
    )

    from kvchat.paths import data_home

    # Its own --recall is a list (rows side by side), so the common one is left out here;
    # a --recall N given before `bench` still sets the cache's (args.recall).
    bench_common = common_options(defaults, suppress=True, hyperparameters=hyperparameters, recall=False)
    bench = sub.add_parser(
        "bench",
        parents=[bench_common],
        help="benchmarks: speed, attention, recall, resume, "
        "fidelity; summary: docs/benchmarks.md from the latest reports",
    )
    bench.add_argument("suite", choices=["speed", "attention", "recall", "resume", "fidelity", "summary"])
    bench.add_argument(
        "--out",
        help="folder for the JSON, markdown and PNG reports (default "
        f"{data_home() / 'bench-out'}; summary: the folder it reads, default docs/bench)",
    )
    bench.add_argument("--quick", action="store_true", help="a smaller grid (smoke runs)")
    bench.add_argument("--lengths", help="comma-separated context lengths (speed, recall, resume)")
    bench.add_argument(
        "--contexts", help="speed: comma-separated contexts of the methods part (default 256,2048,6144,8192)"
    )
    bench.add_argument("--skip-loop", action="store_true", help="speed: skip the start-up part (a whole process)")
    bench.add_argument(
        "--parts",
        help="speed: comma-separated parts, start,methods,mass,threads,agreement (default "
        "all), kernels (methods with the compiled kernels on and off); fidelity: "
        "budgets,allocation,fluency (default all)",
    )
    bench.add_argument("--tasks", help="recall: comma-separated tasks, needle and/or lines (default both)")
    bench.add_argument(
        "--recall",
        dest="recall_values",
        metavar="N,M",
        help="recall: comma-separated cold tokens "
        "recalled per KV head and step, each a row per method side by side (0 = without the recall "
        "tier; default 0)",
    )
    bench.add_argument("--methods", help="comma-separated methods (default: all)")
    return parser
