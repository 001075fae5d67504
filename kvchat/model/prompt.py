"""The model's chat template over a conversation: what the next message feeds, and which
part of the conversation each fed token belongs to.

The cache has already seen every token fed so far, so a new user message feeds only the
rendered conversation minus that prefix. Each fed token gets a role label (the message
itself "user", an attached document inside it "document", the template around it) so
that the memory map can say what the cache still holds of each part.
"""

from __future__ import annotations

import bisect
import itertools
import os
from typing import Any, NamedTuple

from kvchat.errors import SettingsError
from kvchat.turns import Span, document_outline

Messages = list[dict[str, str]]


class Prompt(NamedTuple):
    """What the next message feeds: its token ids, a role label per id, and the pages or
    chapters of its attached files as (start, end, file, part) over those ids."""

    ids: list[int]
    labels: list[str]
    parts: list[tuple[int, int, str, str]]


class ChatTemplate:
    """A tokenizer's chat template, rendered with or without a system prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @staticmethod
    def with_system(messages: Messages, system: str | None) -> Messages:
        """`messages` as the chat template gets them: after the system prompt, when there is one."""
        return [{"role": "system", "content": system}, *messages] if system is not None else list(messages)

    def check_system(self, system: str) -> None:
        """Refuse a system prompt the model's chat template cannot render (some have no system role)."""
        try:
            self.render([{"role": "user", "content": "."}], system)
        except Exception as err:
            raise SettingsError(f"this model's chat template takes no system prompt ({err})") from None

    def render(self, messages: Messages, system: str | None) -> str:
        return self.tokenizer.apply_chat_template(
            self.with_system(messages, system), add_generation_prompt=True, tokenize=False
        )

    def prompt(
        self,
        user_text: str,
        messages: Messages,
        token_ids: list[int],
        system: str | None,
        document: str | None = None,
    ) -> Prompt:
        """The next user message after `messages`, whose tokens `token_ids` the cache has
        seen. The message's own text is "user", the attached document inside it
        "document", the chat template around it "user" (before the first message:
        "system", the template's system prompt); each page or chapter of an attached file
        runs from the token that holds its marker line to the next marker or heading."""
        full = self.render(list(messages) + [{"role": "user", "content": user_text}], system)
        fed = self.tokenizer.decode(token_ids, skip_special_tokens=False) if token_ids else ""
        common = os.path.commonprefix([full, fed])
        new_text = full[len(common) :]
        try:
            encoded = self.tokenizer(new_text, add_special_tokens=False, return_offsets_mapping=True)
            offsets = list(encoded["offset_mapping"])
        except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer has no offsets
            encoded, offsets = self.tokenizer(new_text, add_special_tokens=False), []
        ids = list(encoded.input_ids)
        content_at = new_text.rfind(user_text) if user_text else -1
        before = "system" if not token_ids else "user"
        doc = (document or "").rstrip()
        doc_at = user_text.find(doc) if doc else -1
        if not offsets:  # no character offsets: the whole prompt counts as the message
            return Prompt(ids, ["user"] * len(ids), [])
        labels = []
        for i in range(len(ids)):
            char = offsets[i][0]
            if content_at < 0 or char < content_at:
                labels.append(before if content_at >= 0 else "user")
            elif doc_at >= 0 and content_at + doc_at <= char < content_at + doc_at + len(doc):
                labels.append("document")
            else:
                labels.append("user")
        parts = document_parts(doc, content_at + doc_at, offsets, labels) if doc_at >= 0 and content_at >= 0 else []
        return Prompt(ids, labels, parts)

    def transcript_ids(self, messages: Messages, system: str | None) -> list[int]:
        """The token ids of a whole conversation, after the system prompt."""
        text = self.tokenizer.apply_chat_template(
            self.with_system(messages, system), add_generation_prompt=False, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def spans(self, messages: Messages, fed: int, system: str | None) -> list[Span]:
        """Spans re-derived from the transcript (one per message, no document split), for
        a conversation fed as one rendered text of `fed` tokens (a rebuild from the saved
        transcript): each message ends where the rendered conversation up to it ends."""
        spans: list[Span] = []
        start = 0
        conversation = self.with_system(messages, system)
        first = len(conversation) - len(messages)  # 1 after a system prompt of our own
        if first:  # the system prompt's own span, where the template renders it alone
            try:
                text = self.tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=False, tokenize=False)
                start = min(len(self.tokenizer(text, add_special_tokens=False).input_ids), fed)
            except Exception:  # it counts as part of the first message then
                start = 0
            if start:
                spans.append(Span(0, start, "system", 0))
        for i, message in enumerate(messages):
            text = self.tokenizer.apply_chat_template(
                conversation[: first + i + 1], add_generation_prompt=message["role"] == "user", tokenize=False
            )
            end = min(len(self.tokenizer(text, add_special_tokens=False).input_ids), fed)
            if end > start:
                spans.append(Span(start, end, message["role"], i))
            start = max(start, end)
        return spans


def document_parts(
    document: str, at: int, offsets: list[tuple[int, int]], labels: list[str]
) -> list[tuple[int, int, str, str]]:
    """The pages and chapters of `document`, which starts at character `at` of the text
    that `offsets` map, as (start, end, file, part) over its tokens."""
    outline = document_outline(document)
    if not outline or "document" not in labels:
        return []
    end = len(labels) - labels[::-1].index("document")  # past the document's last token
    stops = list(itertools.accumulate((stop for _, stop in offsets), max))
    # Each entry starts at the token that holds its first character: a marker's line
    # break may share a token with the text before it.
    starts = [min(bisect.bisect_right(stops, at + entry.at), end) for entry in outline]
    return [
        (start, min(stop, end), entry.document, entry.part)
        for entry, start, stop in zip(outline, starts, starts[1:] + [end])
        if entry.part and stop > start
    ]
