"""Every error kvchat shows a user, in one leaf module.

Each message names the cause and the way out, in one line. Front ends (cli, tui) import
these to tell a user's problem from a bug without importing the layers that raise them
(and, with them, torch).
"""

from __future__ import annotations


class SettingsError(ValueError):
    """A setting the user can fix (one-line message naming the option or key)."""


class ModelError(Exception):
    """A model could not be loaded; the message names the cause and the way out."""


class StoreError(Exception):
    """A problem with the session database that the user can act on (one-line message)."""


class SnapshotMismatch(Exception):
    """The saved cache cannot be used with what is loaded now; a rebuild can redo it."""


class DocumentError(Exception):
    """A file that cannot be attached (missing, too big, encrypted, scanned, damaged, of a
    kind kvchat does not read); the message names the file, the cause and the way out."""


class CommandError(ValueError):
    """A typed command that cannot run; the message names the way out."""


class Cancelled(Exception):
    """Raised inside the engine when the cancel event is set between steps."""


class InputTooLong(ValueError):
    """A turn that cannot fit the model's positions, refused before any work is done.
    `way_out` says what to change; `message(subject, shorter)` lets a caller name the
    input ("document", "a shorter file")."""

    def __init__(self, tokens: int, capacity: int, reason: str, way_out: str) -> None:
        self.tokens, self.capacity, self.reason, self.way_out = tokens, capacity, reason, way_out
        super().__init__(self.message())

    def message(self, subject: str = "input", shorter: str = "a shorter input") -> str:
        return f"this {subject} is {self.tokens:,} tokens; {self.reason}: {self.way_out}, or {shorter}"
