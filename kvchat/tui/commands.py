"""Command palette (ctrl+p): an entry for every app action, plus one per method."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from kvchat.tui.app import KvchatApp


@dataclass
class PaletteCommand:
    title: str
    help: str
    callback: Callable[[], object]


class KvchatCommands(Provider):
    def commands(self) -> Iterator[PaletteCommand]:
        app = cast("KvchatApp", self.app)
        yield from app.palette_commands()

    async def discover(self) -> Hits:
        for command in self.commands():
            yield DiscoveryHit(command.title, command.callback, help=command.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for command in self.commands():
            score = matcher.match(command.title)
            if score > 0:
                yield Hit(score, matcher.highlight(command.title), command.callback, help=command.help)


def run_action_later(app: KvchatApp, action: str) -> Callable[[], object]:
    """A palette callback that runs an app action (after the palette has closed)."""
    return partial(app.call_later, app.run_action, action)
