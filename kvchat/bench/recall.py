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

`--methods ...,oracle` adds an ablation row: h2o with the tokens that hold the answer
forced into every layer and head. It separates "the method did not keep the fact" from
"the model cannot answer from a cache this small".

`BenchOptions.recall` (e.g. (0, 64)) runs every row once per recall value, side by side:
"h2o" without the recall tier, "h2o+recall64" with 64 cold tokens recalled per KV head
and step (kvchat/recall/tier.py). Rows of one recall value fork from their own exact prefill
(a fork keeps its cache's recall setting).

Past the trained context. A document of at least the model's trained context (8,192
positions for SmolLM2) cannot be held exact to fork from. There every row reads it in a
session of its own, with its method's settings as a user gets them (the default budget,
or `--budget`; the prefill's own choice), document and question in one message, as
`kvchat ask QUESTION --file DOC` sends them (`long_trial`). Each such trial also records
what the turn cost: prefill and decode speed, the cache's RAM, the recall tier's disk and
the process's memory. Beside them, every row answers the same needles in a 2,048-token
document the same way (`REFERENCE_CONTEXT`: the speed and memory the long rows are
compared with), and `full` does too: the ceiling, what the model itself finds at a
length it reads well.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch

from kvchat.bench import report
from kvchat.model.engine import ChatSession, Engine
from kvchat.settings import BenchOptions, CacheSettings, SamplingSettings
from kvchat.turns import user_message

DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK_DEPTHS = (0.1, 0.5, 0.9)
CONTEXTS = (1024, 2048, 3072)
QUICK_CONTEXTS = (1024,)
BUDGET = "25%"
ANSWER_TOKENS = 12
FIRST_REPLY_TOKENS = 8  # "two turns": the reply to the document alone
SETTINGS = ("one message", "two turns")
# `--methods ...,oracle`: h2o with the answer's tokens forced into every layer and head
# (an ablation: it shows whether selection is all that stands between a method and the
# answer at this budget).
ORACLE = "oracle"
ORACLE_SCORE = 1e6
TASKS = ("needle", "lines")
RNG_SEED = 1234
# Past the trained context (module docstring): the one setting, the shorter document every
# row also reads, and the ceiling's method.
LONG_SETTING = "one message"
REFERENCE_CONTEXT = 2048
CEILING = "full"

NEEDLE_QUESTION = "What is the special magic number? Answer with the number only."
# LongEval's own preamble (lines task), with the line format the brief fixes.
LINES_HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line name>' and "
    "contains a REGISTER_CONTENT at the end of the line as a numerical value. For each line name, memorize "
    "its corresponding REGISTER_CONTENT. At the end of the record, I will ask you to retrieve the "
    "REGISTER_CONTENT of a certain line. Now the record starts:\n\n"
)
ADJECTIVES = (
    "amber",
    "brisk",
    "calm",
    "dusty",
    "eager",
    "faint",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lucky",
    "mellow",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
    "urban",
    "vivid",
    "windy",
    "young",
    "zesty",
)
NOUNS = (
    "anchor",
    "badger",
    "candle",
    "delta",
    "ember",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
    "valley",
    "walnut",
    "yonder",
    "zephyr",
)


@dataclass
class Probe:
    """One document with one hidden fact and the question that asks for it."""

    task: str
    context: int
    depth: float
    document: str
    question: str
    answer: int
    fact: str  # the document's text that holds the answer (the oracle row keeps it)


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
    return Probe("needle", context, depth, document, NEEDLE_QUESTION, number, needle)


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
    return Probe("lines", context, depth, LINES_HEADER + "".join(lines), question, numbers[asked], lines[asked].strip())


def probes(engine: Engine, contexts: tuple[int, ...], depths: tuple[float, ...]) -> list[Probe]:
    """Every (task, context, depth) document; fixed RNG, so every method sees the same."""
    from kvchat.calibration.realkv import essays_text

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


@dataclass
class Row:
    """One method as a row of the report (a label such as "subgen:kcenter" is a mode)."""

    label: str
    settings: CacheSettings
    oracle: bool = False


