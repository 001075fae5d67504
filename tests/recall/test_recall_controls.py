"""The user's controls of the recall tier, without the model: `--recall N|off`, the
`recall` config key, `/recall`, what a saved session keeps, and how the status bar and
the memory map show the tier on disk apart from the KV in RAM."""

from __future__ import annotations

import pytest

from kvchat import compress
from kvchat.chat.memory_map import memory_lines, recall_lines
from kvchat.chat.persist import settings_from_meta, settings_meta
from kvchat.cli import main
from kvchat.cli.options import bench_options, cache_settings
from kvchat.cli.parser import build_parser
from kvchat.errors import CommandError, SettingsError
from kvchat.settings import CacheSettings, parse_recall, read_config
from kvchat.tui.slash import SlashCommand, parse_input
from kvchat.tui.status import Speeds, StatusReport
from kvchat.turns import MemoryReport, SessionStats

METHODS = compress.available()


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    monkeypatch.setenv("KVCHAT_CONFIG", str(path))
    return path


# -- the option ------------------------------------------------------------------------
def test_recall_not_asked_for_is_left_to_the_engine():
    # (None: the engine's default, on where its speed was measured: Engine.default_recall)
    assert cache_settings(build_parser({}).parse_args(["ask", "hi"])).recall is None


def test_a_bench_run_is_without_recall_unless_asked_for():
    assert bench_options(build_parser({}).parse_args(["bench", "speed"])).cache.recall == 0


@pytest.mark.parametrize(("given", "recall"), [("32", 32), ("off", 0), ("OFF", 0), ("0", 0), ("1", 1)])
def test_recall_option_gives_the_cache_setting(given, recall):
    assert cache_settings(build_parser({}).parse_args(["ask", "hi", "--recall", given])).recall == recall


def test_recall_given_before_the_subcommand_is_kept():
    for argv in (["--recall", "32", "ask", "hi"], ["--recall", "32", "compare", "hi"], ["--recall", "32"]):
        assert cache_settings(build_parser({}).parse_args(argv)).recall == 32, argv


