"""`kvchat bench resume`.

What a saved session buys. For sessions of 1k, 4k and 8k tokens (an essay document and
one answered question, saved through `persist` into a temporary store), side by side:

- resume: load the snapshot from SQLite and answer a new question, to its first token;
- recompute: a fresh cache re-prefilling the same token ids, then the same question, to
  its first token;

plus the snapshot's size on disk against the cache's bytes in memory, and the snapshot
write time of every turn against the decode time of the turn it follows (~32 new tokens):
the first save writes a full snapshot, the next DELTA_TURNS turns write deltas on it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kvchat.bench import report
from kvchat.chat import persist
from kvchat.model.engine import ChatSession, Engine
from kvchat.settings import BenchOptions, CacheSettings, SamplingSettings
from kvchat.storage.db import Store
from kvchat.turns import TurnResult, user_message

LENGTHS = (1024, 4096, 8192)
QUICK_LENGTHS = (1024,)
BUDGET = "25%"
TURN_TOKENS = 32
DELTA_QUESTIONS = ("What is its main argument?", "Give one example from it.", "Who would disagree, and why?")
DELTA_TURNS = len(DELTA_QUESTIONS)
# Room left in a session for the chat template, the answers and the next questions, so
# that an 8k session stays inside the default model's 8,192 positions.
TURN_MARGIN = 112 + DELTA_TURNS * 72
FIRST_QUESTION = "Summarise the text above in a few sentences."
NEXT_QUESTION = "Which essay was that from?"
REPEATS = 3


def compressed_default(available: list[str]) -> str:
    return "chelsea" if "chelsea" in available else "window"


def cache_settings_for(options: BenchOptions, method: str) -> CacheSettings:
    # Without --budget the suite uses 25%: with 1,024 middle entries behind a 1,024-token
    # window a 1k session would stay exact.
    return options.cache.for_method(method, budget=BUDGET)


def build_session(engine: Engine, settings: CacheSettings, document: str) -> tuple[ChatSession, str, TurnResult]:
    """A session holding `document` and one answered question (~TURN_TOKENS new tokens)."""
    session = engine.new_session(settings)
    text = user_message(FIRST_QUESTION, document)
    result = session.send(text, SamplingSettings(max_new_tokens=TURN_TOKENS))
    return session, text, result


def time_resume(store: Store, engine: Engine, session_id: int) -> tuple[float, float, int]:
    """(seconds to the first new token, of which snapshot load, that token)."""
    start = time.perf_counter()
    session, info = persist.resume(store, engine, session_id)
    ready = time.perf_counter() - start
    result = session.send(NEXT_QUESTION, SamplingSettings(max_new_tokens=1))
    return ready + result.metrics.ttft_s, info.seconds, first_token(result)


def time_recompute(engine: Engine, settings: CacheSettings, saved: ChatSession) -> tuple[float, int]:
    """(seconds to the first new token re-prefilling the saved token ids, that token)."""
    start = time.perf_counter()
    session = engine.new_session(settings)
    session.feed_transcript(list(saved.token_ids), saved.messages)
    ready = time.perf_counter() - start
    result = session.send(NEXT_QUESTION, SamplingSettings(max_new_tokens=1))
    return ready + result.metrics.ttft_s, first_token(result)


def first_token(result: TurnResult) -> int:
    # A turn that stops at once on an end token generated no ids; -1 stands for it.
    return result.token_ids[0] if result.token_ids else -1


def warm_up(engine: Engine) -> None:
    """One tiny turn first, so that the first measured method pays no one-off costs."""
    engine.new_session().send("Hello", SamplingSettings(max_new_tokens=4))


def measure(
    engine: Engine, store: Store, method: str, settings: CacheSettings, document: str, repeats: int
) -> dict[str, Any]:
    session, text, result = build_session(engine, settings, document)
    session_id = persist.new_session_row(store, session, f"bench {method} {len(session.token_ids)}")
    write_s = persist.save_turn(store, session_id, session, text, result)
    full_mb = store.last_write_bytes(session_id) / 2**20
    deltas = []  # (write seconds, MB written, that turn's decode seconds)
    for question in DELTA_QUESTIONS:
        turn = session.send(question, SamplingSettings(max_new_tokens=TURN_TOKENS))
        delta_s = persist.save_turn(store, session_id, session, question, turn)
        deltas.append((delta_s, store.last_write_bytes(session_id) / 2**20, turn.metrics.decode_s))
    resume_runs, recompute_runs = [], []
    # Interleaved, and the best of each side counts: on a shared machine single runs
    # can be several times slower than the rest.
    for _ in range(repeats):
        resume_runs.append(time_resume(store, engine, session_id))
        recompute_runs.append(time_recompute(engine, settings, session))
    nan = float("nan")
    # repeats=0 (`--quick` with KVCHAT_BENCH_NO_RECOMPUTE=1): the snapshot writes only.
    resume_s, load_s, resume_token = min(resume_runs, default=(nan, nan, -1))
    recompute_s, recompute_token = min(recompute_runs, default=(nan, -2))
    decode_s = result.metrics.decode_s
    ratios = [w / d if d > 0 else float("nan") for w, _, d in deltas]
    return {
        "method": method,
        "tokens": len(session.token_ids),
        "resume_s": resume_s,
        "snapshot_load_s": load_s,
        "recompute_s": recompute_s,
        "recompute_over_resume": recompute_s / resume_s,
        "kv_mb": session.cache.nbytes() / 2**20,
        "snapshot_mb": store.snapshot_bytes(session_id) / 2**20,
        "snapshot_write_s": write_s,
        "turn_decode_s": decode_s,
        "turn_new_tokens": result.metrics.new_tokens,
        "write_over_decode": write_s / decode_s if decode_s > 0 else float("nan"),
        "full_write_mb": full_mb,
        "delta_write_s_max": max(w for w, _, _ in deltas),
        "delta_mb_max": max(mb for _, mb, _ in deltas),
        "delta_decode_s_min": min(d for _, _, d in deltas),
        "delta_over_decode_max": max(ratios),
        "per_turn_write_s": [round(write_s, 4)] + [round(w, 4) for w, _, _ in deltas],
        "per_turn_write_mb": [round(full_mb, 3)] + [round(mb, 3) for _, mb, _ in deltas],
        "per_turn_decode_s": [round(decode_s, 4)] + [round(d, 4) for _, _, d in deltas],
        "same_first_token": resume_token == recompute_token if repeats else None,
    }


def plot_times(out: str | Path, rows: list[dict]) -> None:
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        for side in ("resume", "recompute"):
            xs, ys = series.setdefault(f"{r['method']} {side}", ([], []))
            xs.append(r["tokens"])
            ys.append(r[f"{side}_s"])
    report.plot(
        out,
        "resume",
        series,
        xlabel="session tokens",
        ylabel="seconds to first new token",
        title="Resume from SQLite vs recompute",
        logx=True,
    )


def measure_all(
    engine: Engine, options: BenchOptions, methods: list[str], lengths: tuple[int, ...], repeats: int = REPEATS
) -> list[dict]:
    """Every (length, method) row, each session saved into one temporary store."""
    from kvchat.bench.recall import fit_tokens
    from kvchat.calibration.realkv import essays_text

    essays = essays_text()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as folder:
        store = Store(Path(folder) / "sessions.db")
        try:
            for length in lengths:
                document = fit_tokens(engine, essays, length - TURN_MARGIN)
                for method in methods:
                    settings = cache_settings_for(options, method)
                    rows.append(measure(engine, store, method, settings, document, repeats))
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
        finally:
            store.close()
    return rows


def describe(model_name: str, budget: str, repeats: int = REPEATS) -> str:
    return (
        f"{model_name}; compressed methods at budget {budget}. Session = an essay document and one question "
        f"answered with up to {TURN_TOKENS} greedy tokens, saved with persist.save_turn into a temporary SQLite "
        "store. resume_s: persist.resume, then the next question to its first token; recompute_s: a fresh cache "
        "re-prefilling the session's token ids, then the same question to its first token (both counted to the "
        f"moment the token is sampled; best of {repeats} interleaved runs each). snapshot_write_s: the save after "
        "that turn (a full snapshot); turn_decode_s: that turn's decode time. Then "
        f"{DELTA_TURNS} more turns of up to {TURN_TOKENS} tokens, each saved as a delta: delta_write_s_max, "
        "delta_mb_max and delta_over_decode_max are the worst of them; per_turn_* list every save in order."
    )


def run(options: BenchOptions) -> int:
    from kvchat.compress import available
    from kvchat.model.engine import load_engine

    engine = load_engine(options.model)
    methods = list(options.methods or ["full", compressed_default(available())])
    lengths = options.lengths or (QUICK_LENGTHS if options.quick else LENGTHS)
    repeats = 1 if options.quick else REPEATS
    if options.quick and os.environ.get("KVCHAT_BENCH_NO_RECOMPUTE") == "1":
        repeats = 0  # on a busy machine an 8k re-prefill per method takes minutes
    warm_up(engine)
    rows = measure_all(engine, options, methods, lengths, repeats)

    out = options.out
    budget = cache_settings_for(options, methods[-1]).budget
    report.write(
        out,
        "resume",
        rows,
        [
            "method",
            "tokens",
            "resume_s",
            "recompute_s",
            "recompute_over_resume",
            "snapshot_load_s",
            "kv_mb",
            "snapshot_mb",
            "snapshot_write_s",
            "full_write_mb",
            "turn_decode_s",
            "turn_new_tokens",
            "write_over_decode",
            "delta_write_s_max",
            "delta_mb_max",
            "delta_decode_s_min",
            "delta_over_decode_max",
        ],
        title="Resume from a saved snapshot vs recompute",
        notes=describe(engine.loaded.name, budget, repeats),
        extra={"budget": budget, "window": options.cache.window, "sinks": options.cache.sinks},
    )
    plot_times(out, rows)
    print(f"reports written to {out}/")
    return 0
