"""`kvchat ask --model` on odd model folders and GGUF files: each ends in exactly one line
on stderr naming the cause (exit code 2), never a traceback, and a family kvchat cannot
serve is refused before its weights load. Every folder and file is built here from a
random-weight model or by hand; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fake_stores import write_gguf

from kvchat.model.families import SUPPORTED

SUPPORTED_LIST = ", ".join(SUPPORTED)


@pytest.fixture
def tiny_copy(tiny_llama_dir, tmp_path) -> Path:
    """A copy of the tiny folder that a test may damage."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "tiny"))


def ask(model: Path, capsys, monkeypatch, tmp_path: Path, *extra: str) -> tuple[int, list[str]]:
    """`kvchat ask hi --model MODEL` in this process: exit code and stderr lines. Data (weight
    caches, measurements) go to a fresh home under tmp_path."""
    from kvchat.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVCHAT_DB", str(tmp_path / "kvchat.db"))
    code = main(["ask", "hi", "--model", str(model), "--device", "cpu", *extra])
    return code, capsys.readouterr().err.strip().splitlines()


def assert_one_line(code: int, lines: list[str], *words: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvchat: error: ")
    for word in words:
        assert word in lines[0], lines[0]


def hand_written_config(folder: Path, config: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- supported ----------------------------------------------------------------------


def test_a_supported_tiny_model_still_loads_and_answers(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    code, lines = ask(tiny_llama_dir, capsys, monkeypatch, tmp_path, "--dtype", "float32", "--max-new-tokens", "2")
    assert code == 0, lines
    assert not any("error" in line for line in lines)


# --- families -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "mamba"])
def test_a_family_kvchat_cannot_serve_is_refused_naming_it_and_the_supported_ones(
    family, tmp_path, capsys, monkeypatch
):
    folder = hand_written_config(tmp_path / family, {"model_type": family, "hidden_size": 64})
    code, lines = ask(folder, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, f"model family '{family}' is not supported yet", f"supported: {SUPPORTED_LIST}")


def test_an_unknown_family_is_refused_too(tmp_path, capsys, monkeypatch):
    folder = hand_written_config(tmp_path / "new", {"model_type": "brand_new_arch"})
    code, lines = ask(folder, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "'brand_new_arch' is not supported yet", f"supported: {SUPPORTED_LIST}")


def test_the_refusal_comes_before_any_weights_load(tiny_copy, tmp_path, capsys, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded for a refused family")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_load)
    config = json.loads((tiny_copy / "config.json").read_text())
    (tiny_copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt_oss"}))
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "'gpt_oss' is not supported yet", "learned attention sinks")


# --- odd folders --------------------------------------------------------------------


def test_a_config_that_is_not_json(tiny_copy, tmp_path, capsys, monkeypatch):
    (tiny_copy / "config.json").write_text('{"model_type": "llama",')
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "config.json is not valid JSON", "restore it")


def test_a_config_without_model_type(tiny_copy, tmp_path, capsys, monkeypatch):
    config = json.loads((tiny_copy / "config.json").read_text())
    del config["model_type"]
    (tiny_copy / "config.json").write_text(json.dumps(config))
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "names no model_type", "family is unknown")


@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size"])
def test_a_config_without_the_models_size_is_refused_before_the_load(key, tiny_copy, tmp_path, capsys, monkeypatch):
    """Without them transformers would build its default size (a 7B Llama) and run out of
    memory, not into an error."""
    config = json.loads((tiny_copy / "config.json").read_text())
    del config[key]
    (tiny_copy / "config.json").write_text(json.dumps(config))
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, f"gives no {key}", "restore it")


def test_a_folder_without_a_tokenizer(tiny_copy, tmp_path, capsys, monkeypatch):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tiny_copy / name).unlink()
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "has no tokenizer", "copy the tokenizer files")


def test_a_tokenizer_with_an_empty_vocabulary(tmp_path, capsys, monkeypatch):
    """transformers builds Qwen2's tokenizer from an empty vocab.json without complaint;
    it turns every text into no ids (which used to end in an embedding traceback)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    folder = tmp_path / "qwen2"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    (folder / "vocab.json").write_text("{}")
    (folder / "merges.txt").write_text("")
    code, lines = ask(folder, capsys, monkeypatch, tmp_path, "--dtype", "float32")
    assert_one_line(code, lines, "turns text into no tokens", "copy the model's tokenizer files")


def test_a_folder_without_weights(tiny_copy, tmp_path, capsys, monkeypatch):
    (tiny_copy / "model.safetensors").unlink()
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "has no weights")


@pytest.mark.parametrize("keep", [0.5, 1_000])
def test_a_truncated_safetensors_file(keep, tiny_copy, tmp_path, capsys, monkeypatch):
    """Cut in its data (half the file) or in its header (the first 1,000 bytes)."""
    weights = tiny_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    code, lines = ask(tiny_copy, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "model.safetensors is truncated or damaged", "download it again")


# --- odd GGUF files -----------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all, just some text\n" * 10], ids=["empty", "text"])
def test_a_gguf_file_that_is_not_one(content, tmp_path, capsys, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    code, lines = ask(path, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "is empty" if not content else "is not a GGUF model file")


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_truncated_gguf_file(where, tmp_path, capsys, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1_000] if where == "data" else data[:40])
    code, lines = ask(path, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "is truncated", "download it again")
    assert not (tmp_path / "home" / "models").exists() or not any((tmp_path / "home" / "models").iterdir())


def test_a_gguf_whose_tensor_table_names_an_unknown_type_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """The header and sizes pass the preflight (an unknown type's size is not known), so
    the conversion itself meets the damage: after the line announcing it, one line, and
    no copy left behind."""
    import struct

    from tiny_gguf import tiny_model, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "model.gguf", "llama", tiny_model("llama"))
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    (dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * dims, 4)  # ggml type 4: Q4_2, dropped from ggml long ago
    path.write_bytes(bytes(data))
    code, lines = ask(path, capsys, monkeypatch, tmp_path)
    assert lines[0].startswith("kvchat: converting model.gguf once")
    assert_one_line(code, lines[1:], "could not convert", "model.gguf", "is not a valid GGMLQuantizationType")
    assert not any((tmp_path / "home" / "models").iterdir())


def test_a_gguf_of_a_family_kvchat_cannot_serve(tmp_path, capsys, monkeypatch):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba")
    code, lines = ask(path, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "model family 'mamba' is not supported yet", f"supported: {SUPPORTED_LIST}")


def test_a_gguf_without_the_model_metadata_is_refused_before_the_load(tmp_path, capsys, monkeypatch):
    """Without block_count and the rest, transformers would build its default-sized model
    (a 7B-parameter Llama) and run out of memory."""
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("a model was built from a GGUF without its sizes")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    path = write_gguf(tmp_path / "adapter.gguf", "llama")
    code, lines = ask(path, capsys, monkeypatch, tmp_path)
    assert_one_line(code, lines, "has no llama.block_count in its metadata", "not a whole model")


def test_the_ggml_block_sizes_are_gguf_pys():
    from gguf.constants import GGML_QUANT_SIZES

    from kvchat.model.preflight import GGML_BLOCKS

    assert {int(kind): size for kind, size in GGML_QUANT_SIZES.items()} == GGML_BLOCKS
