"""Fixtures and helpers for the app tests: one real Engine per test module, a fresh
store per test, small cache settings so that compression really happens."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual import events

from kvchat.settings import CacheSettings, SamplingSettings
from kvchat.storage.db import Store

# sinks 4 + window 16 + middle 16 per KV head: a chat prompt alone overflows it.
SMALL_CACHE = dict(method="window", budget="16", window=16, sinks=4, batch=16, prefill_mode="streaming")
APP_SIZE = (100, 32)


@pytest.fixture(scope="module")
def engine(embedded):
    from kvchat.model.engine import Engine

    return Engine(embedded)


@pytest.fixture
def store(tmp_path: Path):
    with Store(tmp_path / "kvchat.db") as opened:
        yield opened


def small_settings(**overrides) -> CacheSettings:
    return CacheSettings(**{**SMALL_CACHE, **overrides})


def make_app(
    engine, store, *, max_new_tokens: int = 12, resume_id: int | None = None, reopen_last: bool = True, **cache
):
    from kvchat.tui.app import KvchatApp

    sampling = SamplingSettings(max_new_tokens=max_new_tokens)
    return KvchatApp(engine, store, small_settings(**cache), sampling, resume_id, reopen_last=reopen_last)


async def wait_for(pilot, predicate: Callable[[], object], timeout: float = 60.0, what: str = "the app") -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.05)


async def wait_idle(pilot, timeout: float = 60.0) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.activity is None, timeout, "the model to finish")
    await pilot.pause()


async def type_text(pilot, text: str) -> None:
    """Type into the focused editor key by key, as a user would."""
    await pilot.press(*text)


async def send_and_wait(pilot, text: str) -> None:
    """Type a message, send it with Enter and wait for the whole answer."""
    await type_text(pilot, text)
    await pilot.press("enter")
    await wait_idle(pilot)


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


def essay_tokens(engine, tokens: int) -> tuple[str, int]:
    """The first `tokens` tokens (about) of the essays, and their exact count."""
    from kvchat.calibration.realkv import essays_text

    text = essays_text()
    ids = engine.tokenizer(text[: tokens * 6], add_special_tokens=False).input_ids[:tokens]
    document = engine.tokenizer.decode(ids)
    return document, engine.count_tokens(document)


async def paste(pilot, text: str) -> None:
    """What a terminal paste does: a Paste event to the focused editor."""
    pilot.app.chat.chat_input.prompt_area.focus()
    await pilot.pause()
    pilot.app.post_message(events.Paste(text))
