"""`kvchat bench recall`.

Two retrieval tasks through the real chat loop, every method at one budget (25% of the
tokens seen by default), greedy decoding:

- needle: "The special magic number is N." hidden in Paul Graham essay text at depths
  0.1 ... 0.9, then "What is the special magic number?";
- lines (LongEval): numbered lines `line <name>: REGISTER_CONTENT is <N>`, then the
  number of the line at that depth.

An answer is correct when the number appears in it. Each task runs in two settings:
"one message" (document and question in one user message: the compressor sees the
question while it compresses) and "two turns" (the document alone, a short reply, then
the question: question-agnostic compression, as in a real chat).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from ..cache import DEFAULT_BUDGET
from ..engine import CacheSettings, ChatSession, Engine, SamplingSettings
from . import report

DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK_DEPTHS = (0.1, 0.5, 0.9)
CONTEXTS = (1024, 2048, 3072)
QUICK_CONTEXTS = (1024,)
BUDGET = "25%"
ANSWER_TOKENS = 12
FIRST_REPLY_TOKENS = 8  # "two turns": the reply to the document alone
SETTINGS = ("one message", "two turns")
RNG_SEED = 1234

NEEDLE_QUESTION = "What is the special magic number? Answer with the number only."
# LongEval's own preamble (lines task), with the line format the brief fixes.
LINES_HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line name>' and "
    "contains a REGISTER_CONTENT at the end of the line as a numerical value. For each line name, memorize "
    "its corresponding REGISTER_CONTENT. At the end of the record, I will ask you to retrieve the "
    "REGISTER_CONTENT of a certain line. Now the record starts:\n\n"
)
ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
              "keen", "lucky", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
              "urban", "vivid", "windy", "young", "zesty")
NOUNS = ("anchor", "badger", "candle", "delta", "ember", "falcon", "garden", "harbor", "island",
         "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river",
         "saddle", "tunnel", "valley", "walnut", "yonder", "zephyr")


@dataclass
class Probe:
    """One document with one hidden fact and the question that asks for it."""

    task: str
    context: int
    depth: float
    document: str
    question: str
    answer: int


def fit_tokens(engine: Engine, text: str, tokens: int) -> str:
    """The first `tokens` tokens of `text`, as text."""
    # English runs ~4-5 characters a token: 8 per token is surely enough text to cut from.
    ids = engine.tokenizer(text[: tokens * 8], add_special_tokens=False).input_ids[:tokens]
    return engine.tokenizer.decode(ids)


def needle_probe(engine: Engine, haystack: str, context: int, depth: float, number: int) -> Probe:
    needle = f"The special magic number is {number}."
    filler = fit_tokens(engine, haystack, context - engine.count_tokens(needle) - 2)
    # Insert at the first sentence end after the depth, so the needle stays a sentence.
    cut = filler.find(". ", int(depth * len(filler)))
    cut = len(filler) if cut < 0 else cut + 1
    document = f"{filler[:cut]} {needle}{filler[cut:]}"
    return Probe("needle", context, depth, document, NEEDLE_QUESTION, number)


def shuffled_line_names(rng: random.Random) -> list[str]:
    """Every adjective-noun name once, in random order (so no two lines share a name)."""
    names = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
    rng.shuffle(names)
    return names


def lines_probe(engine: Engine, rng: random.Random, context: int, depth: float) -> Probe:
    """As many lines as fit in `context` tokens; the asked line sits at `depth`."""
    names = shuffled_line_names(rng)
    lines, numbers = [], []
    used = engine.count_tokens(LINES_HEADER)
    for name in names:
        number = rng.randrange(10000, 50000)
        line = f"line {name}: REGISTER_CONTENT is {number}\n"
        used += engine.count_tokens(line)
        if used > context:
            break
        lines.append(line)
        numbers.append(number)
    asked = round(depth * (len(lines) - 1))
    name = names[asked]
    question = f"What is the REGISTER_CONTENT in line {name}? Answer with the number only."
    return Probe("lines", context, depth, LINES_HEADER + "".join(lines), question, numbers[asked])


def probes(engine: Engine, contexts: tuple[int, ...], depths: tuple[float, ...]) -> list[Probe]:
    """Every (task, context, depth) document; fixed RNG, so every method sees the same."""
    from ..realkv import essays_text

    rng = random.Random(RNG_SEED)
    haystack = essays_text()
    result = []
    for context in contexts:
        for depth in depths:
            result.append(needle_probe(engine, haystack, context, depth, rng.randrange(10000, 100000)))
            result.append(lines_probe(engine, rng, context, depth))
    return result


def is_correct(answer: str, number: int) -> bool:
    return str(number) in answer.replace(",", "")


def ask(engine: Engine, cache_settings: CacheSettings, probe: Probe, setting: str) -> str:
    """The model's answer to `probe` in one fresh session."""
    session = engine.new_session(cache_settings)
    answer_sampling = SamplingSettings(max_new_tokens=ANSWER_TOKENS)
    if setting == "one message":
        return session.send(ChatSession.user_message(probe.question, probe.document), answer_sampling).text
    session.send(probe.document, SamplingSettings(max_new_tokens=FIRST_REPLY_TOKENS))
    return session.send(probe.question, answer_sampling).text


