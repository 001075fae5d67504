"""What every benchmark report records about how it was made: commit, command line,
environment, kvchat's version and the machine's CPU. No model is loaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.bench import report

GIT = ["git", "-c", "user.name=kvchat", "-c", "user.email=kvchat@example.invalid", "-c", "commit.gpgsign=false"]


def git(folder: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A repository with a `kvchat` package folder at its top, and docs beside it."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    (root / "kvchat").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "kvchat" / "__init__.py").write_text("")
    (root / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    (root / "README.md").write_text("# kvchat\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_a_clean_checkout_is_named_by_its_short_hash(checkout):
    assert report.commit(checkout / "kvchat") == git(checkout, "rev-parse", "--short", "HEAD")


def test_uncommitted_code_marks_the_commit_dirty(checkout):
    head = git(checkout, "rev-parse", "--short", "HEAD")
    (checkout / "kvchat" / "__init__.py").write_text("x = 1\n")
    assert report.commit(checkout / "kvchat") == f"{head}+dirty"


def test_a_new_module_not_yet_added_marks_it_dirty_too(checkout):
    (checkout / "kvchat" / "new.py").write_text("")
    assert report.commit(checkout / "kvchat").endswith("+dirty")


def test_reports_and_documentation_being_rewritten_leave_it_clean(checkout):
    # `make bench` writes docs/bench/ and the README's table while it runs: later suites
    # of the same run still name the commit they measured.
    head = git(checkout, "rev-parse", "--short", "HEAD")
    (checkout / "docs" / "benchmarks.md").write_text("# Regenerated\n")
    (checkout / "docs" / "bench" / "speed").mkdir(parents=True)
    (checkout / "docs" / "bench" / "speed" / "speed_methods.json").write_text("{}")
    (checkout / "README.md").write_text("# kvchat, with a table\n")
    assert report.commit(checkout / "kvchat") == head


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    (tmp_path / "kvchat").mkdir()
    assert report.commit(tmp_path / "kvchat") == "unknown"


def test_a_copy_inside_another_repository_is_not_named_by_it(checkout):
    # An installed copy (a venv's site-packages) inside some other project's tree.
    package = checkout / "venv" / "site-packages" / "kvchat"
    package.mkdir(parents=True)
    assert report.commit(package) == "unknown"


def test_without_git_the_commit_is_unknown_and_nothing_fails(checkout, monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert report.commit(checkout / "kvchat") == "unknown"


@pytest.mark.parametrize(
    ("argv", "typed"),
    [
        (["/home/me/.venv/bin/kvchat", "bench", "speed", "--contexts", "2048"], "kvchat bench speed --contexts 2048"),
        (["/src/kvchat/__main__.py", "bench", "recall"], "kvchat bench recall"),  # python -m kvchat
        (["kvchat", "bench", "fidelity", "--methods", "a b"], "kvchat bench fidelity --methods 'a b'"),
    ],
)
def test_the_command_line_is_the_one_typed(argv, typed):
    assert report.command_line(argv) == typed


def test_the_environment_keeps_what_changes_a_measurement():
    env = {"KVCHAT_KERNELS": "off", "OMP_NUM_THREADS": "1", "KVCHAT_HOME": "/home/me", "PATH": "/bin"}
    assert report.environment(env) == {"KVCHAT_KERNELS": "off", "OMP_NUM_THREADS": "1"}
    assert report.as_typed({"command": "kvchat bench speed", "environment": report.environment(env)}) == (
        "KVCHAT_KERNELS=off OMP_NUM_THREADS=1 kvchat bench speed"
    )


def test_a_report_from_before_commands_were_recorded_says_so():
    assert report.as_typed({"suite": "speed", "rows": []}) == "not recorded"


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2
"""


def test_the_cpu_is_named_with_the_flags_kvchat_chooses_its_paths_by(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert report.cpu(info) == {
        "model": "Intel(R) Xeon(R) Platinum 8480+",
        "flags": ["avx2", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"],
    }
    described = report.describe_machine({"cpu": report.cpu(info), "cpus": 2, "torch": "2.13.0", "date": "today"})
    assert described.startswith("Intel(R) Xeon(R) Platinum 8480+ (avx2, avx512_bf16, avx512_vnni, amx_bf16")


def test_without_proc_cpuinfo_the_flags_are_not_known(tmp_path):
    assert report.cpu(tmp_path / "missing")["flags"] is None


def test_every_report_names_its_commit_command_version_and_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/.venv/bin/kvchat", "bench", "resume", "--lengths", "1024"])
    monkeypatch.setenv("KVCHAT_KERNELS", "-greedy")
    for name in ("KVCHAT_BENCH_NO_RECOMPUTE", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(report, "commit", lambda package=report.PACKAGE: "abc1234")
    report.write(
        tmp_path,
        "resume",
        [{"method": "full", "resume_s": 0.5}],
        ["method", "resume_s"],
        title="Resume",
        notes="Some notes.",
    )
    data = json.loads((tmp_path / "resume.json").read_text())
    assert data["commit"] == "abc1234"
    assert data["command"] == "kvchat bench resume --lengths 1024"
    assert data["environment"]["KVCHAT_KERNELS"] == "-greedy"
    assert data["kvchat_version"] == __import__("kvchat").__version__
    assert {"cpu", "cpus", "torch", "date"} <= set(data["machine"])
    md = (tmp_path / "resume.md").read_text().splitlines()
    assert md[0] == "# Resume"
    assert md[2].startswith("Machine: ")
    assert md[4].startswith("Commit: abc1234, kvchat ")
    assert md[4].endswith("Command: `KVCHAT_KERNELS=-greedy kvchat bench resume --lengths 1024`.")
    assert "| full | 0.5 |" in md
