"""One conversation: its system prompt, transcript, the tokens fed so far, its cache and
its sampling generator. A turn feeds the new message (`feed`, in chunks) and decodes the
answer (`kvchat.model.generate`); a method switch re-streams the cache's entries; a
rebuild, a new system prompt or a saved transcript feeds the conversation again.
The UI sees strings and numbers only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from kvchat.cache import budget
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.errors import Cancelled
from kvchat.kv_types import StateDict
from kvchat.model.generate import decode
from kvchat.model.prompt import ChatTemplate, Prompt
from kvchat.runtime import process_memory, release_free_heap
from kvchat.settings import (
    PREFILL_CHUNK,
    CacheSettings,
    SamplingSettings,
    system_prompt,
)
from kvchat.turns import (
    DocumentPart,
    MemoryReport,
    MemorySpan,
    PartKept,
    ProgressFn,
    SessionStats,
    Span,
    SpanKept,
    TokenFn,
    TurnMetrics,
    TurnResult,
    group_spans,
)

if TYPE_CHECKING:
    from kvchat.model.engine import Engine
    from kvchat.recall.cold_store import Segment

# How a saved recall tier is read back: `read(sink, expected)` calls `sink(layer, rows)`.
ColdReader = Callable[[Callable[[int, Tensor], None], Callable[[], Any]], None]

# The memory map by position: the conversation in at most this many equal runs of tokens.
MEMORY_CELLS = 160


@dataclass
class SavedState:
    """What resuming a conversation exactly needs, as plain data and tensors: the cache's
    own meta and per-layer state dicts, the token ids fed, the transcript, the spans and
    the sampling generator's state. `cold_rows` (saving only): the recall tier's rows, as
    views into the files that hold them; None when recall is off."""

    cache_meta: dict[str, Any]
    layers: list[StateDict]
    token_ids: list[int]
    messages: list[dict[str, str]]
    spans: list[Span] | None = None  # None: derived from the transcript
    rng_state: bytes | None = None
    parts: list[DocumentPart] | None = None  # None: none kept (saved before pages were)
    cold_rows: list[list[Segment]] | None = None


class ChatSession:
    """One conversation: system prompt, transcript, tokens fed, cache, sampling RNG."""

    def __init__(
        self,
        engine: Engine,
        settings: CacheSettings,
        *,
        cache: CompressedCache | None = None,
        system: str | None = None,
    ) -> None:
        """`cache`: an existing cache to continue from (a fork's copy); a fresh one by
        default. `system`: the system prompt, rendered as the first message by the chat
        template (None or blank: the template's own default). It changes only through
        `set_system`, which reads the conversation again under the new one."""
        self.engine = engine
        if settings.recall is None:  # not given: this machine's default
            settings = replace(settings, params=dict(settings.params), recall=engine.default_recall)
        self.settings = settings
        self.template = ChatTemplate(engine.tokenizer)
        self.system = system_prompt(system)
        if self.system is not None:
            self.template.check_system(self.system)
        self.cache = cache if cache is not None else engine.new_cache(settings)
        self.messages: list[dict[str, str]] = []
        self.token_ids: list[int] = []  # every token fed to the model, in order
        self.spans: list[Span] = []  # which message part each fed token belongs to
        # The pages and chapters of attached files, as fed. A conversation fed again from
        # its transcript (a new system prompt, a rebuilt snapshot) keeps none: its spans
        # are then one per message, documents unsplit.
        self.parts: list[DocumentPart] = []
        self.rng = torch.Generator().manual_seed(settings.seed)
        self._lock = threading.Lock()

    @property
    def tokens_seen(self) -> int:
        """Every token the cache has seen, held or not."""
        return self.cache.tokens_seen

    # -- prompt construction ------------------------------------------------------
    def prompt_ids(self, user_text: str, history: tuple[list[dict[str, str]], list[int]] | None = None) -> list[int]:
        """Token ids of what must be fed for the next user message: the rendered
        conversation minus what the cache has already seen. `history` (messages, token
        ids fed): compute them as if the conversation so far were that one instead."""
        messages, token_ids = history if history is not None else (self.messages, self.token_ids)
        return self.template.prompt(user_text, messages, token_ids, self.system).ids

    def _record(self, prompt: Prompt, start: int, message: int) -> None:
        """Spans and document parts for the tokens fed from index `start` on (as many as
        were fed)."""
        fed = len(self.token_ids) - start
        self.spans.extend(group_spans(prompt.labels[:fed], start, message))
        self.parts.extend(
            DocumentPart(start + a, start + min(b, fed), document, part, message)
            for a, b, document, part in prompt.parts
            if a < fed
        )

    # -- feeding ---------------------------------------------------------------------
    def prefill_mode(self, count: int) -> str:
        """The prefill `count` tokens get (`kvchat.cache.budget.prefill_mode`)."""
        return budget.prefill_mode(
            self.cache,
            count,
            mode=self.settings.prefill_mode,
            prefill_memory=self.settings.prefill_memory,
            bytes_per_token=self.engine.loaded.bytes_per_token(),
        )

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise InputTooLong when a turn of `prompt_tokens` plus up to `max_new_tokens`
        cannot fit the model's positions or a byte budget, before anything is fed
        (`kvchat.cache.budget.check_fits`)."""
        mode = self.prefill_mode(prompt_tokens)
        budget.check_fits(self.cache, prompt_tokens, max_new_tokens, mode, PREFILL_CHUNK)

    def feed(
        self,
        ids: list[int],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        chunk: int = PREFILL_CHUNK,
        hold: bool = False,
    ) -> tuple[Tensor, str]:
        """Prefill `ids` in chunks; returns (last logits, prefill mode). Raises Cancelled
        between chunks; what was fed before stays in the cache and in `token_ids`. With
        `hold`, an exact-then-compress prefill stays exact until `cache.flush()` (so the
        exact state can be forked to several methods first)."""
        mode = self.prefill_mode(len(ids))
        self.cache.expect(len(ids))
        self.cache.defer_eviction = mode == "exact-then-compress"
        logits = None
        completed = False
        try:
            for start in range(0, len(ids), chunk):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                self.engine.threads.adjust()
                part = ids[start : start + chunk]
                logits = self.engine.forward(part, self.cache)
                self.cache.release_cold_pages()  # a long document maps cold rows chunk after chunk
                self.token_ids.extend(part)
                if on_progress is not None:
                    on_progress(min(start + chunk, len(ids)), len(ids))
            completed = True
        finally:
            if self.cache.defer_eviction and not (hold and completed):
                self.cache.flush()
        return cast(Tensor, logits), mode  # None only when `ids` is empty

    # -- one turn ---------------------------------------------------------------------
    def send(
        self,
        text: str,
        sampling: SamplingSettings | None = None,
        on_token: TokenFn | None = None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        document: str | None = None,
    ) -> TurnResult:
        """Add a user message and generate the assistant's answer. `document`: the
        attached document inside `text` (see `kvchat.turns.user_message`), so that the memory map
        can tell it from the question."""
        sampling = sampling or SamplingSettings()
        with self._lock:
            return self._turn(text, sampling, on_token, on_progress, cancel, document)

    def _turn(self, text, sampling, on_token, on_progress, cancel, document=None) -> TurnResult:
        tokenizer = self.engine.tokenizer
        prompt = self.template.prompt(text, self.messages, self.token_ids, self.system, document)
        ids = prompt.ids
        self.check_fits(len(ids), sampling.max_new_tokens)
        metrics = TurnMetrics(prompt_tokens=len(ids))
        compress_before = self.cache.compress_seconds
        fed_before = len(self.token_ids)
        start = time.perf_counter()
        try:
            logits, metrics.prefill_mode = self.feed(ids, on_progress, cancel)
        except Cancelled:
            # The session keeps what the model saw: the part of the message fed so far.
            fed_ids = self.token_ids[fed_before:]
            self._record(prompt, fed_before, len(self.messages))
            self.messages.append({"role": "user", "content": tokenizer.decode(fed_ids, skip_special_tokens=True)})
            metrics.prefill_s = time.perf_counter() - start
            self._finish_metrics(metrics, compress_before)
            return TurnResult("", [], metrics, cancelled=True, stop_reason="cancelled", prompt_ids=fed_ids)
        self._record(prompt, fed_before, len(self.messages))
        self.messages.append({"role": "user", "content": text})
        metrics.prefill_s = time.perf_counter() - start
        metrics.prefill_tokens_per_s = len(ids) / metrics.prefill_s if metrics.prefill_s > 0 else 0.0
        return self._reply(logits, sampling, on_token, cancel, metrics, start, compress_before, ids)

    def prefill_message(self, text: str, hold: bool = False) -> Tensor:
        """Feed a user message without answering it; returns the logits `reply` starts
        from. With `hold`, an exact-then-compress prefill is left exact (see `feed`)."""
        with self._lock:
            prompt = self.template.prompt(text, self.messages, self.token_ids, self.system)
            self.check_fits(len(prompt.ids), 0)
            fed_before = len(self.token_ids)
            logits, _ = self.feed(prompt.ids, hold=hold)
            self._record(prompt, fed_before, len(self.messages))
            self.messages.append({"role": "user", "content": text})
            return logits

    def reply(
        self,
        logits: Tensor,
        sampling: SamplingSettings | None = None,
        on_token: TokenFn | None = None,
        cancel: threading.Event | None = None,
    ) -> TurnResult:
        """Generate the assistant's answer to the message `prefill_message` fed."""
        with self._lock:
            start, compress_before = time.perf_counter(), self.cache.compress_seconds
            self.cache.flush()
            return self._reply(
                logits, sampling or SamplingSettings(), on_token, cancel, TurnMetrics(), start, compress_before, []
            )

    def _reply(self, logits, sampling, on_token, cancel, metrics, start, compress_before, ids) -> TurnResult:
        answer_from = len(self.token_ids)
        self.cache.start_recall_log()  # what the recall tier brings back for this answer
        decoded = decode(self.engine, self.cache, logits, sampling, self.rng, self.token_ids, start, on_token, cancel)
        if decoded.ttft_s is not None:
            metrics.ttft_s = decoded.ttft_s
        metrics.decode_s = decoded.decode_s
        metrics.recalled = self.cache.end_recall_log()
        metrics.new_tokens = len(decoded.new_ids)
        metrics.decode_tokens_per_s = len(decoded.new_ids) / metrics.decode_s if metrics.decode_s > 0 else 0.0
        answer = self.engine.tokenizer.decode(decoded.new_ids, skip_special_tokens=True)
        answered = Prompt([], ["assistant"] * (len(self.token_ids) - answer_from), [])
        self._record(answered, answer_from, len(self.messages))
        self.messages.append({"role": "assistant", "content": answer})
        self._finish_metrics(metrics, compress_before)
        return TurnResult(
            answer,
            decoded.new_ids,
            metrics,
            cancelled=decoded.stop_reason == "cancelled",
            stop_reason=decoded.stop_reason,
            prompt_ids=ids,
        )

    def release_memory(self) -> None:
        """Give back what a turn or a save held only while it ran: the C heap's free pages
        (`kvchat.runtime.release_free_heap`) and the recall tiers' file pages that reads
        mapped (`CompressedCache.release_cold_pages`)."""
        release_free_heap()
        self.cache.release_cold_pages()

    def _finish_metrics(self, metrics: TurnMetrics, compress_before: float) -> None:
        self.release_memory()  # the answer is complete: what the prefill held goes back
        metrics.compress_s = self.cache.compress_seconds - compress_before
        metrics.kv_bytes = self.cache.nbytes()
        metrics.full_kv_bytes = self.cache.full_cache_bytes()
        metrics.entries_per_head = self.cache.entries_per_head()
        metrics.tokens_seen = self.cache.tokens_seen
        metrics.rss_bytes, metrics.cuda_bytes = process_memory()
        metrics.cold_bytes = self.cache.cold_bytes()

    # -- method switch, fork and rebuild ---------------------------------------------
    def fork(self, settings: CacheSettings | None = None) -> ChatSession:
        """An independent copy of this conversation (transcript, tokens, cache, sampling
        RNG), optionally under another method: its entries are re-streamed as in
        `switch_method`, so forking an exact, held prefill equals having prefilled with
        that method. Budget, allocation, window, sinks and batch stay this session's."""
        settings = replace(settings or self.settings, params=dict((settings or self.settings).params))
        layout = ("budget", "allocation", "window", "sinks", "batch", "seed")
        if any(str(getattr(settings, f)) != str(getattr(self.settings, f)) for f in layout):
            raise ValueError(f"a fork keeps the cache layout ({', '.join(layout)}); only the method may change")
        with self._lock:
            twin = ChatSession(self.engine, settings, cache=self.cache.copy(), system=self.system)
            twin.messages = [dict(m) for m in self.messages]
            twin.token_ids = list(self.token_ids)
            twin.spans = list(self.spans)
            twin.parts = list(self.parts)
            twin.rng.set_state(self.rng.get_state())
            if settings.method != self.cache.method or settings.params != self.cache.params:
                twin.cache.switch_method(settings.method, settings.params)
            return twin

    def switch_method(self, method: str, params: dict[str, Any] | None = None) -> bool:
        """Re-stream the current entries into another compressor (no recompute). When the
        old method holds no real tokens to hand over (subgen's samples), re-prefill the
        transcript through the new one instead; returns False in that case."""
        with self._lock:
            restreamed = self.cache.switch_method(method, params)
            self.settings.method, self.settings.params = method, dict(params or {})
        if not restreamed:
            self.rebuild()  # (which hands the freed memory back itself)
        else:
            release_free_heap()
        return restreamed

    def rebuild(self, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None) -> None:
        """Re-prefill every token fed so far through the current method (faithful state).
        On cancel the previous cache is kept."""
        with self._lock:
            old_cache, old_ids = self.cache, self.token_ids
            self.cache, self.token_ids = self.engine.new_cache(self.settings), []
            try:
                self.feed(list(old_ids), on_progress, cancel)
            except Cancelled:
                self.cache, self.token_ids = old_cache, old_ids
                raise
            finally:
                release_free_heap()

    def set_recall(
        self, recall: int, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None
    ) -> bool:
        """Turn the recall tier on (`recall` cold tokens per KV head and step) or off (0) by
        a `rebuild` under it; True when anything was fed. On Cancelled nothing changes."""
        before, self.settings.recall = self.settings.recall, int(recall)
        try:
            self.rebuild(on_progress, cancel)
        except Cancelled:
            self.settings.recall = before
            raise
        return bool(self.token_ids)

    # -- a conversation from elsewhere: a snapshot, a transcript, a comparison's history --
    def saved_state(self) -> SavedState:
        """What resuming this conversation exactly needs (`restore` takes it back)."""
        with self._lock:
            return SavedState(
                cache_meta=self.cache.meta(),
                layers=self.cache.layer_states(),
                token_ids=list(self.token_ids),
                messages=[dict(m) for m in self.messages],
                spans=list(self.spans),
                rng_state=self.rng.get_state().numpy().tobytes(),
                cold_rows=self.cache.cold_rows(),
                parts=list(self.parts),
            )

    def restore(self, state: SavedState) -> None:
        """Continue exactly where a saved conversation stopped: its cache state, the token
        ids it fed, its transcript, its spans (None: derived from the transcript) and its
        sampling generator. Its recall tier's rows come apart (`restore_recall_tier`).
        Raises KeyError, ValueError or RuntimeError when the state does not fit this
        session's cache."""
        with self._lock:
            self.cache.load_layer_states(state.cache_meta, state.layers)
            self.token_ids = list(state.token_ids)
            self.messages = [dict(m) for m in state.messages]
            self.spans = list(state.spans) if state.spans is not None else self.spans_from_messages()
            self.parts = list(state.parts or []) if state.spans is not None else []
            if state.rng_state is not None:
                self.rng.set_state(torch.frombuffer(bytearray(state.rng_state), dtype=torch.uint8))

    def restore_recall_tier(self, read: ColdReader) -> bool | None:
        """After `restore`: `read(sink, expected)` hands the saved rows of the recall tier
        to `sink(layer, rows)`, in order per layer (`expected()` names the rows the
        restored state wants). True when every tier got exactly its rows; False when they
        did not fit, and the tier is left empty; None when recall is off (nothing to read).
        What `read` raises goes through, the tier left empty."""
        cache = self.cache
        if cache.cold_rows() is None:
            return None
        return cache.load_cold(lambda sink: read(sink, cache.cold_rows))

    def feed_transcript(
        self,
        ids: list[int],
        messages: list[dict[str, str]],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        hold: bool = False,
    ) -> tuple[Tensor, str]:
        """Feed `ids`, the tokens of a whole conversation `messages` (a rebuilt
        transcript, or a comparison reading a history and its question again), and make
        `messages` this session's transcript, its spans one per message. Returns what
        `feed` returns; on Cancelled the transcript is left unchanged."""
        logits, mode = self.feed(ids, on_progress, cancel, hold=hold)
        with self._lock:
            self.messages = [dict(m) for m in messages]
            self.spans, self.parts = self.spans_from_messages(), []
        return logits, mode

    def read_transcript(
        self,
        messages: list[dict[str, str]],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """Feed a saved transcript, rendered with this model's chat template (token ids
        saved under another model would mean nothing), in chunks with progress."""
        if not messages:
            return
        self.feed_transcript(self.template.transcript_ids(messages, self.system), messages, on_progress, cancel)

    def set_system(
        self,
        text: str | None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Make `text` the system prompt (None or blank: the template's default). It sits
        at the start of the conversation, so the transcript so far is rendered again
        under it and fed into a fresh cache, in chunks with progress (like a rebuild from
        the transcript). Returns True when anything was fed. On Cancelled the previous
        prompt and cache are kept."""
        system = system_prompt(text)
        if system is not None:
            self.template.check_system(system)
        with self._lock:
            if system == self.system:
                return False
            if not self.token_ids:
                self.system = system
                return False
            before = (self.system, self.cache, self.token_ids, self.spans)
            self.system = system
            self.cache, self.token_ids = self.engine.new_cache(self.settings), []
            try:
                self.feed(self.template.transcript_ids(self.messages, self.system), on_progress, cancel)
            except BaseException:
                self.system, self.cache, self.token_ids, self.spans = before
                raise
            self.spans, self.parts = self.spans_from_messages(), []
            return True

    # -- what the cache still holds -----------------------------------------------------
    def spans_from_messages(self) -> list[Span]:
        """Spans re-derived from the transcript, one per message (`ChatTemplate.spans`)."""
        return self.template.spans(self.messages, len(self.token_ids), self.system)

    def covered_spans(self) -> list[Span]:
        """The spans, extended so that they cover every token fed (tokens no span
        records, e.g. from a session saved before spans were kept, count as "user")."""
        spans = [s for s in self.spans if s.end <= len(self.token_ids)]
        covered = spans[-1].end if spans else 0
        if covered < len(self.token_ids):
            spans.append(Span(covered, len(self.token_ids), "user", max(0, len(self.messages) - 1)))
        return spans

    def memory_map(self) -> list[MemorySpan]:
        """For each span of the conversation, the share of its tokens the cache still
        represents (docs/design.md, "The memory map")."""
        with self._lock:
            spans = self.covered_spans()
            per_layer = self.cache.memory_map([(s.start, s.end) for s in spans])
        out = []
        for i, span in enumerate(spans):
            layers = tuple(float(layer[i]) for layer in per_layer)
            kept = sum(layers) / len(layers) if layers else 0.0
            out.append(MemorySpan(span.start, span.end, span.role, span.message, kept, layers))
        return out

    def memory_report(self, cell_layers: bool = True) -> MemoryReport:
        """The memory map (saved with each snapshot; what the app and `kvchat sessions
        show --memory` draw): per span and per equal run of tokens ("cells"), the share the
        cache holds, overall and per layer (the cells per layer only with `cell_layers`),
        the allocation, and what the recall tier recalled for the last answer."""
        spans = self.memory_map()
        layer_count = len(spans[0].layers) if spans else 0
        with self._lock:
            seen = spans[-1].end if spans else 0
            step = max(1, -(-seen // MEMORY_CELLS))
            bounds = [(start, min(seen, start + step)) for start in range(0, seen, step)]
            by_position = self.cache.memory_map(bounds)
            parts = [part for part in self.parts if part.end <= len(self.token_ids)]
            by_part = self.cache.memory_map([(part.start, part.end) for part in parts]) if parts else []
            return MemoryReport(
                spans=[SpanKept(span.start, span.end, span.role, round(span.kept, 4)) for span in spans],
                layers=[[round(span.layers[layer], 4) for span in spans] for layer in range(layer_count)],
                cell_bounds=[list(b) for b in bounds],
                cell_kept=[round(sum(col) / len(col), 4) for col in zip(*by_position)] if bounds else [],
                cell_layers=[[round(x, 4) for x in row] for row in by_position] if bounds and cell_layers else [],
                layer_entries=self.cache.layer_entries(),
                layer_budgets=self.cache.layer_budgets(),
                layer_bytes=self.cache.layer_nbytes(),
                method=self.cache.method,
                budget=str(self.cache.budget),
                tokens_seen=self.cache.tokens_seen,
                kv_bytes=self.cache.nbytes(),
                layer_windows=self.cache.layer_windows(),
                parts=[
                    PartKept(part.start, part.end, part.document, part.part, round(sum(col) / len(col), 4))
                    for part, col in zip(parts, zip(*by_part))
                ],
                **self.cache.recall_report([(s.start, s.end) for s in spans], bounds),
            )

    def stats(self) -> SessionStats:
        rss, cuda = process_memory()
        return SessionStats(
            method=self.cache.method,
            budget=str(self.cache.budget),
            tokens_seen=self.cache.tokens_seen,
            entries_per_head=self.cache.entries_per_head(),
            kv_bytes=self.cache.nbytes(),
            full_kv_bytes=self.cache.full_cache_bytes(),
            rss_bytes=rss,
            cuda_bytes=cuda,
            recall=self.cache.recall,
            cold_bytes=self.cache.cold_bytes(),
        )