def rows_for(options: BenchOptions, names: list[str]) -> list[Row]:
    """Every named method with its CLI parameters; a method of PAPER_MODES also gets a row
    in the mode its paper evaluates, unless only that mode was asked for."""
    from kvchat.bench.attention import PAPER_MODES

    rows = []
    for name in names:
        if name == ORACLE:
            rows.append(Row(ORACLE, replace(cache_settings_for(options, "h2o"), params={}), oracle=True))
            continue
        method = name.split(":")[0]
        labels = [name] if ":" in name else [name] + [label for label in PAPER_MODES if label.startswith(f"{name}:")]
        for label in labels:
            settings = cache_settings_for(options, method)
            settings.params.update(PAPER_MODES.get(label, {}))
            rows.append(Row(label, settings))
    if not options.recall:
        return rows
    return [
        Row(
            f"{row.label}+recall{n}" if n else row.label,
            replace(row.settings, params=dict(row.settings.params), recall=n),
            row.oracle,
        )
        for row in rows
        for n in options.recall
    ]


def exact_base(engine: Engine, settings: CacheSettings, needs_scores: bool) -> ChatSession:
    """A session whose prefill will be held exact and forked: a method that scores tokens
    by attention forks from one that collects those scores during the prefill, the others
    from the exact cache (the same attention path their own prefill takes)."""
    base = replace(settings, method="h2o" if needs_scores else "full", params={})
    return engine.new_session(base)


def fact_positions(engine: Engine, session: ChatSession, fact: str) -> torch.Tensor:
    """Positions of the tokens that spell `fact` in what the session has fed so far."""
    pieces = [engine.tokenizer.decode([token]) for token in session.token_ids]
    ends = list(itertools.accumulate(len(p) for p in pieces))
    at = "".join(pieces).find(fact)
    if at < 0:
        raise ValueError(f"the fed text does not contain {fact!r}")
    return torch.tensor([i for i, end in enumerate(ends) if end > at and end - len(pieces[i]) < at + len(fact)])


def answers(engine: Engine, rows: list[Row], probe: Probe, setting: str) -> dict[str, str]:
    """Every row's answer to `probe`. The document's exact prefill is run once per base
    and forked to each method; a fork equals a session that ran the method from the start
    (tests/model/test_engine.py), so this only saves the repeated prefills."""
    from kvchat.compress import get

    result = {}
    # None (the engine's default) only when no row sets recall (`rows_for`), so never beside a number
    recalls = sorted(cast("set[int]", {r.settings.recall for r in rows}))
    for needs_scores, recall in itertools.product((False, True), recalls):
        group = [
            r for r in rows if get(r.settings.method).needs_attention == needs_scores and r.settings.recall == recall
        ]
        if not group:
            continue
        base = exact_base(engine, group[0].settings, needs_scores)
        if setting == "one message":
            logits = base.prefill_message(user_message(probe.question, probe.document), hold=True)
        else:
            logits = base.prefill_message(probe.document, hold=True)
        for row in group:
            session = base.fork(row.settings)
            if row.oracle:
                session.cache.add_window_scores(fact_positions(engine, session, probe.fact), ORACLE_SCORE)
            if setting == "one message":
                result[row.label] = session.reply(logits, SamplingSettings(max_new_tokens=ANSWER_TOKENS)).text
            else:
                session.reply(logits, SamplingSettings(max_new_tokens=FIRST_REPLY_TOKENS))
                result[row.label] = session.send(probe.question, SamplingSettings(max_new_tokens=ANSWER_TOKENS)).text
    return result


def is_long(engine: Engine, context: int) -> bool:
    """Whether a document of `context` tokens is read past the trained context (its own
    session per row; the module docstring)."""
    return context >= engine.loaded.max_positions


