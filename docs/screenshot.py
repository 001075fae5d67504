"""Draw docs/screenshot.svg: the chat app in the middle of a conversation.

Run from the repository root:

    KVCHAT_HOME=$(mktemp -d) python docs/screenshot.py [OUT.svg]

The app runs headless (Textual's Pilot) on the embedded model, with greedy decoding, in
a data home of its own: set KVCHAT_HOME to a fresh folder (one whose `models/` already
holds the converted model starts in seconds; otherwise the first start converts the
embedded GGUF once, about 20 s). Nothing is downloaded. The conversation is two turns:
a short question, then a small document attached with `/file` and a question about it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from kvchat.model.engine import load_engine
from kvchat.settings import CacheSettings, ModelOptions, SamplingSettings
from kvchat.storage.db import Store
from kvchat.tui.app import KvchatApp

SIZE = (110, 30)
OUT = Path(__file__).resolve().with_name("screenshot.svg")
DOCUMENT = """\
Notes from the garden club, spring meeting.

We agreed to plant tomatoes along the south fence and beans by the shed. Maria will bring
compost on Saturday. The water tank leaks at the bottom valve and needs a new washer.
The spare key to the tool shed is under the blue flowerpot by the gate.
Next meeting: the first Sunday of May, at ten in the morning.
"""
QUESTIONS = ("What is the capital of France?", "Where is the spare key to the tool shed?")


async def wait_idle(pilot, app: KvchatApp, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while app.activity is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshot: timed out waiting for {what}")
        await pilot.pause(0.1)
    await pilot.pause(0.3)


async def draw(out: Path, workdir: Path) -> None:
    document = workdir / "garden-notes.txt"
    document.write_text(DOCUMENT, encoding="utf-8")
    with Store(workdir / "kvchat.db") as store:
        app = KvchatApp(
            lambda on_status: load_engine(ModelOptions(), on_status),
            store,
            CacheSettings(recall=None),  # None: the engine's default, as the command line leaves it
            SamplingSettings(max_new_tokens=48),
            reopen_last=False,
        )
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app, "the model to load")
            await pilot.press(*QUESTIONS[0], "enter")
            await wait_idle(pilot, app, "the first answer")
            await pilot.press(*f"/file {document} {QUESTIONS[1]}", "enter")  # attaches; the question stays
            await pilot.pause(0.5)
            await pilot.press("enter")
            await wait_idle(pilot, app, "the second answer")
            app.save_screenshot(filename=out.name, path=str(out.parent))


def main(argv: list[str]) -> int:
    if not os.environ.get("KVCHAT_HOME"):
        print("screenshot: set KVCHAT_HOME to a fresh folder (see the docstring)", file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve() if argv else OUT
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(draw(out, Path(workdir)))
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
