"""Smoke test of branches in a real terminal: tmux runs `python -m kvchat` on a fresh
database, we say two things, press F3 and regenerate the last answer, and read off the
screen that a branch opened and that the sessions list says where it came from."""

from __future__ import annotations

import re
import sys
import time

from kvchat.storage.db import Store

from .test_smoke_tmux import REPO, Tmux, pytestmark  # noqa: F401  (slow, and skipped without tmux)

READY = r"ready │ decode"


def saved_messages(db) -> int:
    if not db.exists():
        return 0
    with Store(db) as store:
        return sum(row.message_count for row in store.list_sessions())


def say(tmux: Tmux, db, text: str) -> None:
    """Type `text`, send it, and wait until its turn is saved (the app saves a turn
    before it says "ready" again, so the screen alone could be read too early)."""
    before = saved_messages(db)
    tmux.run("send-keys", "-t", "app", "-l", text)
    tmux.wait_for(re.escape(text), 10)
    tmux.run("send-keys", "-t", "app", "Enter")
    deadline = time.monotonic() + 120
    while saved_messages(db) < before + 2:
        assert time.monotonic() < deadline, f"the turn {text!r} was not saved within 120 s"
        time.sleep(0.5)
    tmux.wait_for(READY, 30)


def test_branch_in_a_real_terminal(tmp_path):
    db = tmp_path / "branch.db"
    command = (
        f"cd {REPO} && {sys.executable} -m kvchat --db {db} --max-new-tokens 8 "
        "--method window --budget 16 --window 16; sleep 30"
    )
    tmux = Tmux()
    try:
        tmux.run("new-session", "-d", "-s", "app", "-x", "110", "-y", "34", "-e", "TERM=xterm-256color", command)
        tmux.wait_for(READY, 240)
        say(tmux, db, "Name a colour.")
        say(tmux, db, "Another one?")
        tmux.run("send-keys", "-t", "app", "F3")
        tmux.wait_for(r"Branch from one of your messages[\s\S]*1  Name a colour\.[\s\S]*2  Another one\?", 10)
        tmux.run("send-keys", "-t", "app", "r")  # regenerate the highlighted (last) message's answer
        tmux.wait_for(r"Session 2: a branch of session 1 at turn 1", 60)
        tmux.wait_for(READY, 120)
        tmux.run("send-keys", "-t", "app", "C-s")
        tmux.wait_for(r"Name a colour\.\s+↳ branch of #1 at turn 1", 20)
        tmux.run("send-keys", "-t", "app", "Escape")
        tmux.wait_for(READY, 10)
        tmux.run("send-keys", "-t", "app", "C-q")
        deadline = time.monotonic() + 30
        while "kvchat — " in tmux.screen() and time.monotonic() < deadline:
            time.sleep(0.5)
        with Store(db) as store:
            rows = {row.id: row for row in store.list_sessions()}
            assert sorted(rows) == [1, 2]
            assert rows[1].origin() == "" and rows[1].message_count == 4
            assert rows[2].origin() == "branch of #1 at turn 1" and rows[2].message_count == 4
            assert [m.text for m in store.messages(2)][::2] == ["Name a colour.", "Another one?"]
    finally:
        tmux.kill()
