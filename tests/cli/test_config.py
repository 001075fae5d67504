"""The TOML config file: option defaults that the command line overrides, and one-line
errors that name the file and the key."""

from __future__ import annotations

import pytest

from kvchat.cli.options import cache_options, model_options, system_choice
from kvchat.cli.parser import build_parser
from kvchat.errors import SettingsError
from kvchat.settings import read_config


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    monkeypatch.setenv("KVCHAT_CONFIG", str(path))
    return path


def test_no_config_file_means_no_defaults_from_it(config_file):
    assert not config_file.exists()
    assert read_config() == {}


def test_config_file_gives_the_defaults_of_every_command(config_file):
    config_file.write_text(
        'method = "h2o"\nbudget = "25%"\nwindow = 512\ndtype = "bfloat16"\nthreads = 3\nmodel = "/models/other"\n'
    )
    for argv in (["ask", "hi"], ["sessions", "list"], ["bench", "speed"], []):
        args = build_parser().parse_args(argv)
        cache = cache_options(args).for_method()
        model = model_options(args)
        assert (cache.method, cache.budget, cache.window) == ("h2o", "25%", 512), argv
        assert (model.dtype, model.threads, model.model) == ("bfloat16", 3, "/models/other"), argv


def test_the_command_line_overrides_the_config_file(config_file):
    config_file.write_text('method = "h2o"\nbudget = 2048\nwindow = 512\n')
    args = build_parser().parse_args(["ask", "hi", "--method", "chelsea", "--window", "256"])
    cache = cache_options(args).for_method()
    assert (cache.method, cache.window, cache.budget) == ("chelsea", 256, "2048")


def test_an_option_before_the_subcommand_overrides_the_config_file_too(config_file):
    config_file.write_text('method = "h2o"\n')
    args = build_parser().parse_args(["--method", "subgen", "ask", "hi"])
    assert args.method == "subgen"


def test_the_system_key_is_the_system_prompt_unless_system_is_given(config_file):
    assert system_choice(build_parser().parse_args(["ask", "hi"])) == (None, False)
    config_file.write_text('system = "Answer in one sentence."\n')
    for argv in (["ask", "hi"], ["compare", "hi"], []):
        # From the config file: not given, so a saved session keeps its own.
        assert system_choice(build_parser().parse_args(argv)) == ("Answer in one sentence.", False), argv
    for argv in (["ask", "hi", "--system", "Be a pirate."], ["--system", "Be a pirate.", "ask", "hi"]):
        assert system_choice(build_parser().parse_args(argv)) == ("Be a pirate.", True), argv
    assert system_choice(build_parser().parse_args(["ask", "hi", "--system", ""])) == ("", True)


def test_an_unknown_key_names_the_file_and_the_key(config_file):
    config_file.write_text('methd = "h2o"\n')
    with pytest.raises(SettingsError, match="methd") as error:
        read_config()
    assert str(config_file) in str(error.value)


def test_a_malformed_file_names_the_file(config_file):
    config_file.write_text('method = "h2o\n')
    with pytest.raises(SettingsError, match="not valid TOML") as error:
        read_config()
    assert str(config_file) in str(error.value)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('window = "wide"', "window"),
        ("threads = true", "threads"),
        ('budget = "lots"', "budget"),
        ("system = 3", "system"),
        ('disk_budget = "lots"', "disk_budget"),
        ('disk_budget = "2 parsecs"', "disk_budget"),
    ],
)
def test_a_value_of_the_wrong_kind_names_the_key(config_file, line, key):
    config_file.write_text(line + "\n")
    with pytest.raises(SettingsError, match=f"key '{key}'"):
        read_config()


def test_the_disk_budget_key_bounds_the_store_of_every_command_and_the_command_line_wins(config_file, tmp_path):
    from kvchat.cli.options import open_store

    assert build_parser().parse_args(["ask", "hi"]).disk_budget is None  # no bound by default
    config_file.write_text('disk_budget = "2GB"\n')
    for argv in (["ask", "hi"], ["sessions", "list"], []):
        args = build_parser().parse_args(["--db", str(tmp_path / "kv.db"), *argv])
        assert args.disk_budget == 2 * 10**9, argv
    with open_store(args) as store:
        assert store.disk_budget == 2 * 10**9
    assert build_parser().parse_args(["ask", "hi", "--disk-budget", "1.5GiB"]).disk_budget == int(1.5 * 2**30)
    assert build_parser().parse_args(["ask", "hi", "--disk-budget", "off"]).disk_budget is None


def test_a_bad_config_is_a_one_line_error_of_the_command(config_file, tmp_path, capsys, monkeypatch):
    from kvchat.cli import main

    config_file.write_text("colour = 'blue'\n")
    monkeypatch.setenv("KVCHAT_DB", str(tmp_path / "kv.db"))
    assert main(["sessions", "list"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(config_file) in lines[0] and "'colour'" in lines[0]