def long_rows(options: BenchOptions, rows: list[Row]) -> list[Row]:
    """`rows` as a user runs them past the trained context, and the ceiling: each method's
    own budget (`--budget`, else the default) and prefill, no oracle (it forks an exact
    prefill)."""
    result = []
    for row in rows:
        if row.oracle:
            continue
        own = options.cache.for_method(row.settings.method)
        result.append(Row(row.label, replace(row.settings, budget=own.budget, prefill_mode=own.prefill_mode)))
    ceiling = options.cache.for_method(CEILING)
    return [Row(f"{CEILING} (ceiling)", replace(ceiling, params={}, recall=0)), *result]


def long_trial(engine: Engine, row: Row, probe: Probe) -> dict:
    """One row's answer to `probe` read in a session of its own, and what the turn cost."""
    session = engine.new_session(row.settings)
    turn = session.send(
        user_message(probe.question, probe.document),
        SamplingSettings(max_new_tokens=ANSWER_TOKENS),
        document=probe.document,
    )
    m = turn.metrics
    return {
        "answer": turn.text,
        "budget": row.settings.budget,
        "prompt_tokens": m.prompt_tokens,
        "prefill_s": round(m.prefill_s, 2),
        "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 1),
        "decode_tokens_per_s": round(m.decode_tokens_per_s, 2),
        "kv_bytes": m.kv_bytes,
        "cold_bytes": m.cold_bytes,
        "rss_bytes": m.rss_bytes,
        "compactions": session.cache.compactions,
    }


def run_long_probes(
    engine: Engine, rows: list[Row], probes_: list[Probe], trials: list[dict], reference: int = REFERENCE_CONTEXT
) -> None:
    """Every row on each probe, each in its own session (`long_trial`); the ceiling only at
    the `reference` length."""
    for probe in probes_:
        right = []
        start = time.perf_counter()
        for row in rows:
            if row.label.endswith("(ceiling)") and probe.context != reference:
                continue
            trial = long_trial(engine, row, probe)
            correct = is_correct(trial["answer"], probe.answer)
            trials.append(
                {
                    "method": row.label,
                    "task": probe.task,
                    "setting": LONG_SETTING,
                    "context": probe.context,
                    "depth": probe.depth,
                    "expected": probe.answer,
                    "correct": correct,
                    **trial,
                }
            )
            if correct:
                right.append(row.label)
        print(
            f"{probe.task} / {LONG_SETTING} / {probe.context} tokens / depth {probe.depth}, own sessions "
            f"({time.perf_counter() - start:.0f} s): right: {', '.join(right) or 'none'}",
            flush=True,
        )


def long_probes(
    engine: Engine, contexts: tuple[int, ...], depths: tuple[float, ...], reference: int = REFERENCE_CONTEXT
) -> list[Probe]:
    """Needles past the trained context and the same needles at the `reference` length: one
    number per depth, so every length asks for the same ones. (The lines task has 576
    line names, about 13k tokens of lines: it stays inside the grid.)"""
    from kvchat.calibration.realkv import essays_text

    haystack = essays_text()
    numbers = {depth: random.Random(RNG_SEED + round(depth * 1000)).randrange(10000, 100000) for depth in depths}
    return [
        needle_probe(engine, haystack, context, depth, numbers[depth])
        for context in (reference, *contexts)
        for depth in depths
    ]


def own_session(trial: dict) -> bool:
    """Whether `trial` read its document in a session of its own (`long_trial`)."""
    return "prefill_s" in trial


def speed_rows(trials: list[dict], reference: int = REFERENCE_CONTEXT) -> list[dict]:
    """Per (method, context) of the trials read in own sessions: the needles found, medians
    of what the turn cost, and the ratios to the same method at the `reference` length."""
    cells: dict[tuple, list[dict]] = {}
    for t in filter(own_session, trials):
        cells.setdefault((t["method"], t["context"]), []).append(t)
    result = []
    for (method, context), group in cells.items():
        row = {
            "method": method,
            "context": context,
            "budget": group[0]["budget"],
            "correct": sum(t["correct"] for t in group),
            "total": len(group),
        }
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "kv_bytes", "cold_bytes", "rss_bytes"):
            row[key] = statistics.median(t[key] for t in group)
        row["cold_bytes_per_token"] = round(row["cold_bytes"] / context) if context else 0
        result.append(row)
    at_reference = {r["method"]: r for r in result if r["context"] == reference}
    for row in result:
        ref = at_reference.get(row["method"])
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "rss_bytes"):
            row[f"{key}_vs_{reference}"] = round(row[key] / ref[key], 3) if ref and ref[key] else None
    return result