def run_method(engine: Engine, cache_settings: CacheSettings, probes_: list[Probe], trials: list[dict]) -> None:
    for setting in SETTINGS:
        for probe in probes_:
            answer = ask(engine, cache_settings, probe, setting)
            correct = is_correct(answer, probe.answer)
            trials.append({
                "method": cache_settings.method, "task": probe.task, "setting": setting,
                "context": probe.context, "depth": probe.depth, "expected": probe.answer,
                "answer": answer, "correct": correct,
            })
            print(f"  {cache_settings.method} {probe.task} / {setting} / {probe.context} tokens / depth "
                  f"{probe.depth}: {'right' if correct else 'wrong'} ({answer.strip()[:40]!r})", flush=True)


def accuracy_rows(trials: list[dict]) -> list[dict]:
    """One row per (method, task, setting, context), in first-seen order."""
    cells: dict[tuple, list[bool]] = {}
    for t in trials:
        cells.setdefault((t["method"], t["task"], t["setting"], t["context"]), []).append(t["correct"])
    return [
        {"method": m, "task": task, "setting": s, "context": c, "correct": sum(v), "total": len(v),
         "accuracy": sum(v) / len(v)}
        for (m, task, s, c), v in cells.items()
    ]


def plot_accuracy(out: str, rows: list[dict]) -> None:
    """recall_<task>.png (one message) and recall_<task>_two_turns.png: accuracy vs context."""
    for task in ("needle", "lines"):
        for setting in SETTINGS:
            series: dict[str, tuple[list[float], list[float]]] = {}
            for r in rows:
                if r["task"] == task and r["setting"] == setting:
                    xs, ys = series.setdefault(r["method"], ([], []))
                    xs.append(r["context"])
                    ys.append(r["accuracy"])
            suffix = "" if setting == "one message" else "_two_turns"
            report.plot(out, f"recall_{task}{suffix}", series, xlabel="context tokens", ylabel="accuracy",
                        title=f"{task} retrieval accuracy vs context ({setting})")


def cache_settings_for(args: argparse.Namespace, method: str) -> CacheSettings:
    from ..cli import method_params

    # argparse cannot tell `--budget 1024` from the default 1024: any other value counts
    # as the user's choice, the default means the suite's 25%.
    budget = BUDGET if args.budget == DEFAULT_BUDGET else args.budget
    prefill = "exact-then-compress" if args.prefill == "auto" else args.prefill
    return CacheSettings(method=method, budget=budget, window=args.window, sinks=args.sinks, batch=args.batch,
                         params=method_params(args, method), seed=args.seed, prefill_mode=prefill)


def run(args: argparse.Namespace) -> int:
    from ..cli import load_engine
    from ..compress import available

    engine = load_engine(args)
    methods = args.methods.split(",") if args.methods else available()
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    if args.lengths:
        contexts = tuple(int(x) for x in args.lengths.split(","))
    depths = QUICK_DEPTHS if args.quick else DEPTHS
    probes_ = probes(engine, contexts, depths)
    trials: list[dict] = []
    budget = None
    for method in methods:
        settings = cache_settings_for(args, method)
        budget = settings.budget
        start = time.perf_counter()
        run_method(engine, settings, probes_, trials)
        for row in accuracy_rows([t for t in trials if t["method"] == method]):
            print(f"{method:>10} {row['task']:>6} {row['setting']:>11} {row['context']:>5} tokens: "
                  f"{row['correct']}/{row['total']}", flush=True)
        print(f"{method:>10} done in {time.perf_counter() - start:.0f} s", flush=True)

    rows = accuracy_rows(trials)
    out = args.out
    report.write(
        out, "recall", rows, ["method", "task", "setting", "context", "correct", "total", "accuracy"],
        title=f"Needle and line retrieval accuracy at budget {budget}",
        notes=(f"{engine.loaded.name}, greedy, {ANSWER_TOKENS} new tokens; correct = the number appears in the "
               f"answer. Depths {', '.join(str(d) for d in depths)}. "
               "`one message`: document + question in one user message; `two turns`: the document alone "
               f"(a reply of up to {FIRST_REPLY_TOKENS} tokens), then the question. Context = document tokens."),
        extra={"budget": budget, "window": args.window, "sinks": args.sinks, "trials": trials},
    )
    plot_accuracy(out, rows)
    print(f"reports written to {out}/")
    return 0
