"""Searching the saved conversations: the FTS5 index of migration m003 on real
SQLite files, the user's text taken as plain words, snippets, deletes, the upgrade of
a database from before the index, and `kvchat sessions search`."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlite_utils import Database

from kvchat.cli import main
from kvchat.errors import StoreError
from kvchat.storage.db import Store
from kvchat.storage.migrations import SCHEMA_VERSION, m001_initial, m002_snapshot_parent
from kvchat.storage.rows import SessionMatch
from kvchat.storage.search import match_query, shape_snippet

LONG_FILLER = " ".join(f"word{i}" for i in range(200))


def new_session(store: Store, title: str) -> int:
    return store.create_session(title, "smollm2-135m:abc", "window", {})


def indexed_rows(store: Store) -> int:
    """Documents in the index (one docsize row per indexed message)."""
    return store.db.execute("SELECT count(*) FROM messages_fts_docsize").fetchone()[0]


def check_index(store: Store) -> None:
    """FTS5's own check that the index holds exactly the messages table's text (rank 1:
    against the external content too); raises on any difference."""
    store.db.execute("INSERT INTO messages_fts (messages_fts, rank) VALUES ('integrity-check', 1)")


@pytest.fixture
def chats(store: Store) -> dict[str, int]:
    """Three sessions, created oldest first."""
    ids = {}
    ids["dragons"] = new_session(store, "Dragons")
    store.add_message(ids["dragons"], "user", "Tell me a story about the dragon\nwho learns to read.", [1])
    store.add_message(ids["dragons"], "assistant", "Once upon a time a small dragon found a library.", [2])
    ids["capitals"] = new_session(store, "Capitals")
    store.add_message(ids["capitals"], "user", "What is the capital of France?", [1])
    store.add_message(ids["capitals"], "assistant", "Paris is the capital of France.", [2])
    ids["syntax"] = new_session(store, "Query syntax")
    store.add_message(ids["syntax"], "user", 'Explain the "quotes" AND stars * - (unbalanced and NOT operators', [1])
    return ids


# -- the user's text -------------------------------------------------------------------------


def test_user_text_becomes_quoted_words_with_the_last_a_prefix() -> None:
    assert match_query("dragon") == '"dragon"*'
    assert match_query("  capital   of\tFrance ") == '"capital" "of" "France"*'
    assert match_query('say "hi" AND *') == '"say" """hi""" "AND"*'
    assert match_query("NEAR(a b) col:x ^y") == '"NEAR(a" "b)" "col:x" "^y"*'
    for nothing in ("", "   ", "*", "-", "( )", '" "', "--- ***", "___"):
        assert match_query(nothing) == "", nothing


def test_snippet_is_one_line_with_the_matches_marked() -> None:
    text, marks = shape_snippet("…the \x02dragon\x03\n\n  who \x02reads\x03…")
    assert text == "…the dragon who reads…"
    assert [text[a:b] for a, b in marks] == ["dragon", "reads"]
    assert shape_snippet("") == ("", ())
    assert shape_snippet("no \x02\x03 empty mark, stray \x03 end") == ("no  empty mark, stray  end", ())


# -- search on a real store ------------------------------------------------------------------


def test_search_finds_the_sessions_newest_first_with_a_snippet(store: Store, chats: dict[str, int]) -> None:
    found = store.search("capital")
    assert [r.id for r in found] == [chats["capitals"]]
    row = found[0]
    assert isinstance(row, SessionMatch) and row.title == "Capitals" and row.message_count == 2
    assert row.matches == 2
    assert [row.snippet[a:b] for a, b in row.marks] == ["capital"]
    assert "capital of France" in row.snippet
    # "the" is in three sessions' messages: newest session first; an older one that gets a
    # new message moves to the top.
    assert [r.id for r in store.search("the")] == [chats["syntax"], chats["capitals"], chats["dragons"]]
    store.add_message(chats["dragons"], "user", "And a second dragon?", [3])
    assert [r.id for r in store.search("the")] == [chats["dragons"], chats["syntax"], chats["capitals"]]
    assert [r.id for r in store.search("dragon")] == [chats["dragons"]]
    assert store.search("dragon", limit=0) == []


def test_the_snippet_comes_from_the_best_ranked_message_and_is_short(store: Store) -> None:
    sid = new_session(store, "ranking")
    store.add_message(sid, "user", f"{LONG_FILLER} a single telescope mention {LONG_FILLER}", [1])
    store.add_message(sid, "assistant", "Telescope, telescope: the telescope.", [2])
    store.add_message(sid, "user", "Nothing to see here.", [3])
    (row,) = store.search("telescope")
    assert row.matches == 2
    assert row.snippet == "Telescope, telescope: the telescope."  # bm25 prefers the dense short one
    assert len(row.marks) == 3
    # Alone, the long message gives a window of words around the match, cut with "…".
    store.db.execute("DELETE FROM messages WHERE session_id = ? AND role = 'assistant'", [sid])
    (row,) = store.search("telescope")
    assert row.matches == 1 and row.snippet.startswith("…") and row.snippet.endswith("…")
    assert "single telescope mention" in row.snippet and len(row.snippet.split()) <= 12
    assert [row.snippet[a:b] for a, b in row.marks] == ["telescope"]


def test_words_all_match_in_one_message_and_only_the_last_is_a_prefix(store: Store, chats: dict[str, int]) -> None:
    assert [r.id for r in store.search("drag")] == [chats["dragons"]]
    assert [r.id for r in store.search("small dragon libr")] == [chats["dragons"]]
    assert store.search("drag small") == []  # "drag" is not a whole word there
    assert store.search("Paris story") == []  # in two different sessions, never one message
    assert [r.id for r in store.search("PARIS")] == [chats["capitals"]]  # case folded


@pytest.mark.parametrize(
    "text",
    [
        '"',
        '"quotes',
        'quotes"',
        "'",
        "AND",
        "OR",
        "NOT",
        "and or not",
        "*",
        "-",
        "-quotes",
        "(",
        ")",
        "(unbalanced",
        "NEAR(",
        "NEAR(quotes stars)",
        "stars *",
        "a*b",
        "col:quotes",
        "text:quotes",
        "^quotes",
        "{quotes}",
        "+",
        "\\",
        "%_",
        ":",
        "quotes AND",
        "AND quotes",
        "🐉",
        "x" * 5000,
        "\x00",
        "\x02quotes\x03",
        ";DROP TABLE messages;--",
    ],
)
def test_query_syntax_in_user_text_never_raises(store: Store, chats: dict[str, int], text: str) -> None:
    found = store.search(text)
    assert all(isinstance(r, SessionMatch) for r in found)
    assert indexed_rows(store) == 5


def test_query_syntax_characters_are_plain_text(store: Store, chats: dict[str, int]) -> None:
    syntax = [chats["syntax"]]
    assert [r.id for r in store.search('"quotes"')] == syntax
    assert [r.id for r in store.search("AND")] == syntax  # the word "and", not an operator
    assert [r.id for r in store.search("NOT operators")] == syntax
    assert [r.id for r in store.search("(unbalanced")] == syntax
    assert [r.id for r in store.search("stars * -")] == syntax  # punctuation alone is no word
    assert store.search("NOT capital") == []  # "not" must be in the message too
    assert store.search("* - ( )") == []


def test_deleting_a_session_takes_its_messages_out_of_the_index(store: Store, chats: dict[str, int]) -> None:
    assert indexed_rows(store) == 5
    store.delete_session(chats["dragons"])
    assert store.search("dragon") == []
    assert [r.id for r in store.search("the")] == [chats["syntax"], chats["capitals"]]
    # delete_session deletes the messages with plain DELETE statements, so the AFTER
    # DELETE trigger ran for each: the index holds the 3 messages left and nothing else.
    assert indexed_rows(store) == 3
    check_index(store)
    # No path removes messages behind the trigger's back: the foreign keys do not
    # cascade, so deleting a session row that still has messages is refused.
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        store.db.execute("DELETE FROM sessions WHERE id = ?", [chats["capitals"]])
    assert [r.id for r in store.search("capital")] == [chats["capitals"]]


def test_the_index_follows_inserts_and_updates(store: Store, chats: dict[str, int]) -> None:
    sid = chats["capitals"]
    messages = store.messages(sid)
    store.save_turn(sid, [{"role": "user", "text": "And of Italy?", "token_ids": [5]}], 2, {}, [])
    assert [r.id for r in store.search("italy")] == [sid]
    store.db.execute("UPDATE messages SET text = 'Rome' WHERE id = ?", [messages[1].id])
    assert store.search("rome")[0].matches == 1
    assert store.search("paris") == []
    check_index(store)


# -- a database from before the index ---------------------------------------------------------

OLD_MESSAGES = [
    (1, "user", "Where do penguins live?"),
    (1, "assistant", "Penguins live in the southern hemisphere,\nmostly around Antarctica."),
    (2, "user", "Résumé of the café meeting: “naïve” plans & 50% budget"),
    (2, "assistant", "Done."),
]


def test_a_database_from_before_search_is_indexed_on_open_and_loses_nothing(db_path: Path) -> None:
    db = Database(db_path)  # what kvchat wrote with schema 2 (m001 + m002)
    db["_migrations"].create({"name": str, "applied_at": str}, pk="name")
    for migration in (m001_initial, m002_snapshot_parent):
        migration(db)
        db["_migrations"].insert({"name": migration.__name__, "applied_at": "2026-01-01"})
    for sid, updated in ((1, "2026-01-02T00:00:00"), (2, "2026-01-03T00:00:00")):
        db["sessions"].insert(
            {
                "id": sid,
                "title": f"old {sid}",
                "model_fingerprint": "m",
                "method": "full",
                "params": "{}",
                "created": "2026-01-01",
                "updated": updated,
            }
        )
    for sid, role, text in OLD_MESSAGES:
        db["messages"].insert(
            {
                "session_id": sid,
                "role": role,
                "text": text,
                "token_ids": "[1, 2]",
                "metrics": "{}",
                "created": "2026-01-01",
            }
        )
    before = {t: db.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("sessions", "messages")}
    db.conn.close()

    with Store(db_path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        assert [r.id for r in s.search("penguins")] == [1]
        (row,) = s.search("antarctica")
        assert row.snippet == "Penguins live in the southern hemisphere, mostly around Antarctica."
        assert [r.id for r in s.search("cafe naive")] == [2]  # diacritics folded
        assert [r.id for r in s.search("the")] == [2, 1]  # newest first
        assert indexed_rows(s) == len(OLD_MESSAGES)
        check_index(s)
        for table, rows in before.items():  # later migrations may add columns after these
            width = len(rows[0])
            assert [row[:width] for row in s.db.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()] == rows
        s.add_message(1, "user", "And puffins?", [3])  # the trigger indexes what comes next
        assert [r.id for r in s.search("puffins")] == [1]
    with Store(db_path) as s:  # opened again: nothing re-applied, still searchable
        assert s.schema_version() == SCHEMA_VERSION and [r.id for r in s.search("puffin")] == [1]


def test_an_sqlite_without_fts5_is_a_clear_error_and_leaves_the_file_as_it_was(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlite_utils.db import Table

    def no_fts5(self, *args, **kwargs):
        raise sqlite3.OperationalError("no such module: fts5")

    monkeypatch.setattr(Table, "enable_fts", no_fts5)
    with pytest.raises(StoreError, match="has no FTS5 full-text search"):
        Store(db_path)
    with sqlite3.connect(db_path) as conn:  # the migrations ran in one transaction, rolled back
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []


def test_a_failed_search_is_a_store_error(store: Store, chats: dict[str, int]) -> None:
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.search("dragon")


# -- kvchat sessions search -------------------------------------------------------------------


def run_cli(capsys, db_path: Path, *args: str) -> tuple[int, str, str]:
    code = main(["sessions", "search", "--db", str(db_path), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_search_prints_one_line_per_session(store: Store, chats: dict[str, int], db_path: Path, capsys) -> None:
    code, out, err = run_cli(capsys, db_path, "the")
    lines = out.splitlines()
    assert code == 0 and err == "" and len(lines) == 3
    assert [int(line.split()[0]) for line in lines] == [chats["syntax"], chats["capitals"], chats["dragons"]]
    updated = store.get_session(chats["dragons"]).updated[:16].replace("T", " ")
    assert lines[2].startswith(f"{chats['dragons']:>4}  {updated}  Dragons  ")
    assert "story about the dragon who learns" in lines[2]
    # Both messages match as well (same words, same length): the newer one is shown.
    code, out, _ = run_cli(capsys, db_path, "capital", "of", "France")
    updated = store.get_session(chats["capitals"]).updated[:16].replace("T", " ")
    assert code == 0 and out.splitlines() == [
        f"{chats['capitals']:>4}  {updated}  Capitals  Paris is the capital of France."
    ]


def test_cli_search_says_when_nothing_matches(store: Store, chats: dict[str, int], db_path: Path, capsys) -> None:
    code, out, err = run_cli(capsys, db_path, "zebra")
    assert (code, out, err) == (0, "no saved session has a message matching 'zebra'\n", "")
    code, out, err = run_cli(capsys, db_path, "NOT", '"(', "AND", "zebra")
    assert code == 0 and out.startswith("no saved session has a message matching")
    code, out, err = run_cli(capsys, db_path, "--", "-", "*", "(")
    assert code == 2 and out == ""
    assert err == "kvchat: error: nothing to search for in '- * (': give words (letters or digits)\n"