def run_probes(engine: Engine, rows: list[Row], probes_: list[Probe], trials: list[dict]) -> None:
    for probe in probes_:
        for setting in SETTINGS:
            start = time.perf_counter()
            by_label = answers(engine, rows, probe, setting)
            right = []
            for row in rows:
                answer = by_label[row.label]
                correct = is_correct(answer, probe.answer)
                trials.append(
                    {
                        "method": row.label,
                        "task": probe.task,
                        "setting": setting,
                        "context": probe.context,
                        "depth": probe.depth,
                        "expected": probe.answer,
                        "answer": answer,
                        "correct": correct,
                    }
                )
                if correct:
                    right.append(row.label)
            print(
                f"{probe.task} / {setting} / {probe.context} tokens / depth {probe.depth} "
                f"({time.perf_counter() - start:.0f} s): right: {', '.join(right) or 'none'}",
                flush=True,
            )


def accuracy_rows(trials: list[dict]) -> list[dict]:
    """One row per (method, task, setting, context), in first-seen order."""
    cells: dict[tuple, list[bool]] = {}
    for t in trials:
        cells.setdefault((t["method"], t["task"], t["setting"], t["context"]), []).append(t["correct"])
    return [
        {
            "method": m,
            "task": task,
            "setting": s,
            "context": c,
            "correct": sum(v),
            "total": len(v),
            "accuracy": sum(v) / len(v),
        }
        for (m, task, s, c), v in cells.items()
    ]


def plot_accuracy(out: str | Path, rows: list[dict]) -> None:
    """recall_<task>.png (one message) and recall_<task>_two_turns.png: accuracy vs context."""
    for task in ("needle", "lines"):
        for setting in SETTINGS:
            series: dict[str, tuple[list[float], list[float]]] = {}
            for r in rows:
                if r["task"] == task and r["setting"] == setting:
                    xs, ys = series.setdefault(r["method"], ([], []))
                    xs.append(r["context"])
                    ys.append(r["accuracy"])
            if not series:  # the task was not run
                continue
            suffix = "" if setting == "one message" else "_two_turns"
            report.plot(
                out,
                f"recall_{task}{suffix}",
                series,
                xlabel="context tokens",
                ylabel="accuracy",
                title=f"{task} retrieval accuracy vs context ({setting})",
            )


def cache_settings_for(options: BenchOptions, method: str) -> CacheSettings:
    # Without --budget the suite's 25%; `auto` prefill means exact-then-compress here.
    settings = options.cache.for_method(method, budget=BUDGET)
    if settings.prefill_mode == "auto":
        settings.prefill_mode = "exact-then-compress"
    return settings


def run(options: BenchOptions) -> int:
    from kvchat.compress import available
    from kvchat.model.engine import load_engine

    engine = load_engine(options.model)
    rows = rows_for(options, list(options.methods or available()))
    contexts = options.lengths or (QUICK_CONTEXTS if options.quick else CONTEXTS)
    long = tuple(c for c in contexts if is_long(engine, c))
    grid = tuple(c for c in contexts if c not in long)
    depths = QUICK_DEPTHS if options.quick else DEPTHS
    tasks = options.tasks or TASKS
    probes_ = [p for p in probes(engine, grid, depths) if p.task in tasks] if grid else []
    trials: list[dict] = []
    start = time.perf_counter()
    run_probes(engine, rows, probes_, trials)
    if long and "needle" in tasks:
        run_long_probes(engine, long_rows(options, rows), long_probes(engine, long, depths), trials)
    table = accuracy_rows(trials)
    for row in table:
        print(
            f"{row['method']:>16} {row['task']:>6} {row['setting']:>11} {row['context']:>5} tokens: "
            f"{row['correct']}/{row['total']}",
            flush=True,
        )
    grid_trials = [t for t in trials if not own_session(t)]
    if grid_trials:
        write_grid_report(options, engine, rows, grid_trials, depths, time.perf_counter() - start)
    if len(grid_trials) < len(trials):
        write_long_report(options.out, engine, trials, depths)
    plot_accuracy(options.out, table)
    print(f"reports written to {options.out}/")
    return 0