@pytest.mark.parametrize("bad", ["lots", "-3", "2.5", ""])
def test_a_bad_recall_is_a_one_line_error_naming_the_option(bad, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVCHAT_DB", str(tmp_path / "kv.db"))
    with pytest.raises(SystemExit) as done:
        main(["ask", "hi", "--recall", bad])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2
    assert len(lines) == 1 and "--recall" in lines[0] and "off" in lines[0], lines


def test_bench_keeps_its_recall_list_for_rows_side_by_side():
    options = bench_options(build_parser({}).parse_args(["bench", "recall", "--recall", "0,32"]))
    assert options.recall == (0, 32)
    assert options.cache.recall == 0  # the list is rows of the report, not the cache of every row


def test_recall_before_bench_sets_the_cache_of_a_bench_run():
    options = bench_options(build_parser({}).parse_args(["--recall", "32", "bench", "speed"]))
    assert options.cache.recall == 32 and options.recall is None


def test_parse_recall_names_the_forms_it_takes():
    with pytest.raises(SettingsError, match=r"recall 'lots'.*\(e\.g\. 32\) or off"):
        parse_recall("lots")
    with pytest.raises(SettingsError, match="recall -3: must be off"):
        parse_recall(-3)


# -- the config key --------------------------------------------------------------------
@pytest.mark.parametrize(("line", "recall"), [("recall = 32", 32), ('recall = "off"', 0), ('recall = "16"', 16)])
def test_the_recall_key_is_the_default_of_every_command(config_file, line, recall):
    config_file.write_text(line + "\n")
    for argv in (["ask", "hi"], ["compare", "hi"], []):
        assert cache_settings(build_parser().parse_args(argv)).recall == recall, argv


def test_the_command_line_overrides_the_recall_key(config_file):
    config_file.write_text("recall = 32\n")
    assert cache_settings(build_parser().parse_args(["ask", "hi", "--recall", "off"])).recall == 0


@pytest.mark.parametrize("line", ["recall = -3", 'recall = "lots"', "recall = true", "recall = 2.5"])
def test_a_bad_recall_key_names_the_file_and_the_key(config_file, line):
    config_file.write_text(line + "\n")
    with pytest.raises(SettingsError, match="key 'recall'") as error:
        read_config()
    assert str(config_file) in str(error.value)


# -- /recall ---------------------------------------------------------------------------
def test_slash_recall_takes_a_count_or_off_and_alone_asks_for_the_setting():
    assert parse_input("/recall 32", METHODS) == SlashCommand("recall", "32")
    assert parse_input("/recall off", METHODS) == SlashCommand("recall", "0")
    assert parse_input("/recall", METHODS) == SlashCommand("recall", "")


@pytest.mark.parametrize("bad", ["/recall lots", "/recall -3"])
def test_a_bad_slash_recall_is_a_command_error_naming_the_forms(bad):
    with pytest.raises(CommandError, match=r"/recall: .*or off"):
        parse_input(bad, METHODS)


# -- saved sessions --------------------------------------------------------------------
def test_a_saved_session_keeps_its_recall_setting():
    saved = settings_meta(CacheSettings(recall=32))
    assert saved["recall"] == 32
    assert settings_from_meta(saved).recall == 32


def test_settings_saved_before_recall_existed_mean_recall_off():
    saved = settings_meta(CacheSettings())
    del saved["recall"]
    # Off, even where the settings a missing key would otherwise come from say otherwise.
    assert settings_from_meta(saved, base=CacheSettings(recall=32)).recall == 0


# -- the status bar and the memory map -------------------------------------------------
def status(**stats) -> StatusReport:
    figures = {
        "method": "window",
        "budget": "16",
        "tokens_seen": 0,
        "entries_per_head": 0,
        "kv_bytes": 2_000_000,
        "full_kv_bytes": 8_000_000,
        "rss_bytes": 0,
        "cuda_bytes": 0,
        **stats,
    }
    return StatusReport.from_stats(SessionStats(**figures), Speeds(), "ready")


def test_the_status_bar_shows_disk_bytes_apart_only_with_recall_on():
    assert "disk" not in status().cache_line()
    line = status(recall=32, cold_bytes=5_000_000).cache_line()  # decimal MB, as --budget counts
    assert "KV 2.0 MB" in line and "+ 5.0 MB on disk" in line and "recall 32/head" in line


REPORT = {
    "spans": [
        {"start": 0, "end": 30, "role": "system", "kept": 0.5},
        {"start": 30, "end": 60, "role": "user", "kept": 0.5},
        {"start": 60, "end": 70, "role": "assistant", "kept": 1.0},
    ],
    "method": "window",
    "budget": "16",
    "tokens_seen": 70,
    "kv_bytes": 1_000_000,
}


def report_of(**changes) -> MemoryReport:
    """REPORT as a saved memory map, with `changes`."""
    return MemoryReport.from_dict({**REPORT, **changes})


def test_the_memory_map_has_no_disk_lines_with_recall_off():
    assert recall_lines(report_of(recall=0, cold_bytes=0)) == []
    assert memory_lines(report_of(recall=0, cold_bytes=0)) == memory_lines(report_of())


def test_the_memory_map_shows_the_disk_tier_on_its_own_line_and_what_the_last_answer_recalled():
    report = report_of(
        recall=32,
        cold_bytes=3_000_000,
        recall_steps=10,
        recalled=24.5,
        layer_recalled=[24.0, 25.0],
        recalled_tokens=12,
        span_recalled=[2.0, 9.5, 0.0],
        recalled_runs=[[5, 7], [40, 50]],
    )
    lines = memory_lines(report)
    assert any(line.startswith("disk tier: 3.0 MB") and "recall 32" in line for line in lines), lines
    answer = next(line for line in lines if line.startswith("last answer:"))
    assert "24.5 cold tokens per KV head and step" in answer and "12 tokens by some layer" in answer
    assert answer.endswith("by half the layers or more: 5–7, 40–50")
    header = next(line for line in lines if "tokens" in line and "role" in line)
    assert header.endswith("recalled")
    assert lines[lines.index(header) + 2].endswith("9.5")  # span 2, the user's: 9.5 tokens a layer


def test_a_report_with_recall_on_but_no_answer_logged_says_so():
    lines = recall_lines(report_of(recall=32, cold_bytes=0))
    assert lines[0].startswith("disk tier: 0.0 MB") and lines[1].startswith("last answer: none yet")
