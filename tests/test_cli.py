"""`kvchat` as a user runs it: a real process on the real embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KVCHAT = [sys.executable, "-m", "kvchat"]


def run(args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCHAT_DB": str(cwd / "kvchat.db")}
    return subprocess.run(KVCHAT + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ask_json(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ask")
    done = run(["ask", "What is the capital of France?", "--json", "--max-new-tokens", "24"], cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), cwd


def test_ask_answers_the_capital_of_france(ask_json):
    answer, _ = ask_json
    assert "Paris" in answer["answer"]


def test_ask_json_has_the_stable_fields(ask_json):
    answer, _ = ask_json
    for key in ("answer", "prompt_tokens", "new_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
                "ttft_s", "kv_bytes", "rss_bytes", "method", "budget", "model", "session"):
        assert key in answer, key
    assert answer["method"] == "window" and answer["model"] == "SmolLM2-135M-Instruct"


def test_ask_saves_a_session_that_a_second_ask_continues(ask_json):
    first, cwd = ask_json
    done = run(["ask", "And of Germany?", "--session", str(first["session"]), "--json", "--max-new-tokens", "16"], cwd)
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout)
    assert second["session"] == first["session"]
    assert second["prompt_tokens"] < 20  # only the new message, not the saved prefix
    assert "Berlin" in second["answer"]
    listing = run(["sessions", "list"], cwd)
    assert "What is the capital of France?" in listing.stdout


def test_quant_8bit_runs_on_cpu_and_answers(tmp_path):
    done = run(["ask", "What is the capital of France?", "--quant", "8bit", "--no-save", "--max-new-tokens", "16"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


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
def test_bad_input_is_a_one_line_error_with_exit_code_2(tmp_path, args, cause):
    done = run(args, tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and cause in lines[0]
    assert "Traceback" not in done.stderr


def test_unreadable_model_path_is_a_clear_error(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    done = run(["ask", "hi", "--model", str(folder)], tmp_path)
    assert done.returncode == 2 and "no config.json" in done.stderr and "Traceback" not in done.stderr


def test_version_and_help(tmp_path):
    assert run(["--version"], tmp_path).stdout.startswith("kvchat ")
    help_text = run(["--help"], tmp_path).stdout
    assert "--subgen-mode" in help_text and "--budget" in help_text and "ask" in help_text


def test_readme_documents_every_method_hyperparameter_with_its_default():
    from pathlib import Path

    from kvchat.compress import available, get

    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in readme.splitlines()
            if line.startswith("| `--")}
    for method in available():
        for param, default in get(method).defaults.items():
            flag = f"`--{method}-{param.replace('_', '-')}`"
            assert flag in rows, f"README lacks {flag}"
            if default not in (None, ""):
                assert rows[flag] == f"`{default}`", f"README gives {rows[flag]} for {flag}, the code {default!r}"
