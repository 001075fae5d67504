"""A document's time to first token in the app, in a real terminal, against `kvchat ask`.

Each tree (a kvchat checkout) is started in a private tmux server; the file is attached
with `/file PATH QUESTION`, sent with Enter, and the status bar's TTFT is read once the
turn is over (the turn's own measure: from the start of the prefill to the first token,
as `ask --json`'s `ttft_s`). `cli:TREE` runs `kvchat ask --file ... --json` from TREE
instead. Trees alternate, round after round.

    python docs/bench/app-ttft/app_ttft.py ROUNDS DOC TREE [TREE ...]
    SEED_HOME=DIR python docs/bench/app-ttft/app_ttft.py ...   # the document as a later turn

With SEED_HOME, every run's home starts as a copy of DIR's saved sessions, so the app
reopens the last of them and the document is that session's next turn (the app's
default start: it reopens the last session).

Needs tmux and KVCHAT_HOME pointing at a folder holding the embedded model's files
(`models/`). Every run gets a data home of its own (a temporary folder whose `models`
links there), so the app starts a new session: it reopens the last session otherwise,
and the document would be a later turn of an ever longer conversation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What is this document about?"
PYTHON = sys.executable


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", "app-ttft", *args], capture_output=True, text=True).stdout


def wait_for(predicate, timeout: float = 180, every: float = 0.25) -> str:
    end = time.time() + timeout
    while time.time() < end:
        screen = tmux("capture-pane", "-p", "-t", "app")
        if predicate(screen):
            return screen
        time.sleep(every)
    raise TimeoutError(tmux("capture-pane", "-p", "-t", "app"))


def fresh_home() -> str:
    home = Path(tempfile.mkdtemp(prefix="kvchat-app-ttft-"))
    (home / "models").symlink_to(Path(os.environ["KVCHAT_HOME"], "models").resolve())
    seed = os.environ.get("SEED_HOME")
    if seed:
        shutil.copytree(Path(seed, "sessions"), home / "sessions")
    return str(home)


def app(tree: str, doc: str) -> tuple[float, float]:
    tmux("kill-server")
    tmux("new-session", "-d", "-s", "app", "-x", "110", "-y", "34", "-e", "TERM=xterm-256color",
         "-e", f"KVCHAT_HOME={fresh_home()}", f"cd {tree} && exec {PYTHON} -m kvchat --max-new-tokens 32")
    try:
        wait_for(lambda s: " ready │" in s)
        tmux("send-keys", "-t", "app", f"/file {doc} {QUESTION}", "Enter")
        wait_for(lambda s: "tokens  ✕" in s)
        tmux("send-keys", "-t", "app", "Enter")
        # Polled once a second: a capture is a process of its own on a 2-core box.
        screen = wait_for(lambda s: re.search(r"TTFT \d", s) is not None, every=1.0)
    finally:
        tmux("kill-server")
    ram = re.search(r"RAM ([\d.]+) (MB|GB)", screen)
    assert ram is not None, screen
    return float(re.search(r"TTFT ([\d.]+) s", screen).group(1)), float(ram.group(1)) * (1000 if ram.group(2) == "GB" else 1)


def cli(tree: str, doc: str) -> tuple[float, float]:
    out = subprocess.run([PYTHON, "-m", "kvchat", "ask", QUESTION, "--file", doc, "--no-save", "--json",
                          "--max-new-tokens", "32"], capture_output=True, text=True, cwd=tree, check=True,
                         env={**os.environ, "KVCHAT_HOME": fresh_home()}).stdout
    data = json.loads(out)
    return data["ttft_s"], data["rss_bytes"] / 1e6


def main() -> None:
    rounds, doc, trees = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for _ in range(rounds):
        cells = []
        for tree in trees:
            ttft, ram = cli(tree[4:], doc) if tree.startswith("cli:") else app(tree, doc)
            cells.append(f"{tree}: TTFT {ttft:.2f} s, RAM {ram:.0f} MB")
        print("   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