def write_grid_report(
    options: BenchOptions,
    engine: Engine,
    rows: list[Row],
    trials: list[dict],
    depths: tuple[float, ...],
    seconds: float,
) -> None:
    """recall.{json,md}: accuracy per method, task, setting and context of the forked grid."""
    budget = rows[0].settings.budget
    report.write(
        options.out,
        "recall",
        accuracy_rows(trials),
        ["method", "task", "setting", "context", "correct", "total", "accuracy"],
        title=f"Needle and line retrieval accuracy at budget {budget}",
        notes=(
            f"{engine.loaded.name}, greedy, {ANSWER_TOKENS} new tokens; correct = the number appears in the "
            f"answer. Depths {', '.join(str(d) for d in depths)}. "
            "`one message`: document + question in one user message; `two turns`: the document alone "
            f"(a reply of up to {FIRST_REPLY_TOKENS} tokens), then the question. Context = document tokens. "
            f"Sinks {options.cache.sinks}, window {options.cache.window} (shrunk by the percentage rule), exact-then-compress "
            f"prefill, forked per method from one exact prefill. "
            + (
                "`+recallN`: the same method with the recall tier, N cold tokens per KV head and step "
                "(kvchat/recall/tier.py). "
                if any(options.recall or ())
                else ""
            )
            + f"{seconds:.0f} s in all."
        ),
        extra={
            "budget": budget,
            "window": options.cache.window,
            "sinks": options.cache.sinks,
            "trials": trials,
            "recall": list(options.recall or [0]),
        },
    )


def write_long_report(out: str | Path, engine: Engine, trials: list[dict], depths: tuple[float, ...]) -> None:
    """recall_long.{json,md}: per method and length read in own sessions, the needles found
    and what the turn cost (`speed_rows`)."""
    report.write(
        out,
        "recall_long",
        speed_rows(trials),
        [
            "method",
            "context",
            "budget",
            "correct",
            "total",
            "prefill_tokens_per_s",
            f"prefill_tokens_per_s_vs_{REFERENCE_CONTEXT}",
            "decode_tokens_per_s",
            f"decode_tokens_per_s_vs_{REFERENCE_CONTEXT}",
            "kv_bytes",
            "cold_bytes_per_token",
            "rss_bytes",
            f"rss_bytes_vs_{REFERENCE_CONTEXT}",
        ],
        title="Needles past the trained context, each method in its own session",
        notes=(
            f"{engine.loaded.name} (trained context {engine.loaded.max_positions:,}); one needle per depth "
            f"({', '.join(str(d) for d in depths)}), the same numbers at every length; document and question in one "
            f"message, as `kvchat ask --file` sends them; greedy, {ANSWER_TOKENS} new tokens. Each method's own "
            f"budget and prefill. `{CEILING} (ceiling)`: the model with its whole cache at {REFERENCE_CONTEXT:,} tokens. "
            f"Speeds and memory are medians over the depths; `_vs_{REFERENCE_CONTEXT}`: against the same method at "
            f"{REFERENCE_CONTEXT:,} tokens. "
            "`kv_bytes`: the cache in RAM (the recall index included); `cold_bytes_per_token`: the recall tier's "
            "quantised rows (in the session's temp files; a save copies them into the database) per document token; "
            "`rss_bytes`: the process's resident memory after the answer (it carries the runs before it)."
        ),
        extra={"trials": list(filter(own_session, trials))},
    )
