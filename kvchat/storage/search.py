"""Full-text search over the messages: the user's text as an FTS5 query, the queries on
the `messages_fts` index (migration m003) and the snippet shown for each match.

The user's text is never FTS5 syntax: every whitespace-separated piece becomes a quoted
string (so `AND`, `*`, `-`, quotes and parentheses are plain characters), the pieces
must all appear in one message, and the last one also matches longer words (`drag`
finds `dragon`), which is what searching as you type needs. Punctuation inside a piece
is a word break, as the tokenizer sees it (`don't` is the phrase `don t`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from sqlite_utils import Database

FTS_TABLE = "messages_fts"
SNIPPET_TOKENS = 12  # words of context around a match (FTS5 allows up to 64)
ELLIPSIS = "…"
# Where FTS5 puts the start and end of each matched word in a snippet; taken out again
# by `shape_snippet`, which reports them as offsets.
_OPEN, _CLOSE = "\x02", "\x03"
# A piece is searched only if the tokenizer (unicode61) finds a word in it: letters or
# digits; underscores and other punctuation are separators.
_WORD = re.compile(r"[^\W_]")


def match_query(text: str) -> str:
    """The FTS5 MATCH expression for `text` taken as plain words ("" when it has none)."""
    pieces = [piece for piece in str(text).split() if _WORD.search(piece)]
    if not pieces:
        return ""
    quoted = ['"' + piece.replace('"', '""') + '"' for piece in pieces]
    quoted[-1] += "*"
    return " ".join(quoted)


def best_messages(db: Database, query: str) -> dict[int, tuple[int, int]]:
    """{session id: (id of its best-ranked matching message, how many of its messages
    match)} for a `match_query` expression. Best = lowest bm25; a tie goes to the newer
    message."""
    sql = f"""
        SELECT sid, mid, n FROM (
            SELECT m.session_id AS sid, m.id AS mid,
                   count(*) OVER (PARTITION BY m.session_id) AS n,
                   row_number() OVER (PARTITION BY m.session_id
                                      ORDER BY bm25([{FTS_TABLE}]), m.id DESC) AS pick
            FROM [{FTS_TABLE}] JOIN messages m ON m.id = [{FTS_TABLE}].rowid
            WHERE [{FTS_TABLE}] MATCH ?
        ) WHERE pick = 1
    """
    return {int(sid): (int(mid), int(n)) for sid, mid, n in db.execute(sql, [query])}


def snippets(db: Database, query: str, message_ids: Iterable[int]) -> dict[int, str]:
    """{message id: raw FTS5 snippet around the match} for these messages."""
    sql = f"""
        SELECT rowid, snippet([{FTS_TABLE}], 0, ?, ?, ?, ?) FROM [{FTS_TABLE}]
        WHERE [{FTS_TABLE}] MATCH ? AND rowid IN (SELECT value FROM json_each(?))
    """
    ids = json.dumps([int(i) for i in message_ids])
    rows = db.execute(sql, [_OPEN, _CLOSE, ELLIPSIS, SNIPPET_TOKENS, query, ids])
    return {int(mid): str(raw or "") for mid, raw in rows}


def shape_snippet(raw: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """One line of text (runs of whitespace, newlines included, become one space) and the
    (start, end) offsets of the matched words in it."""
    text: list[str] = []
    marks: list[tuple[int, int]] = []
    start: int | None = None
    length = 0
    for part in re.split(f"([{_OPEN}{_CLOSE}])", " ".join(raw.split())):
        if part == _OPEN:
            start = length
        elif part == _CLOSE:
            if start is not None and length > start:
                marks.append((start, length))
            start = None
        else:
            text.append(part)
            length += len(part)
    return "".join(text), tuple(marks)
