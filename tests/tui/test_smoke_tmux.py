"""Smoke test in a real terminal: tmux runs `python -m kvchat`, we type a question,
read the screen with capture-pane, find the answer and the status bar, search the saved
sessions for it, attach a PDF with /file, and quit."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvchat.storage.db import Store

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"),
]


class Tmux:
    """One private tmux server (its own socket), so a user's tmux is never touched."""

    def __init__(self) -> None:
        self.socket = f"kvchat-test-{uuid.uuid4().hex[:8]}"

    def run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "app")

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            found = re.search(pattern, screen)
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} did not appear within {timeout:.0f} s; screen:\n{screen}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return (
            subprocess.run(["tmux", "-L", self.socket, "has-session", "-t", "app"], capture_output=True).returncode == 0
        )

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def test_app_in_a_real_terminal(tmp_path):
    from document_files import write_pdf

    db = tmp_path / "smoke.db"
    paper = write_pdf(tmp_path / "paper.pdf", 2)
    command = (
        f"cd {REPO} && {sys.executable} -m kvchat --db {db} --max-new-tokens 12 "
        "--method window --budget 16 --window 16; sleep 30"
    )
    tmux = Tmux()
    try:
        tmux.run("new-session", "-d", "-s", "app", "-x", "110", "-y", "34", "-e", "TERM=xterm-256color", command)
        tmux.wait_for(r"ready │ decode", 240)  # model loaded, app drawn, status bar up
        tmux.run("send-keys", "-t", "app", "-l", "What is the capital of France?")
        tmux.wait_for(r"What is the capital of France\?", 10)  # keys echo in the editor
        tmux.run("send-keys", "-t", "app", "Enter")
        status = tmux.wait_for(r"ready │ decode (\d+\.\d) tok/s", 120)
        screen = tmux.screen()
        assert "You" in screen and "kvchat · window" in screen
        assert re.search(r"window · budget 16 │ [\d,]+ seen → \d+ kept/head │ KV [\d.]+ MB", screen), screen
        assert float(status.group(1)) > 0
        answer = screen.split("kvchat · window", 1)[1]
        assert re.search(r"\w{3,}", answer.split("window · budget", 1)[0]), screen
        # F2: the memory map, read off the real terminal, then back to the chat.
        tmux.run("send-keys", "-t", "app", "F2")
        tmux.wait_for(r"Memory map", 10)
        held = tmux.wait_for(r"holds ([\d,]+) of ([\d,]+)\s+tokens", 30)
        assert 0 < int(held.group(1).replace(",", "")) < int(held.group(2).replace(",", ""))
        tmux.run("send-keys", "-t", "app", "Escape")
        tmux.wait_for(r"ready │ decode", 10)
        # Ctrl+S, then /: the saved turn is found by a word of the question (typed as a
        # prefix, with query syntax around it); Esc clears the search, Esc closes.
        tmux.run("send-keys", "-t", "app", "C-s")
        tmux.wait_for(r"Title +Method[\s\S]*What is the capital of France\?", 20)  # read from the database
        tmux.run("send-keys", "-t", "app", "/")
        tmux.run("send-keys", "-t", "app", "-l", '"capit (')
        tmux.wait_for(r"Session · match[\s\S]*What is the capital of France\?", 20)  # the title, in the matches
        tmux.run("send-keys", "-t", "app", "Escape")
        tmux.wait_for(r"Title +Method", 10)
        tmux.run("send-keys", "-t", "app", "Escape")
        tmux.wait_for(r"ready │ decode", 10)
        # /file: the PDF becomes a chip with its pages and tokens (not sent).
        tmux.run("send-keys", "-t", "app", "-l", f"/file {paper}")
        tmux.run("send-keys", "-t", "app", "Enter")
        tmux.wait_for(r"paper\.pdf · 2 pages · [\d,]+ tokens", 30)
        tmux.run("send-keys", "-t", "app", "C-q")
        deadline = time.monotonic() + 30
        while "kvchat — " in tmux.screen() and time.monotonic() < deadline:
            time.sleep(0.5)
        with Store(db) as store:
            rows = store.list_sessions()
            assert len(rows) == 1 and rows[0].message_count == 2
    finally:
        tmux.kill()
