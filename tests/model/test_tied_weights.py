"""A model whose input and output embeddings are one tensor, saved under the output's
name (as safetensors' `save_model` and the GGUF copy write it), loads with that tensor
under both names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from transformers import LlamaForCausalLM

from kvchat.model.loading import load_model, tied_key_mapping


@pytest.fixture(scope="module")
def kept_as_output(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny Llama folder, its weights rewritten by `save_model` (the tied embedding
    kept as `lm_head.weight`, the input embedding recorded against it)."""
    folder = tmp_path_factory.mktemp("kept-as-output")
    for file in tiny_llama_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    save_model(LlamaForCausalLM.from_pretrained(tiny_llama_dir), str(folder / "model.safetensors"))
    return folder


def test_the_kept_output_embedding_loads_under_the_input_embeddings_name(kept_as_output):
    assert tied_key_mapping(kept_as_output) == {r"^lm_head\.weight$": "model.embed_tokens.weight"}


def test_a_folder_saved_by_transformers_needs_no_renaming(tiny_llama_dir):
    assert tied_key_mapping(tiny_llama_dir) == {}


def test_both_embeddings_are_the_saved_tensor(kept_as_output, tiny_llama_dir):
    saved = LlamaForCausalLM.from_pretrained(tiny_llama_dir).model.embed_tokens.weight
    model = load_model(str(kept_as_output), device="cpu", dtype="float32").model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, saved)
