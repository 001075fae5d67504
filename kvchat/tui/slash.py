"""The commands typed in the editor: one table, from which the parser, the error for an
unknown command and the help screen are made (docs/usage.md, "Slash commands", lists
them for readers)."""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.errors import CommandError
from kvchat.settings import recall_argument


@dataclass(frozen=True)
class Slash:
    """One command. `action`: what it does: "file", "method", "system" and "recall" take
    the rest of the line and are handled by the editor's flow; the others name the app
    action they run."""

    name: str
    usage: str
    help: str
    action: str


COMMANDS = (
    Slash(
        "/file",
        "/file PATH [QUESTION]",
        "attach a file (text, PDF, HTML, Word .docx, EPUB) or a folder's files (a question after it stays in the editor)",
        "file",
    ),
    Slash("/method", "/method NAME", "switch the compression method", "method"),
    Slash(
        "/system",
        "/system [TEXT|off]",
        "set the system prompt (the chat is read again under it); off: the model's default; alone: show it",
        "system",
    ),
    Slash(
        "/recall",
        "/recall [N|off]",
        "recall N cold tokens per KV head and step from the tier on disk (the cache "
        "is rebuilt); off: stop; alone: show it",
        "recall",
    ),
    Slash("/new", "/new", "start a new session (the current one stays saved)", "new_session"),
    Slash("/sessions", "/sessions", "list, search and resume saved sessions", "sessions"),
    Slash("/rebuild", "/rebuild", "re-read the conversation through the current method", "rebuild"),
    Slash("/help", "/help", "the keys and these commands", "help"),
)
BY_NAME = {command.name: command for command in COMMANDS}


@dataclass(frozen=True)
class SlashCommand:
    """A parsed command: `/file PATH` is ("file", PATH), `/method NAME` is ("method",
    NAME), `/system TEXT` is ("system", TEXT), `/recall N|off` is ("recall", "N"), "0" for
    off (no argument: show the current setting); the rest name the app action to run."""

    action: str
    argument: str = ""


def usage() -> str:
    """Every command's usage, for the error that names an unknown one."""
    return ", ".join(command.usage for command in COMMANDS)


def help_lines() -> list[str]:
    """The commands as the help screen lists them."""
    width = max(len(command.usage) for command in COMMANDS)
    return ["Commands typed in the editor (// sends a message that starts with /):"] + [
        f"  {command.usage:<{width}}  {command.help}" for command in COMMANDS
    ]


def parse_input(line: str, methods: list[str]) -> SlashCommand | str:
    """A command, or the message to send ("//x" sends "/x" literally). `methods`: the
    names `/method` accepts. Raises CommandError for an unknown command or method."""
    text = line.strip()
    if text.startswith("//"):
        return text[1:]
    if not text.startswith("/"):
        return text
    name, *rest = text.split(maxsplit=1)  # the text may go on on the next line (a system prompt)
    argument = rest[0].strip() if rest else ""
    command = BY_NAME.get(name)
    if command is None:
        raise CommandError(f"Unknown command {name}; try {usage()} (start with // to send a message beginning with /).")
    if command.action == "recall":
        return SlashCommand("recall", recall_argument(argument))
    if command.action == "method" and argument not in methods:
        raise CommandError(f"Unknown method {argument!r}; choose one of: {', '.join(methods)}")
    if command.action in ("file", "method", "system"):
        return SlashCommand(command.action, argument)
    return SlashCommand(command.action)
