"""Model stores built inside a test's folder, laid out as the Hugging Face hub cache,
Ollama and LM Studio lay theirs out, and pointed to by the environment variables those
tools (and kvchat) read. Nothing is downloaded: GGUF files are written by gguf-py."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OLLAMA_CONFIG_LAYER = "application/vnd.docker.container.image.v1+json"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass
class Stores:
    hub: Path  # $HF_HUB_CACHE
    ollama: Path  # $OLLAMA_MODELS
    lmstudio: Path  # $LMSTUDIO_MODELS


def point_stores_at(tmp_path: Path, monkeypatch) -> Stores:
    """Empty stores under tmp_path, and the environment pointing at them (so the user's
    own stores never show up in a test)."""
    stores = Stores(tmp_path / "hf-hub", tmp_path / "ollama-models", tmp_path / "lmstudio-models")
    for name, root in (
        ("HF_HUB_CACHE", stores.hub),
        ("OLLAMA_MODELS", stores.ollama),
        ("LMSTUDIO_MODELS", stores.lmstudio),
    ):
        monkeypatch.setenv(name, str(root))
    return stores


def write_gguf(path: Path, architecture: str, *, whole: bool = False) -> Path:
    """A small GGUF file (one float32 tensor) written by gguf-py, under any file name.
    `whole` adds the metadata a whole model has (block count, width, a vocabulary)."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), architecture)
    if whole:
        writer.add_block_count(1)
        writer.add_embedding_length(64)
        writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def commit_of(repo: str, revision: str) -> str:
    return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()


def add_hf_repo(
    hub: Path, repo: str, files: dict[str, bytes], *, revision: str = "main", ref: bool = True, commit: str = ""
) -> Path:
    """A repo as `hf download` leaves it: each file's bytes in blobs/, the snapshot's files
    as relative links to them, refs/REVISION holding the commit. The snapshot folder."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    commit = commit or commit_of(repo, revision)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / digest).write_bytes(data)
        os.symlink(Path("..", "..", "blobs", digest), snapshot / name)
    if ref:
        (folder / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / revision).write_text(commit)
    return snapshot


def hf_config(model_type: str) -> dict[str, bytes]:
    """The files a hub repo needs to be listed: a config naming its family, a tokenizer."""
    return {"config.json": json.dumps({"model_type": model_type}).encode(), "tokenizer.json": b"{}"}


def add_ollama_model(
    root: Path, name: str, tag: str, blob: bytes, *, namespace: str = "library", registry: str = "registry.ollama.ai"
) -> Path:
    """A model as `ollama pull` leaves it: the blob named by its digest, and a manifest
    naming it as the model layer (beside a config layer). The blob's path."""
    digest = hashlib.sha256(blob).hexdigest()
    path = root / "blobs" / f"sha256-{digest}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    manifest = root / "manifests" / registry / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}", "size": len(blob)}]
    config = {"mediaType": OLLAMA_CONFIG_LAYER, "digest": "sha256:" + "0" * 64, "size": 2}
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": config, "layers": layers}))
    return path


def gguf_bytes(tmp_path: Path, architecture: str) -> bytes:
    return write_gguf(tmp_path / f"scratch-{architecture}.gguf", architecture, whole=True).read_bytes()
