"""`kvchat bench speed --parts kernels`: its sides' command lines and environments, their
order, and the ratios, with the side processes replaced by a stand-in (no model is
loaded, nothing is timed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchat.bench import kernels, speed
from kvchat.settings import BenchOptions


def test_a_side_runs_this_command_line_with_the_methods_part_alone(tmp_path):
    argv = [
        "--threads",
        "1",
        "bench",
        "speed",
        "--parts",
        "kernels",
        "--methods",
        "window,subgen",
        "--out",
        "docs/bench/speed",
        "--contexts",
        "4096",
        "--recall",
        "32",
    ]
    assert kernels.side_arguments(argv, tmp_path) == [
        "--threads",
        "1",
        "bench",
        "speed",
        "--methods",
        "window,subgen",
        "--contexts",
        "4096",
        "--recall",
        "32",
        "--parts",
        "methods",
        "--out",
        str(tmp_path),
    ]


def test_options_written_with_an_equals_sign_are_replaced_too(tmp_path):
    argv = ["bench", "speed", "--parts=kernels,methods", "--out=x", "--quick"]
    assert kernels.side_arguments(argv, tmp_path) == [
        "bench",
        "speed",
        "--quick",
        "--parts",
        "methods",
        "--out",
        str(tmp_path),
    ]


def test_a_command_line_that_is_not_bench_speed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kvchat bench speed"):
        kernels.side_arguments(["-m", "pytest", "tests/bench"], tmp_path)


def test_the_off_side_sets_kvchat_kernels_and_the_on_side_unsets_it():
    env = {"PATH": "/bin", "KVCHAT_KERNELS": "-greedy", "OMP_NUM_THREADS": "1"}
    assert kernels.off_value(env) == "-greedy"  # an A/B of some kernels only
    assert kernels.off_value({"PATH": "/bin"}) == "off"
    assert kernels.side_environment(True, "off", env) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert kernels.side_environment(False, "-greedy", env) == env
    assert kernels.side_environment(False, "off", {"PATH": "/bin"}) == {"PATH": "/bin", "KVCHAT_KERNELS": "off"}


def test_the_sides_alternate_which_goes_first():
    assert kernels.order(1) == [True, False]
    assert kernels.order(2) == [True, False, False, True]
    assert kernels.order(3) == [True, False, False, True, True, False]


def row(method: str, context: int, ttft: float, decode: float, next_turn: float | None = None) -> dict:
    r = {"method": method, "context": context, "context_tokens": context, "ttft_s": ttft, "decode_tok_s": decode}
    if next_turn is not None:
        r["next_turn_ttft_s"] = next_turn
    return r


def test_the_ratios_are_of_each_sides_medians_and_read_as_speed_ups():
    on = [
        [row("generate (fp32)", 2048, 3.0, 20.0), row("subgen", 2048, 2.0, 40.0, 0.1)],
        [row("generate (fp32)", 2048, 3.2, 19.0), row("subgen", 2048, 4.0, 50.0, 0.3)],
        [row("generate (fp32)", 2048, 3.1, 21.0), row("subgen", 2048, 3.0, 60.0, 0.2)],
    ]
    off = [
        [row("generate (fp32)", 2048, 3.1, 20.0), row("subgen", 2048, 6.0, 25.0, 0.4)],
        [row("subgen", 4096, 1.0, 1.0)],
    ]
    rows = kernels.compare(on, off)
    assert [(r["method"], r["context"]) for r in rows] == [("generate (fp32)", 2048), ("subgen", 2048)]
    subgen = rows[1]
    assert subgen["ttft_on"] == 3.0 and subgen["ttft_off"] == 6.0 and subgen["ttft_speedup"] == 2.0
    assert subgen["decode_on"] == 50.0 and subgen["decode_speedup"] == 2.0  # a rate: on over off
    assert subgen["next_turn_ttft_speedup"] == pytest.approx(2.0)
    assert subgen["rounds"] == 1
    assert "next_turn_ttft_on" not in rows[0]  # generate has no later turn


def test_the_part_runs_each_side_in_a_new_kvchat_process_and_writes_its_report(tmp_path, monkeypatch):
    calls = []

    def fake_spawn(command, env):
        out = Path(command[command.index("--out") + 1])
        on = "KVCHAT_KERNELS" not in env
        calls.append((command, env.get("KVCHAT_KERNELS")))
        out.mkdir(parents=True)
        rows = [row("window", 2048, 1.0 if on else 1.5, 60.0 if on else 40.0, 0.05)]
        (out / "speed_methods.json").write_text(json.dumps({"rows": rows}))
        return 0

    monkeypatch.setattr(kernels, "spawn", fake_spawn)
    monkeypatch.delenv("KVCHAT_KERNELS", raising=False)
    argv = ["bench", "speed", "--parts", "kernels", "--methods", "window", "--contexts", "2048"]
    rows = kernels.run(tmp_path / "report", quick=False, argv=argv)
    assert [side for _, side in calls] == [None, "off", "off", None]
    assert all(command[:3] == [sys.executable, "-m", "kvchat"] for command, _ in calls)
    assert all(
        command[3:-4] == argv[:2] + argv[4:] and command[-4:-2] == ["--parts", "methods"] for command, _ in calls
    )
    assert rows[0]["ttft_speedup"] == 1.5 and rows[0]["decode_speedup"] == 1.5 and rows[0]["rounds"] == 2
    data = json.loads((tmp_path / "report" / "speed_kernels.json").read_text())
    assert data["off"] == "off" and data["rounds"] == 2 and len(data["on_rows"]) == 2
    assert "KVCHAT_KERNELS=off" in (tmp_path / "report" / "speed_kernels.md").read_text()


def test_a_side_that_fails_stops_the_part(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "spawn", lambda command, env: 2)
    with pytest.raises(RuntimeError, match="kernels on side failed"):
        kernels.run(tmp_path, quick=True, argv=["bench", "speed", "--parts", "kernels"])


def test_speed_runs_the_kernels_part_alone_without_loading_a_model(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(kernels, "run", lambda out, quick: ran.append((out, quick)))
    monkeypatch.setattr("kvchat.model.engine.load_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    assert speed.run(BenchOptions(suite="speed", parts=("kernels",), out=tmp_path, quick=True)) == 0
    assert ran == [(tmp_path, True)]


def test_kernels_is_a_named_part_not_a_default_one():
    assert "kernels" not in speed.PARTS and "kernels" in speed.NAMED_PARTS
    with pytest.raises(ValueError, match="kernels"):
        speed.run(BenchOptions(suite="speed", parts=("kernel",)))
