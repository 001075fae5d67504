"""One question under several methods, side by side: one exact prefill, forked.

The prompt (any earlier conversation, then the question) is read once, exactly, and
held (`ChatSession.feed(hold=True)`): every method's cache would start from that same
exact state. Each method then gets a fork of it (`ChatSession.fork`), which compresses
the held prefill its own way, and answers. Forking a held exact prefill equals having
prefilled with that method (tests/model/test_engine.py), so each answer is the one that
method alone would give, for the price of one prefill.

When the prompt is too big for an exact prefill (the session's prefill mode says
"streaming"), there is no exact state to fork: each method then reads the prompt by
itself, and `Comparison.note` says so.

No Textual and no SQLite here: the CLI and the controller call `compare`, and the
answers come back as strings and numbers (plus, on request, each method's session so
that a caller can continue the conversation with it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvchat import compress
from kvchat.errors import Cancelled
from kvchat.model.engine import Engine
from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.turns import SEPARATE, SHARED, Comparison, MethodAnswer, ProgressFn

MethodTokenFn = Callable[[str, str], None]  # (method, piece)
MethodFn = Callable[[str], None]  # (method)


def check_methods(methods: Sequence[str]) -> list[str]:
    """The methods in order, without repeats; ValueError naming the available ones for
    an unknown name or an empty list."""
    chosen = list(dict.fromkeys(m.strip() for m in methods if m.strip()))
    if not chosen:
        raise ValueError(f"no methods to compare; choose from: {', '.join(compress.available())}")
    unknown = [m for m in chosen if m not in compress.available()]
    if unknown:
        names = ", ".join(repr(m) for m in unknown)
        raise ValueError(f"unknown method {names} in --methods; choose from: {', '.join(compress.available())}")
    return chosen


def settings_for(settings: CacheSettings, method: str, params: Mapping[str, Mapping[str, Any]]) -> CacheSettings:
    """`settings` under `method`, with the hyperparameters given for that method only."""
    return replace(settings, method=method, params=dict(params.get(method, {})))


def base_method(methods: Sequence[str]) -> str:
    """The method the shared prefill runs under. Score-based methods (h2o, bumblebee)
    need the attention mass of the held tokens, which only a score-collecting cache
    keeps; any of them collects the same mass, and the exact prefill itself is the same
    for every method, so the others fork from it just as well."""
    return next((m for m in methods if compress.get(m).needs_attention), methods[0])


def compare(
    engine: Engine,
    settings: CacheSettings,
    sampling: SamplingSettings,
    text: str,
    methods: Sequence[str],
    *,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    history_ids: Sequence[int] = (),
    history_messages: Sequence[Mapping[str, str]] = (),
    system: str | None = None,
    on_token: MethodTokenFn | None = None,
    on_progress: ProgressFn | None = None,
    on_start: MethodFn | None = None,
    on_answer: Callable[[MethodAnswer], None] | None = None,
    cancel: threading.Event | None = None,
    keep_sessions: bool = False,
) -> Comparison:
    """Answer the user message `text` under each of `methods`.

    `settings` gives the layout (budget, window, sinks, batch, seed, prefill mode);
    `params` the hyperparameters per method. `history_ids`/`history_messages`: the
    conversation before `text`, as it was fed (token ids) and as messages; it is read
    again, exactly, with the question. `system`: its system prompt (each answer's
    session keeps it). `on_progress(done, total)` follows the prefill (in the streaming
    fallback, each method's), `on_start(method)` the start of each method,
    `on_token(method, piece)` its answer and `on_answer` its figures.
    `cancel` stops the work between prefill chunks, between methods and between tokens:
    what was done comes back with `cancelled` set (a method stopped mid-answer keeps
    its partial answer). `keep_sessions`: each answer keeps its session (to continue).
    Raises ValueError for unknown methods and engine.InputTooLong, before any work,
    when a method cannot hold the prompt."""
    chosen = check_methods(methods)
    params = params or {}
    base = engine.new_session(settings_for(settings, base_method(chosen), params), system=system)
    # The prompt as a session continuing `history` would feed it.
    history = [dict(m) for m in history_messages]
    ids = list(history_ids) + base.prompt_ids(text, history=(history, list(history_ids)))
    for method in chosen:
        # The same refusal `ask` gives (e.g. `full` on a document past the model's positions).
        probe = base if method == base.settings.method else engine.new_session(settings_for(settings, method, params))
        probe.check_fits(len(ids), sampling.max_new_tokens)
    mode = base.prefill_mode(len(ids))
    run = _shared if mode == SHARED else _separate
    return run(
        engine,
        base,
        settings,
        sampling,
        text,
        ids,
        chosen,
        params,
        history_messages,
        _Hooks(on_token, on_progress, on_start, on_answer, cancel),
        keep_sessions,
    )


def _asked(history_messages: Sequence[Mapping[str, str]], text: str) -> list[dict[str, str]]:
    """The transcript once `text` is asked after `history_messages`."""
    return [dict(m) for m in history_messages] + [{"role": "user", "content": text}]


@dataclass
class _Hooks:
    on_token: MethodTokenFn | None
    on_progress: ProgressFn | None
    on_start: MethodFn | None
    on_answer: Callable[[MethodAnswer], None] | None
    cancel: threading.Event | None

    def stopped(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def pieces(self, method: str) -> Callable[[str], None] | None:
        hear = self.on_token
        return None if hear is None else (lambda piece: hear(method, piece))

    def start(self, method: str) -> None:
        if self.on_start is not None:
            self.on_start(method)

    def answered(self, answer: MethodAnswer) -> None:
        if self.on_answer is not None:
            self.on_answer(answer)


def _shared(engine, base, settings, sampling, text, ids, chosen, params, history_messages, hooks, keep) -> Comparison:
    start = time.perf_counter()
    try:
        # The transcript's spans are the memory map of a continued answer.
        logits, mode = base.feed_transcript(
            ids, _asked(history_messages, text), hooks.on_progress, hooks.cancel, hold=True
        )
    except Cancelled:
        return Comparison([], len(ids), SHARED, time.perf_counter() - start, cancelled=True)
    prefill_s = time.perf_counter() - start
    answers: list[MethodAnswer] = []
    cancelled = False
    for method in chosen:
        if hooks.stopped():
            cancelled = True
            break
        hooks.start(method)
        forked = time.perf_counter()
        twin = base.fork(settings_for(settings, method, params))
        fork_s = time.perf_counter() - forked
        result = twin.reply(logits, sampling, hooks.pieces(method), hooks.cancel)
        m = result.metrics
        answer = MethodAnswer(
            method,
            result.text,
            twin.cache.nbytes(),
            # reply's ttft runs from before its flush (the method compressing the held
            # prefill) to the first token chosen.
            ttft_s=prefill_s + fork_s + m.ttft_s if m.ttft_s else 0.0,
            decode_tokens_per_s=m.decode_tokens_per_s,
            new_tokens=m.new_tokens,
            prefill_s=prefill_s,
            compress_s=fork_s + m.compress_s,
            stop_reason=result.stop_reason,
            session=twin if keep else None,
        )
        answers.append(answer)
        hooks.answered(answer)
        if result.cancelled:
            cancelled = True
            break
    return Comparison(answers, len(ids), mode, prefill_s, cancelled=cancelled)


def _separate(engine, base, settings, sampling, text, ids, chosen, params, history_messages, hooks, keep) -> Comparison:
    why = (
        "streaming prefill was asked for"
        if settings.prefill_mode == SEPARATE
        else f"the prompt ({len(ids):,} tokens) is too big for one exact prefill"
    )
    note = f"{why}, so each method read it by itself; the time to first token includes that method's own prefill"
    answers: list[MethodAnswer] = []
    cancelled = False
    for method in chosen:
        if hooks.stopped():
            cancelled = True
            break
        hooks.start(method)
        session = engine.new_session(settings_for(settings, method, params), system=base.system)
        start = time.perf_counter()
        try:
            logits, _ = session.feed_transcript(ids, _asked(history_messages, text), hooks.on_progress, hooks.cancel)
        except Cancelled:
            cancelled = True
            break
        prefill_s = time.perf_counter() - start
        result = session.reply(logits, sampling, hooks.pieces(method), hooks.cancel)
        m = result.metrics
        answer = MethodAnswer(
            method,
            result.text,
            session.cache.nbytes(),
            ttft_s=prefill_s + m.ttft_s if m.ttft_s else 0.0,
            decode_tokens_per_s=m.decode_tokens_per_s,
            new_tokens=m.new_tokens,
            prefill_s=prefill_s,
            stop_reason=result.stop_reason,
            session=session if keep else None,
        )
        answers.append(answer)
        hooks.answered(answer)
        if result.cancelled:
            cancelled = True
            break
    return Comparison(answers, len(ids), SEPARATE, 0.0, note=note, cancelled=cancelled)
