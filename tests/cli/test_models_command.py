"""`kvchat models`: every model on this disk by the name `--model` takes, with its family,
its size and a mark where kvchat cannot run it; offline, from headers only. The stores
are built in the test's folder (tests/fake_stores.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_stores import add_hf_repo, add_ollama_model, gguf_bytes, hf_config, point_stores_at, write_gguf

from kvchat.model.families import SUPPORTED
from kvchat.model.sources import resolve

REPO = Path(__file__).resolve().parents[2]
# A family no one is adding support for (kvchat runs decoder-only Llama-like models).
UNSUPPORTED = "t5"


@pytest.fixture
def stores(tmp_path, monkeypatch):
    return point_stores_at(tmp_path, monkeypatch)


@pytest.fixture
def full_stores(stores, tmp_path):
    """One model in each store, and one hub repo of a family kvchat cannot run."""
    add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"))
    add_hf_repo(stores.hub, "Org/Text-To-Text", hf_config(UNSUPPORTED))
    add_ollama_model(stores.ollama, "qwen3", "0.6b", gguf_bytes(tmp_path, "qwen3"))
    write_gguf(stores.lmstudio / "pub" / "Tiny-GGUF" / "tiny-Q4_K_M.gguf", "llama", whole=True)
    return stores


def models(capsys, *extra: str) -> tuple[int, str, str]:
    """`kvchat models` in this process: exit code, stdout, stderr."""
    from kvchat.cli import main

    code = main(["models", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def listed(capsys) -> dict:
    code, out, _ = models(capsys, "--json")
    assert code == 0
    return json.loads(out)


def test_each_store_is_listed_by_the_name_model_takes(full_stores, capsys):
    names = [row["model"] for row in listed(capsys)["models"]]
    assert names == [None, "Org/Text-To-Text", "Org/Tiny", "ollama:qwen3:0.6b", "lmstudio:pub/Tiny-GGUF"]


def test_every_name_listed_resolves_to_the_file_or_folder_listed(full_stores, capsys):
    for row in listed(capsys)["models"]:
        assert str(resolve(row["model"]).path) == row["path"]


def test_each_model_has_its_family_from_its_config_or_gguf_header(full_stores, capsys):
    families = {row["name"]: row["family"] for row in listed(capsys)["models"]}
    assert families == {
        "SmolLM2-135M-Instruct": "llama",
        "Org/Text-To-Text": UNSUPPORTED,
        "Org/Tiny": "llama",
        "ollama:qwen3:0.6b": "qwen3",
        "lmstudio:pub/Tiny-GGUF": "llama",
    }


def test_each_model_has_its_size_on_disk(full_stores, capsys):
    rows = {row["name"]: row for row in listed(capsys)["models"]}
    blob = resolve("ollama:qwen3:0.6b").path
    assert rows["ollama:qwen3:0.6b"]["bytes"] == blob.stat().st_size
    # A hub snapshot's files are links into blobs/: their targets' bytes count.
    assert rows["Org/Tiny"]["bytes"] == sum(len(data) for data in hf_config("llama").values())
    assert rows["SmolLM2-135M-Instruct"]["size"] == "98.4 MB"


def test_a_family_kvchat_cannot_run_is_marked_with_why(full_stores, capsys):
    rows = {row["name"]: row for row in listed(capsys)["models"]}
    assert rows["Org/Text-To-Text"]["supported"] is (UNSUPPORTED in SUPPORTED)
    assert rows["Org/Tiny"]["supported"] is True and rows["Org/Tiny"]["why_not"] is None
    if UNSUPPORTED not in SUPPORTED:
        assert rows["Org/Text-To-Text"]["why_not"] == f"kvchat runs {', '.join(SUPPORTED)}"


def test_the_table_has_a_row_per_model_with_family_size_and_the_mark(full_stores, capsys):
    code, out, err = models(capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["--model", "family", "size"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["(no"].split()[2:5] == ["llama", "98.4", "MB"]
    assert "the embedded SmolLM2-135M-Instruct" in rows["(no"]
    assert rows["ollama:qwen3:0.6b"].split()[1] == "qwen3"
    assert "not supported: kvchat runs" in rows["Org/Text-To-Text"]
    assert "not supported" not in rows["Org/Tiny"]


def test_a_broken_entry_is_skipped_with_a_note_and_the_rest_listed(full_stores, tmp_path, capsys):
    gone = add_ollama_model(full_stores.ollama, "gone", "latest", gguf_bytes(tmp_path, "llama"))
    gone.unlink()
    add_hf_repo(full_stores.hub, "Org/Broken", {"config.json": b'{"model_type": '})
    truncated = add_ollama_model(full_stores.ollama, "cut", "latest", gguf_bytes(tmp_path, "qwen2")[:200])
    found = listed(capsys)
    assert len(found["models"]) == 5
    skipped = found["skipped"]
    assert len(skipped) == 3
    assert any("ollama:gone:latest" in note and "is missing" in note for note in skipped)
    assert any(note.startswith("Org/Broken: ") and "not valid JSON" in note for note in skipped)
    assert any(note.startswith("ollama:cut:latest: ") and str(truncated) in note for note in skipped)
    code, out, _ = models(capsys)
    assert code == 0 and sum(line.startswith("skipped ") for line in out.splitlines()) == 3


def test_nothing_found_beyond_the_embedded_model_says_where_it_looked(stores, capsys):
    code, out, _ = models(capsys)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 3 and lines[1].startswith("(no --model)")
    assert lines[2].startswith("no other models found; looked in the Hugging Face cache")
    for root in (stores.hub, stores.ollama, stores.lmstudio):
        assert str(root) in lines[2]


def test_the_json_names_where_it_looked(stores, capsys):
    found = listed(capsys)
    assert found["looked_in"] == {
        "huggingface": [str(stores.hub)],
        "ollama": [str(stores.ollama)],
        "lmstudio": [str(stores.lmstudio)],
    }
    assert found["skipped"] == [] and [row["source"] for row in found["models"]] == ["embedded"]


def test_listing_imports_no_torch(full_stores):
    """Headers only: the command answers without loading torch or any weight."""
    code = "import sys; from kvchat.cli import main; main(['models']); print('torch' in sys.modules)"
    environment = {**os.environ, "PYTHONPATH": str(REPO)}  # (the stores' variables set by the fixture)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"
