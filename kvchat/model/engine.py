"""The generation engine: model + tokenizer + one session's cache, prefill and decode.

`Engine` owns the loaded model (shared by sessions); `ChatSession` owns a transcript,
the tokens fed so far and a `CompressedCache`. Decoding is our own loop over the
model's forward (not `generate`): it feeds one token per step into our cache, samples,
stops on end-of-turn tokens, a token limit or a cancel event, and streams text pieces
to a callback. The UI sees strings and numbers only.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvchat.model.loading import LoadedModel, cache_keyword, gc_paused  # first: see its imports

# isort: split
import psutil
import torch
from torch import Tensor

from kvchat.cache import budget as allocate, attention
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.errors import Cancelled, SettingsError
from kvchat.runtime import release_free_heap
from kvchat.model.sampling import sample
from kvchat.settings import DEFAULT_RECALL, PREFILL_CHUNK, Budget, CacheSettings, ModelOptions, SamplingSettings
from kvchat.settings import system_prompt
from kvchat.runtime import ThreadGovernor
from kvchat.turns import MemorySpan, ProgressFn, Span, TokenFn, TurnMetrics, TurnResult, group_spans

# The memory map by position: the conversation in at most this many equal runs of tokens.
MEMORY_CELLS = 160
# Decode steps between two looks at how many cores are free (kvchat/runtime.py).
THREAD_CHECK_STEPS = 16

def process_memory() -> tuple[int, int]:
    """(process RSS bytes, CUDA bytes allocated by this process)."""
    rss = psutil.Process(os.getpid()).memory_info().rss
    cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    return rss, cuda


class Engine:
    """A loaded model ready for kvchat sessions."""

    def __init__(
        self, loaded: LoadedModel, threads: int | None = None, *, governor: ThreadGovernor | None = None
    ) -> None:
        attention.register()
        # Intra-op threads: the free cores (kvchat/runtime.py), re-checked as we go. One that
        # watched the machine while the model loaded (`load_engine`) decides at once.
        self.threads = governor or ThreadGovernor(threads)
        self.threads.adjust(force=True) if governor else self.threads.start()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model.set_attn_implementation(attention.ATTN_NAME)
        self.forward_calls = 0  # counted for tests (resume must not re-prefill)
        self.tokens_fed = 0
        self.stop_ids = self._stop_ids()
        self.cache_keyword = cache_keyword(self.model)
        self._calibrations: dict[str, dict[int, dict[str, Any]]] = {}  # method -> layer -> params
        self._measured: dict[str, list] = {}  # kvchat.calibration.calibrate's per-model measurements

    def _stop_ids(self) -> set[int]:
        ids = set()
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        for value in (eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid is not None:
                ids.add(tid)
        return ids

    def new_cache(self, settings: CacheSettings) -> CompressedCache:
        budget = Budget.parse(settings.budget)
        return CompressedCache.for_model(
            self.loaded,
            method=settings.method,
            budget=budget,
            window=settings.window,
            sinks=settings.sinks,
            batch=settings.batch,
            params=settings.params,
            seed=settings.seed,
            layer_params=self.calibrated_params,
            layer_weights=self.measured("layer_weights") if budget.in_bytes and settings.allocation == "auto" else None,
            recall=settings.recall,
            recall_layers=self.measured("recall_layers") if settings.recall else None,
            fit_window=settings.fit_window,
        )

    def measured(self, what: str) -> list:
        """A per-model measurement of `kvchat.calibration.calibrate`: "layer_weights" (how much middle
        each layer needs) or "recall_layers" (the layers that recall): measured once per
        model, cached on disk, shared by this engine's sessions."""
        if what not in self._measured:
            from kvchat.calibration import calibrate

            self._measured[what] = getattr(calibrate, what)(self.loaded)
        return self._measured[what]

    def calibrated_params(self, method: str, layer: int) -> dict[str, Any]:
        """Per-layer parameters a method takes from a one-off model calibration: those of
        its compressor's `calibrate` hook (if it has one), computed once per model."""
        from kvchat import compress

        hook = getattr(compress.get(method), "calibrate", None)
        if hook is None:
            return {}
        if method not in self._calibrations:
            from kvchat.calibration.calibrate import calibrated_layer_params

            self._calibrations[method] = calibrated_layer_params(self.loaded, compress.get(method))
        return dict(self._calibrations[method].get(layer, {}))

    def new_session(self, settings: CacheSettings | None = None, *, system: str | None = None) -> ChatSession:
        return ChatSession(self, settings or CacheSettings(), system=system)

    @property
    def default_recall(self) -> int:
        """Recall when the user did not choose: on where its speed was measured (kvchat/settings.py)."""
        from kvchat import native

        return DEFAULT_RECALL if self.loaded.device.type == "cpu" and native.ranking_path() is not None else 0

    @torch.inference_mode()
    def forward(self, ids: list[int] | Tensor, cache: CompressedCache) -> Tensor:
        """One forward pass of new tokens through the cache; returns last-position logits."""
        input_ids = ids if isinstance(ids, Tensor) else torch.tensor([ids], dtype=torch.long)
        input_ids = input_ids.to(self.loaded.device)
        positions = cache.positions_for(input_ids.shape[1]).to(self.loaded.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            **{self.cache_keyword: cache},
            use_cache=True,
            logits_to_keep=1,
            kvchat_cache=cache,
        )
        cache.settle()
        self.forward_calls += 1
        self.tokens_fed += input_ids.shape[1]
        return out.logits[0, -1].float()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


