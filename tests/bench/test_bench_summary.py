"""docs/benchmarks.md and the README's performance table, generated from a folder of
reports made here (no model is loaded, nothing is timed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchat.bench import report, summary

METHOD_ROWS = [
    {"method": "generate (fp32)", "context": 2048, "context_tokens": 2048, "ttft_s": 3.5, "decode_tok_s": 19.6},
    {"method": "window", "context": 2048, "context_tokens": 2048, "ttft_s": 1.47, "decode_tok_s": 64.1},
    {
        "method": "window (streaming prefill)",
        "context": 2048,
        "context_tokens": 2048,
        "ttft_s": 1.4,
        "decode_tok_s": 63.0,
    },
    {"method": "generate (fp32)", "context": 8192, "context_tokens": 8031, "ttft_s": 30.2, "decode_tok_s": 12.0},
    {"method": "window", "context": 8192, "context_tokens": 8031, "ttft_s": 9.84, "decode_tok_s": 58.0},
]
README = "# kvchat\n\nIntro.\n\n## Performance\n\n<!-- bench:start -->\n(old table)\n<!-- bench:end -->\n\nAfter.\n"


@pytest.fixture
def repo(tmp_path: Path, monkeypatch) -> Path:
    """A checkout's layout: docs/bench/speed written by `report.write` (with commit and
    command), docs/bench/fidelity written before reports named them, a README with markers."""
    monkeypatch.setattr(report, "commit", lambda package=report.PACKAGE: "abc1234")
    monkeypatch.delenv("KVCHAT_KERNELS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    speed = tmp_path / "docs" / "bench" / "speed"
    monkeypatch.setattr(sys, "argv", ["kvchat", "bench", "speed", "--contexts", "2048,8192", "--out", str(speed)])
    report.write(
        speed,
        "speed_methods",
        METHOD_ROWS,
        ["method", "context", "ttft_s", "decode_tok_s"],
        title="Time to first token and decode per method",
        notes="One document message.",
    )
    report.write(speed, "speed_start", [{"what": "ask", "best_s": 2.5}], ["what", "best_s"], title="Start-up")
    (speed / "speed_decode.png").write_bytes(b"\x89PNG")
    fidelity = tmp_path / "docs" / "bench" / "fidelity"
    fidelity.mkdir(parents=True)
    old_machine = {"processor": "x86_64", "cpus": 2, "torch": "2.13.0+cpu", "cuda": None, "date": "2026-11-23"}
    (fidelity / "fidelity.json").write_text(
        json.dumps(
            {"suite": "fidelity", "machine": old_machine, "rows": [{"budget": "25%", "method": "h2o", "kl": 0.05}]}
        )
    )
    (fidelity / "fidelity.md").write_text(
        "# Fidelity to the full cache\n\nMachine: x86_64, 2 CPUs, torch 2.13.0+cpu; 2026-11-23.\n\nThe notes.\n\n"
        "| budget | method | kl |\n|---|---|---|\n| 25% | h2o | 0.05 |\n\n## Targets at 25%\n\n- h2o: yes\n"
    )
    (tmp_path / "README.md").write_text(README)
    return tmp_path


def generate(repo: Path) -> str:
    assert summary.main(["--bench", str(repo / "docs" / "bench")]) == 0
    return (repo / "docs" / "benchmarks.md").read_text()


def test_each_suite_has_its_reports_with_machine_commit_command_and_table(repo):
    page = generate(repo)
    assert page.index("## Speed") < page.index("## Fidelity") < page.index("## Recall") < page.index("## Resume")
    speed = page[page.index("## Speed") : page.index("## Fidelity")]
    assert speed.index("### Time to first token and decode per method") < speed.index("### Start-up")
    assert "- Commit: abc1234 (kvchat " in speed
    assert f"- Command: `kvchat bench speed --contexts 2048,8192 --out {repo / 'docs' / 'bench' / 'speed'}`" in speed
    assert "- Machine: " in speed and "2 CPUs" in speed
    assert "One document message." in speed and "| window | 8192 | 9.84 | 58 |" in speed
    assert "[speed_decode](bench/speed/speed_decode.png)" in speed
    assert "[speed_methods.json](bench/speed/speed_methods.json)" in speed
    assert speed.count("Machine:") == 2  # the suite's own header lines are replaced, not repeated


def test_a_report_from_before_provenance_says_not_recorded(repo):
    page = generate(repo)
    fidelity = page[page.index("## Fidelity") : page.index("## Recall")]
    assert "- Commit: not recorded" in fidelity and "- Command: not recorded" in fidelity
    assert "- Machine: x86_64, 2 CPUs, torch 2.13.0+cpu; 2026-11-23" in fidelity
    assert "| 25% | h2o | 0.05 |" in fidelity and "The notes." in fidelity
    assert "#### Targets at 25%" in fidelity  # a report's sections sit under its heading


def test_a_suite_without_a_report_says_how_to_make_one(repo):
    page = generate(repo)
    resume = page[page.index("## Resume") : page.index("## Attention")]
    assert "No report yet: `make bench`" in resume


def test_the_readme_table_between_the_markers_names_methods_contexts_machine_and_commit(repo):
    generate(repo)
    text = (repo / "README.md").read_text()
    assert text.startswith("# kvchat\n\nIntro.\n\n## Performance\n\n<!-- bench:start -->\n")
    assert text.endswith("<!-- bench:end -->\n\nAfter.\n")
    table = text[text.index(summary.START) : text.index(summary.END)]
    assert "(old table)" not in table
    assert "| method | first token, 2k | decode, 2k | first token, 8k | decode, 8k |" in table
    assert "| window | 1.47 s | 64.1 tok/s | 9.84 s | 58.0 tok/s |" in table
    assert "| generate (fp32) | 3.50 s | 19.6 tok/s | 30.20 s | 12.0 tok/s |" in table
    assert "streaming" not in table
    assert "Commit abc1234, `kvchat bench speed --contexts 2048,8192" in table
    assert "[docs/benchmarks.md](docs/benchmarks.md)" in table


def test_generating_twice_changes_nothing(repo):
    first = generate(repo), (repo / "README.md").read_text()
    assert (generate(repo), (repo / "README.md").read_text()) == first


def test_a_readme_without_the_markers_is_left_alone(repo):
    (repo / "README.md").write_text("# kvchat\n\nNo table here.\n")
    generate(repo)
    assert (repo / "README.md").read_text() == "# kvchat\n\nNo table here.\n"


def test_kvchat_bench_summary_reads_the_folder_given_as_out(repo):
    from kvchat.cli import main

    assert main(["bench", "summary", "--out", str(repo / "docs" / "bench")]) == 0
    assert "## Speed" in (repo / "docs" / "benchmarks.md").read_text()
    assert "| window | 1.47 s |" in (repo / "README.md").read_text()


def test_a_missing_folder_of_reports_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        summary.main(["--bench", str(tmp_path / "nothing")])


def test_runs_kept_side_by_side_in_a_suites_subfolders_are_on_the_page(repo):
    part = repo / "docs" / "bench" / "recall" / "6k-window"
    part.mkdir(parents=True)
    (part / "recall.json").write_text(
        json.dumps({"suite": "recall", "machine": {}, "commit": "def5678", "rows": [{"method": "window", "found": 3}]})
    )
    (part / "recall_needle.png").write_bytes(b"\x89PNG")
    page = generate(repo)
    assert "def5678" in page and "recall/6k-window/recall.json" in page and "recall/6k-window/recall_needle.png" in page
