"""What a turn gives back, as plain data: its text and token ids, its metrics, and the
spans of the conversation each fed token belongs to. No torch here: front ends and the
store read these without loading the model's stack."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvchat.model.session import ChatSession

ProgressFn = Callable[[int, int], None]
TokenFn = Callable[[str], None]


def user_message(question: str, document: str | None = None) -> str:
    """The text sent for `question` about `document`: the document, when given, comes first."""
    return question if not document else f"{document.rstrip()}\n\n{question}"


@dataclass
class TurnMetrics:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    compress_s: float = 0.0
    kv_bytes: int = 0
    full_kv_bytes: int = 0
    entries_per_head: int = 0
    tokens_seen: int = 0
    rss_bytes: int = 0
    cuda_bytes: int = 0
    prefill_mode: str = ""
    # The recall tier (kvchat/recall/tier.py; 0 when off): bytes of exact cold keys and values
    # on disk (kv_bytes counts RAM only), and cold tokens attended per KV head and step
    # during the answer, averaged over its decode steps and the layers.
    cold_bytes: int = 0
    recalled: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Span:
    """Fed tokens [start, end) that belong to one part of one message."""

    start: int
    end: int
    role: str  # system | user | document | assistant
    message: int  # index into ChatSession.messages

    def as_list(self) -> list[Any]:
        return [self.start, self.end, self.role, self.message]


@dataclass(frozen=True)
class MemorySpan:
    """A span and the share of its tokens the cache still represents: `kept` averaged
    over layers and KV heads, `layers` per layer."""

    start: int
    end: int
    role: str
    message: int
    kept: float
    layers: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        """The public shape (`kvchat ask --json`'s "memory")."""
        return {"start": self.start, "end": self.end, "role": self.role, "kept": round(self.kept, 4)}


def group_spans(labels: list[str], offset: int, message: int) -> list[Span]:
    """Runs of equal labels as spans, the first token at index `offset`."""
    spans: list[Span] = []
    for i, label in enumerate(labels):
        if spans and spans[-1].role == label and spans[-1].end == offset + i:
            spans[-1] = replace(spans[-1], end=offset + i + 1)
        else:
            spans.append(Span(offset + i, offset + i + 1, label, message))
    return spans


@dataclass
class TurnResult:
    text: str
    token_ids: list[int]
    metrics: TurnMetrics
    cancelled: bool = False
    stop_reason: str = "end"  # end | length | cancelled
    prompt_ids: list[int] = field(default_factory=list)  # the prompt tokens actually fed


# -- one question under several methods (kvchat.chat.compare) --------------------------------
SHARED = "exact-then-compress"
SEPARATE = "streaming"
JSON_KEYS = ("method", "answer", "kv_bytes", "ttft_s", "decode_tokens_per_s")


@dataclass
class MethodAnswer:
    """One method's answer and its figures.

    `ttft_s`: from the start of the comparison's prefill to this method's first token,
    as if the user had asked under this method alone: the prefill it waited on (the
    shared one, or its own in the streaming fallback) + its fork (copy and re-stream of
    the held prefill into the method) + the method's compression of the held prefill +
    choosing the first token. The other methods' answers, produced in between, are not
    counted."""

    method: str
    answer: str
    kv_bytes: int  # the method's cache after its answer (cache.nbytes())
    ttft_s: float
    decode_tokens_per_s: float
    new_tokens: int = 0
    prefill_s: float = 0.0  # the prefill this answer waited on
    compress_s: float = 0.0  # fork + compressing the held prefill (0 in the streaming fallback)
    stop_reason: str = "end"  # end | length | cancelled
    session: ChatSession | None = field(default=None, repr=False, compare=False)

    def as_json(self) -> dict[str, Any]:
        """Exactly the keys of `kvchat compare --json`."""
        return {
            "method": self.method, "answer": self.answer, "kv_bytes": self.kv_bytes,
            "ttft_s": round(self.ttft_s, 4), "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
        }


@dataclass
class Comparison:
    answers: list[MethodAnswer]
    prompt_tokens: int  # every token read for the question (history included)
    prefill_mode: str  # SHARED: one exact prefill forked; SEPARATE: one prefill per method
    prefill_s: float  # the shared prefill; 0.0 in the streaming fallback (each answer has its own)
    note: str = ""
    cancelled: bool = False