class ChatSession:
    """One conversation: system prompt, transcript, tokens fed, cache, sampling RNG."""

    def __init__(
        self, engine: Engine, settings: CacheSettings, *, cache: CompressedCache | None = None,
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
        self.system = system_prompt(system)
        if self.system is not None:
            self._check_template(self.system)
        self.cache = cache if cache is not None else engine.new_cache(settings)
        self.messages: list[dict[str, str]] = []
        self.token_ids: list[int] = []  # every token fed to the model, in order
        self.spans: list[Span] = []  # which message part each fed token belongs to
        self.rng = torch.Generator().manual_seed(settings.seed)
        self._lock = threading.Lock()

    # -- prompt construction ------------------------------------------------------
    def _with_system(self, messages: list[dict[str, str]], system: str | None = None) -> list[dict[str, str]]:
        """`messages` as the chat template gets them: after the system prompt (`system`,
        else this session's), when there is one."""
        system = self.system if system is None else system
        return [{"role": "system", "content": system}, *messages] if system is not None else list(messages)

    def _check_template(self, system: str) -> None:
        """Refuse a system prompt the model's chat template cannot render (some have no system role)."""
        try:
            self._render([{"role": "user", "content": "."}], system)
        except Exception as err:
            raise SettingsError(f"this model's chat template takes no system prompt ({err})") from None

    def _render(self, messages: list[dict[str, str]], system: str | None = None) -> str:
        return self.engine.tokenizer.apply_chat_template(
            self._with_system(messages, system), add_generation_prompt=True, tokenize=False
        )

    def prompt_ids(self, user_text: str, history: tuple[list[dict[str, str]], list[int]] | None = None) -> list[int]:
        """Token ids of what must be fed for the next user message: the rendered
        conversation minus what the cache has already seen. `history` (messages, token
        ids fed): compute them as if the conversation so far were that one instead."""
        return self._prompt(user_text, history=history)[0]

    def _prompt(
        self, user_text: str, document: str | None = None,
        history: tuple[list[dict[str, str]], list[int]] | None = None,
    ) -> tuple[list[int], list[str]]:
        """(prompt ids, a role label per id). The message's own text is "user", the
        attached document inside it "document", the chat template around it "user"
        (before the first message: "system", the template's system prompt)."""
        messages, token_ids = history if history is not None else (self.messages, self.token_ids)
        full = self._render(list(messages) + [{"role": "user", "content": user_text}])
        fed = self.engine.tokenizer.decode(token_ids, skip_special_tokens=False) if token_ids else ""
        common = os.path.commonprefix([full, fed])
        new_text = full[len(common) :]
        try:
            encoded = self.engine.tokenizer(new_text, add_special_tokens=False, return_offsets_mapping=True)
            offsets = list(encoded["offset_mapping"])
        except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer has no offsets
            encoded, offsets = self.engine.tokenizer(new_text, add_special_tokens=False), []
        ids = list(encoded.input_ids)
        content_at = new_text.rfind(user_text) if user_text else -1
        before = "system" if not token_ids else "user"
        doc = (document or "").rstrip()
        doc_at = user_text.find(doc) if doc else -1
        if not offsets:  # no character offsets: the whole prompt counts as the message
            return ids, ["user"] * len(ids)
        labels = []
        for i in range(len(ids)):
            char = offsets[i][0]
            if content_at < 0 or char < content_at:
                labels.append(before if content_at >= 0 else "user")
            elif doc_at >= 0 and content_at + doc_at <= char < content_at + doc_at + len(doc):
                labels.append("document")
            else:
                labels.append("user")
        return ids, labels

    def _record(self, labels: list[str], start: int, message: int) -> None:
        """Spans for the tokens fed from index `start` on (as many as were fed)."""
        fed = len(self.token_ids) - start
        self.spans.extend(group_spans(labels[:fed], start, message))

    # -- feeding ---------------------------------------------------------------------
    def prefill_mode(self, count: int) -> str:
        """The prefill `count` tokens get (`kvchat.cache.budget.prefill_mode`)."""
        return allocate.prefill_mode(
            self.cache, count, mode=self.settings.prefill_mode, prefill_memory=self.settings.prefill_memory,
            bytes_per_token=self.engine.loaded.bytes_per_token(),
        )

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise InputTooLong when a turn of `prompt_tokens` plus up to `max_new_tokens`
        cannot fit the model's positions or a byte budget, before anything is fed
        (`kvchat.cache.budget.check_fits`)."""
        mode = self.prefill_mode(prompt_tokens)
        allocate.check_fits(self.cache, prompt_tokens, max_new_tokens, mode, PREFILL_CHUNK)

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
                self.token_ids.extend(part)
                if on_progress is not None:
                    on_progress(min(start + chunk, len(ids)), len(ids))
            completed = True
        finally:
            if self.cache.defer_eviction and not (hold and completed):
                self.cache.flush()
        return logits, mode

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
        ids, labels = self._prompt(text, document)
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
            self._record(labels, fed_before, len(self.messages))
            self.messages.append({"role": "user", "content": tokenizer.decode(fed_ids, skip_special_tokens=True)})
            metrics.prefill_s = time.perf_counter() - start
            self._finish_metrics(metrics, compress_before)
            return TurnResult("", [], metrics, cancelled=True, stop_reason="cancelled", prompt_ids=fed_ids)
        self._record(labels, fed_before, len(self.messages))
        self.messages.append({"role": "user", "content": text})
        metrics.prefill_s = time.perf_counter() - start
        metrics.prefill_tokens_per_s = len(ids) / metrics.prefill_s if metrics.prefill_s > 0 else 0.0
        return self._reply(logits, sampling, on_token, cancel, metrics, start, compress_before, ids)

    def prefill_message(self, text: str, hold: bool = False) -> Tensor:
        """Feed a user message without answering it; returns the logits `reply` starts
        from. With `hold`, an exact-then-compress prefill is left exact (see `feed`)."""
        with self._lock:
            ids, labels = self._prompt(text)
            self.check_fits(len(ids), 0)
            fed_before = len(self.token_ids)
            logits, _ = self.feed(ids, hold=hold)
            self._record(labels, fed_before, len(self.messages))
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
            return self._reply(logits, sampling or SamplingSettings(), on_token, cancel, TurnMetrics(), start,
                               compress_before, [])

    def _reply(self, logits, sampling, on_token, cancel, metrics, start, compress_before, ids) -> TurnResult:
        tokenizer = self.engine.tokenizer
        new_ids: list[int] = []
        answer_from = len(self.token_ids)
        stop_reason = "length"
        emitted = ""
        # Incremental detokenisation: decode only the tokens since the last emitted piece
        # (plus the piece before, for context), not the whole answer on every step.
        prefix_at = read_at = 0
        decode_start = time.perf_counter()
        self.cache.start_recall_log()  # what the recall tier brings back for this answer
        for step in range(sampling.max_new_tokens):
            if cancel is not None and cancel.is_set():
                stop_reason = "cancelled"
                break
            if step % THREAD_CHECK_STEPS == 0:
                self.engine.threads.adjust()
            token = sample(logits, sampling, self.rng)
            if step == 0:
                metrics.ttft_s = time.perf_counter() - start
            if token in self.engine.stop_ids:
                stop_reason = "end"
                break
            new_ids.append(token)
            if on_token is not None:
                # A piece is emitted once its bytes form whole characters (a multi-byte
                # character split across tokens decodes to U+FFFD until complete).
                before = tokenizer.decode(new_ids[prefix_at:read_at], skip_special_tokens=True)
                current = tokenizer.decode(new_ids[prefix_at:], skip_special_tokens=True)
                if len(current) > len(before) and not current.endswith("\ufffd"):
                    piece = current[len(before) :]
                    on_token(piece)
                    emitted += piece
                    prefix_at, read_at = read_at, len(new_ids)
            logits = self.engine.forward([token], self.cache)
            self.token_ids.append(token)
        metrics.decode_s = time.perf_counter() - decode_start
        metrics.recalled = self.cache.end_recall_log()
        metrics.new_tokens = len(new_ids)
        metrics.decode_tokens_per_s = len(new_ids) / metrics.decode_s if metrics.decode_s > 0 else 0.0
        answer = tokenizer.decode(new_ids, skip_special_tokens=True)
        if on_token is not None and answer.startswith(emitted) and len(answer) > len(emitted):
            on_token(answer[len(emitted) :])
        self._record(["assistant"] * (len(self.token_ids) - answer_from), answer_from, len(self.messages))
        self.messages.append({"role": "assistant", "content": answer})
        self._finish_metrics(metrics, compress_before)
        return TurnResult(answer, new_ids, metrics, cancelled=stop_reason == "cancelled", stop_reason=stop_reason,
                          prompt_ids=ids)

    def _finish_metrics(self, metrics: TurnMetrics, compress_before: float) -> None:
        release_free_heap()  # the answer is complete: what the prefill freed goes back (kvchat/runtime.py)
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

    def set_recall(self, recall: int, on_progress: ProgressFn | None = None,
                   cancel: threading.Event | None = None) -> bool:
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
    def restore(
        self,
        cache_meta: dict[str, Any],
        layer_states: list[dict[str, Any]],
        token_ids: list[int],
        messages: list[dict[str, str]],
        spans: list[Span] | None = None,
        rng_state: bytes | None = None,
    ) -> None:
        """Continue exactly where a saved session stopped: its cache state, the token ids
        it fed, its transcript, its spans (None: derived from the transcript) and its
        sampling generator. Raises KeyError, ValueError or RuntimeError when the state
        does not fit this session's cache."""
        with self._lock:
            self.cache.load_layer_states(cache_meta, layer_states)
            self.token_ids = list(token_ids)
            self.messages = [dict(m) for m in messages]
            self.spans = list(spans) if spans is not None else self.spans_from_messages()
            if rng_state is not None:
                self.rng.set_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))

    def rng_state(self) -> bytes:
        """The sampling generator's state (what `restore` takes back)."""
        return self.rng.get_state().numpy().tobytes()

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
            self.spans = self.spans_from_messages()
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
        self.feed_transcript(self._transcript_ids(messages), messages, on_progress, cancel)

    def _transcript_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of a whole conversation, after this session's system prompt."""
        tokenizer = self.engine.tokenizer
        text = tokenizer.apply_chat_template(self._with_system(messages), add_generation_prompt=False, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)

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
            self._check_template(system)
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
                self.feed(self._transcript_ids(self.messages), on_progress, cancel)
            except BaseException:
                self.system, self.cache, self.token_ids, self.spans = before
                raise
            self.spans = self.spans_from_messages()
            return True

    # -- what the cache still holds -----------------------------------------------------
    def spans_from_messages(self) -> list[Span]:
        """Spans re-derived from the transcript (one per message, no document split), for
        a conversation fed as one rendered text (a rebuild from the saved transcript):
        each message ends where the rendered conversation up to it ends."""
        spans: list[Span] = []
        start = 0
        tokenizer = self.engine.tokenizer
        conversation = self._with_system(self.messages)
        first = len(conversation) - len(self.messages)  # 1 after a system prompt of our own
        if first:  # the system prompt's own span, where the template renders it alone
            try:
                text = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=False, tokenize=False)
                start = min(len(tokenizer(text, add_special_tokens=False).input_ids), len(self.token_ids))
            except Exception:  # it counts as part of the first message then
                start = 0
            if start:
                spans.append(Span(0, start, "system", 0))
        for i, message in enumerate(self.messages):
            text = tokenizer.apply_chat_template(
                conversation[: first + i + 1], add_generation_prompt=message["role"] == "user", tokenize=False
            )
            end = min(len(tokenizer(text, add_special_tokens=False).input_ids), len(self.token_ids))
            if end > start:
                spans.append(Span(start, end, message["role"], i))
            start = max(start, end)
        return spans

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

    def memory_report(self, cell_layers: bool = True) -> dict[str, Any]:
        """The memory map as plain data (saved with each snapshot; what the app and
        `kvchat sessions show --memory` draw): "spans" [{start, end, role, kept}],
        "layers" [per layer: kept per span], "cells" (the same by position; per layer
        too unless `cell_layers` is False), "layer_entries" [entries per KV head per
        layer], the allocation, and the method, budget, tokens seen and KV bytes."""
        spans = self.memory_map()
        layer_count = len(spans[0].layers) if spans else 0
        with self._lock:
            entries = self.cache.layer_entries()
            seen = spans[-1].end if spans else 0
            step = max(1, -(-seen // MEMORY_CELLS))
            bounds = [(start, min(seen, start + step)) for start in range(0, seen, step)]
            by_position = self.cache.memory_map(bounds)
            return {
                "spans": [span.as_dict() for span in spans],
                "layers": [[round(span.layers[layer], 4) for span in spans] for layer in range(layer_count)],
                # The same by position: equal runs of tokens, oldest first (where inside a
                # long document the cache still holds tokens), all layers and per layer.
                "cells": {
                    "bounds": [list(b) for b in bounds],
                    "kept": [round(sum(col) / len(col), 4) for col in zip(*by_position)] if bounds else [],
                    **({"layers": [[round(x, 4) for x in row] for row in by_position] if bounds else []}
                       if cell_layers else {}),
                },
                "layer_entries": entries,
                # The allocation: middle entries each layer may keep, and its bytes now.
                "layer_budgets": self.cache.layer_budgets(),
                "layer_bytes": self.cache.layer_nbytes(),
                "method": self.cache.method,
                "budget": str(self.cache.budget),
                "tokens_seen": self.cache.tokens_seen,
                "kv_bytes": self.cache.nbytes(),
                **self.cache.recall_report([(s.start, s.end) for s in spans], bounds),
            }

    def stats(self) -> dict[str, Any]:
        rss, cuda = process_memory()
        return {
            "method": self.cache.method,
            "budget": str(self.cache.budget),
            "tokens_seen": self.cache.tokens_seen,
            "entries_per_head": self.cache.entries_per_head(),
            "kv_bytes": self.cache.nbytes(),
            "full_kv_bytes": self.cache.full_cache_bytes(),
            "rss_bytes": rss,
            "cuda_bytes": cuda,
            "recall": self.cache.recall,
            "cold_bytes": self.cache.cold_bytes(),
        }


def load_engine(options: ModelOptions, on_status: Callable[[str], None] | None = None) -> Engine:
    """Load the model `options` name and wrap it in an engine. `on_status` hears about
    one-off steps (the first start converts the embedded GGUF; default: a line on stderr)."""
    from kvchat.model.loading import load_model

    if options.threads is not None and options.threads < 1:
        raise SettingsError("--threads must be at least 1")
    if on_status is None:
        on_status = _status_line
    governor = ThreadGovernor(options.threads)
    governor.adjust()  # its first sample of the machine spans the load: no wait for one after
    with gc_paused():
        loaded = load_model(options.model, device=options.device, dtype=options.dtype, quant=options.quant,
                            on_status=on_status)
    engine = Engine(loaded, governor=governor)
    gc.freeze()  # what exists now lives as long as the process: see models.gc_paused
    release_free_heap()  # the load's conversions are done with
    return engine


def _status_line(message: str) -> None:
    print(f"kvchat: {message}", file=sys.stderr, flush=True)
