"""`kvchat sessions list|show|delete` and what the sessions take on disk (no model): the
size column and the total, a session's size and its recall tier, a delete that says what
it gave back, a tier the disk budget dropped, and `--disk-budget`'s one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import cold_layers

from kvchat.cli import main
from kvchat.settings import human_size, parse_disk_budget
from kvchat.storage.db import Store


def sessions(capsys, db_path: Path, *args: str) -> tuple[int, str, str]:
    code = main(["sessions", *args, "--db", str(db_path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def saved(store: Store, title: str, rows: int) -> int:
    """A session with a question, its answer and a recall tier of `rows` rows in 2 layers."""
    sid = store.create_session(title, "fp", "window", {})
    messages = [
        {"role": "user", "text": f"{title}?", "token_ids": [1]},
        {"role": "assistant", "text": "Yes.", "token_ids": [2]},
    ]
    store.save_turn(sid, messages, 1, {"tokens_seen": rows}, [{}, {}], cold_rows=cold_layers(2, rows, title))
    return sid


@pytest.fixture
def two(db_path: Path) -> tuple[int, int]:
    with Store(db_path) as store:
        return saved(store, "Small", 10), saved(store, "Large", 3000)


def test_list_shows_each_session_s_size_and_what_they_take_together(capsys, db_path, two):
    small, large = two
    with Store(db_path) as store:
        rows = {r.id: r for r in store.list_sessions()}
    code, out, err = sessions(capsys, db_path, "list")
    *lines, total = out.splitlines()
    assert (code, err) == (0, "")
    assert lines[0].startswith(f"{large:>4}") and f"  {human_size(rows[large].disk_bytes):>8}  Large" in lines[0]
    assert lines[1].startswith(f"{small:>4}") and f"  {human_size(rows[small].disk_bytes):>8}  Small" in lines[1]
    together = human_size(rows[small].disk_bytes + rows[large].disk_bytes)
    assert total.startswith(f"2 sessions, {together}; the file {db_path} takes ") and total.endswith(" MB")


def test_show_says_what_a_session_takes_and_its_recall_tier(capsys, db_path, two):
    _, large = two
    with Store(db_path) as store:
        row = store.get_session(large)
    code, out, _ = sessions(capsys, db_path, "show", str(large))
    assert code == 0
    assert out.splitlines()[0] == (f"on disk: {human_size(row.disk_bytes)} (recall tier {human_size(row.cold_bytes)})")


def test_delete_says_what_it_gave_back_and_the_file_shrinks(capsys, db_path, two):
    small, large = two
    with Store(db_path) as store:
        size = store.get_session(large).disk_bytes
        before = store.file_bytes()
    code, out, _ = sessions(capsys, db_path, "delete", str(large))
    assert (code, out) == (0, f"deleted session {large} (Large, {human_size(size)})\n")
    with Store(db_path) as store:
        assert before - store.file_bytes() >= size * 0.95
        assert [r.id for r in store.list_sessions()] == [small]


def test_a_dropped_tier_is_named_in_the_list_and_in_show(capsys, db_path, two):
    small, large = two
    with Store(db_path, disk_budget=1) as store:
        store.fit_disk_budget(keep=small)
        when = store.get_session(large).tier_dropped
    _, out, _ = sessions(capsys, db_path, "list")
    assert out.splitlines()[0].endswith("Large  (recall tier dropped)")
    _, out, _ = sessions(capsys, db_path, "show", str(large))
    assert out.splitlines()[0].endswith(f"(recall tier dropped {when[:10]} under the disk budget)")


@pytest.mark.parametrize("value", ["lots", "2 parsecs", "0", "0.0001KB"])
def test_a_bad_disk_budget_is_a_one_line_error_naming_the_forms(capsys, tmp_path, value):
    with pytest.raises(SystemExit) as done:
        main(["ask", "hi", "--disk-budget", value, "--db", str(tmp_path / "kv.db")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1
    assert "--disk-budget" in lines[0] and "500MB, 2GB, 1.5GiB" in lines[0]


@pytest.mark.parametrize(
    ("value", "size"),
    [("2GB", 2 * 10**9), ("500 MB", 5 * 10**8), ("1.5GiB", 3 * 2**29), ("123456", 123456), ("off", None), (None, None)],
)
def test_a_disk_budget_is_a_size_or_off(value, size):
    assert parse_disk_budget(value) == size
