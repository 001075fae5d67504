"""The slash commands: one table, from which the parser, its error and the help are made."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.errors import CommandError
from kvchat.tui.slash import COMMANDS, SlashCommand, help_lines, parse_input, usage

METHODS = ["window", "h2o"]
README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_command_of_the_table_parses_to_its_action():
    for command in COMMANDS:
        argument = {"method": "h2o", "recall": "32", "file": "notes.txt", "system": "Be brief."}.get(command.action, "")
        parsed = parse_input(f"{command.name} {argument}".strip(), METHODS)
        assert parsed == SlashCommand(command.action, argument)


def test_an_unknown_command_names_every_command_and_the_escape():
    with pytest.raises(CommandError) as raised:
        parse_input("/frobnicate", METHODS)
    assert usage() in str(raised.value) and "//" in str(raised.value)


def test_the_help_lists_every_command_with_its_usage():
    text = "\n".join(help_lines())
    assert all(command.usage in text and command.help in text for command in COMMANDS)


def test_the_readme_lists_every_command_as_the_table_writes_it():
    readme = README.read_text(encoding="utf-8")
    assert all(f"`{command.usage}`" in readme for command in COMMANDS)
