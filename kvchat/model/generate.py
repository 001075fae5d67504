"""The decode loop: sample a token, stream its text, feed it back, until an end-of-turn
token, the token limit or a cancel. One token per step through kvchat's cache (not
transformers' `generate`), so that every step sees the cache's compression and recall."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvchat.model.sampling import sample
from kvchat.settings import SamplingSettings
from kvchat.turns import TokenFn

if TYPE_CHECKING:
    from kvchat.cache.compressed_cache import CompressedCache
    from kvchat.model.engine import Engine

# Decode steps between two looks at how many cores are free (kvchat/runtime.py).
THREAD_CHECK_STEPS = 16


class TextStream:
    """Incremental detokenisation: the text of each new token, once its bytes form whole
    characters (a multi-byte character split across tokens decodes to U+FFFD until it is
    complete). Decodes only the tokens since the last emitted piece (plus the piece
    before, for context), not the whole answer on every step."""

    def __init__(self, tokenizer: Any, on_piece: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.on_piece = on_piece
        self.emitted = ""
        self._prefix_at = self._read_at = 0

    def push(self, ids: list[int]) -> None:
        """`ids`: the answer so far, its newest token last."""
        before = self.tokenizer.decode(ids[self._prefix_at : self._read_at], skip_special_tokens=True)
        current = self.tokenizer.decode(ids[self._prefix_at :], skip_special_tokens=True)
        if len(current) > len(before) and not current.endswith("\ufffd"):
            piece = current[len(before) :]
            self.on_piece(piece)
            self.emitted += piece
            self._prefix_at, self._read_at = self._read_at, len(ids)

    def finish(self, answer: str) -> None:
        """Emit whatever of the whole decoded `answer` was held back."""
        if answer.startswith(self.emitted) and len(answer) > len(self.emitted):
            self.on_piece(answer[len(self.emitted) :])


@dataclass
class Decoded:
    new_ids: list[int]
    stop_reason: str  # "end", "length" or "cancelled"
    ttft_s: float | None  # from `start` to the first sampled token; None when none was sampled
    decode_s: float


def decode(
    engine: Engine,
    cache: CompressedCache,
    logits: Tensor,
    sampling: SamplingSettings,
    rng: torch.Generator,
    fed: list[int],
    start: float,
    on_token: TokenFn | None = None,
    cancel: threading.Event | None = None,
) -> Decoded:
    """Generate from `logits` (the last prompt position's) until a stop. Every token fed
    back is appended to `fed`, the conversation's token ids."""
    stream = TextStream(engine.tokenizer, on_token) if on_token is not None else None
    new_ids: list[int] = []
    stop_reason = "length"
    ttft: float | None = None
    decode_start = time.perf_counter()
    for step in range(sampling.max_new_tokens):
        if cancel is not None and cancel.is_set():
            stop_reason = "cancelled"
            break
        if step % THREAD_CHECK_STEPS == 0:
            engine.threads.adjust()
        token = sample(logits, sampling, rng)
        if step == 0:
            ttft = time.perf_counter() - start
        if token in engine.stop_ids:
            stop_reason = "end"
            break
        new_ids.append(token)
        if stream is not None:
            stream.push(new_ids)
        logits = engine.forward([token], cache)
        fed.append(token)
    decode_s = time.perf_counter() - decode_start
    if stream is not None:
        stream.finish(engine.tokenizer.decode(new_ids, skip_special_tokens=True))
    return Decoded(new_ids, stop_reason, ttft, decode_s)
