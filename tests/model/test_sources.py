"""What `--model` takes: a path, a repo id in the Hugging Face cache, `ollama:NAME[:TAG]`,
`lmstudio:PUBLISHER/REPO`, each found on disk and never downloaded; what cannot be found
is one line naming it, where kvchat looked and the way out. The stores are built in the
test's folder (tests/fake_stores.py) and pointed to by their environment variables."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fake_stores import add_hf_repo, add_ollama_model, commit_of, gguf_bytes, hf_config, point_stores_at, write_gguf

from kvchat.errors import ModelError
from kvchat.model.sources import hf_cache_root, resolve


@pytest.fixture
def stores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return point_stores_at(tmp_path, monkeypatch)


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# --- paths ------------------------------------------------------------------------------


def test_an_existing_folder_is_a_path_even_when_it_reads_like_a_repo_id(stores, tmp_path):
    add_hf_repo(stores.hub, "models/tiny", hf_config("llama"))
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    found = resolve("models/tiny")
    assert found.store == "path" and found.path == Path("models/tiny")


def test_a_path_is_taken_as_it_is_with_the_home_folder_expanded(stores, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    gguf = write_gguf(tmp_path / "my.gguf", "llama")
    found = resolve("~/my.gguf")
    assert found.path == gguf and found.name == "my.gguf"


def test_a_missing_path_says_it_does_not_exist(stores):
    with pytest.raises(ModelError) as err:
        resolve("/no/such/model")
    assert "model path /no/such/model does not exist" in one_line(err)


def test_no_model_named_means_the_embedded_one():
    found = resolve(None)
    assert found.store == "embedded" and found.name == "SmolLM2-135M-Instruct" and found.path.is_file()


def test_anything_else_names_the_forms_model_takes(stores):
    with pytest.raises(ModelError) as err:
        resolve("just-a-word")
    message = one_line(err)
    for form in ("Hugging Face repo id (Org/Name)", "ollama:NAME[:TAG]", "lmstudio:PUBLISHER/REPO", "kvchat models"):
        assert form in message


def test_a_bare_name_ollama_has_is_pointed_to_it(stores, tmp_path):
    add_ollama_model(stores.ollama, "qwen3", "latest", gguf_bytes(tmp_path, "qwen3"))
    with pytest.raises(ModelError) as err:
        resolve("qwen3")
    assert "--model ollama:qwen3" in one_line(err)


# --- the Hugging Face cache -------------------------------------------------------------


def test_a_repo_id_is_the_snapshot_refs_main_names(stores):
    snapshot = add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"))
    found = resolve("Org/Tiny")
    assert found.path == snapshot and found.name == "Org/Tiny" and found.store == "huggingface"
    assert (found.path / "config.json").is_file()  # a link into blobs/, read through


def test_a_revision_after_the_at_sign_is_its_ref(stores):
    add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"))
    other = commit_of("Org/Tiny", "v2")
    snapshot = stores.hub / "models--Org--Tiny" / "snapshots" / other
    snapshot.mkdir()
    (stores.hub / "models--Org--Tiny" / "refs" / "v2").write_text(other)
    found = resolve("Org/Tiny@v2")
    assert found.path == snapshot and found.name == "Org/Tiny@v2"


def test_a_commit_hash_after_the_at_sign_is_its_snapshot(stores):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"), ref=False, commit=commit)
    assert resolve(f"Org/Tiny@{commit}").path == snapshot


def test_without_refs_the_only_snapshot_is_used(stores):
    snapshot = add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"), ref=False)
    assert resolve("Org/Tiny").path == snapshot


def test_without_refs_several_snapshots_ask_for_a_revision(stores):
    add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"), ref=False, commit="a" * 40)
    add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"), ref=False, commit="b" * 40)
    with pytest.raises(ModelError) as err:
        resolve("Org/Tiny")
    assert "no refs/main and 2 snapshots" in one_line(err) and "--model Org/Tiny@COMMIT" in one_line(err)


def test_a_repo_not_in_the_cache_names_it_where_kvchat_looked_and_the_way_out(stores):
    with pytest.raises(ModelError) as err:
        resolve("Qwen/Qwen3-0.6B")
    message = one_line(err)
    assert message.startswith("Qwen/Qwen3-0.6B is neither a folder here nor in the Hugging Face cache")
    assert str(stores.hub) in message
    assert "hf download Qwen/Qwen3-0.6B" in message and "pass a model folder" in message


def test_a_revision_not_in_the_cache_is_named(stores):
    add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"))
    with pytest.raises(ModelError) as err:
        resolve("Org/Tiny@v9")
    assert "Org/Tiny has no revision 'v9'" in one_line(err) and "--revision v9" in one_line(err)


def test_a_ref_naming_a_snapshot_that_is_gone_says_so(stores):
    snapshot = add_hf_repo(stores.hub, "Org/Tiny", hf_config("llama"))
    shutil.rmtree(snapshot)
    with pytest.raises(ModelError) as err:
        resolve("Org/Tiny")
    assert "refs/main names the snapshot" in one_line(err) and "download it again" in one_line(err)


def test_a_gguf_only_repo_is_its_gguf_file(stores, tmp_path):
    snapshot = add_hf_repo(stores.hub, "Org/Tiny-GGUF", {"tiny.Q4_0.gguf": gguf_bytes(tmp_path, "llama")})
    assert resolve("Org/Tiny-GGUF").path == snapshot / "tiny.Q4_0.gguf"


@pytest.mark.parametrize(
    ("environment", "root"),
    [
        ({"HF_HUB_CACHE": "/a/hub"}, "/a/hub"),
        ({"HF_HOME": "/b/hf"}, "/b/hf/hub"),
        ({"XDG_CACHE_HOME": "/c/cache"}, "/c/cache/huggingface/hub"),
        ({"HOME": "/d/home"}, "/d/home/.cache/huggingface/hub"),
    ],
)
def test_the_cache_root_is_found_as_huggingface_hub_finds_it(environment, root, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert hf_cache_root() == Path(root)


# --- Ollama -----------------------------------------------------------------------------


def test_an_ollama_name_without_a_tag_is_its_latest(stores, tmp_path):
    blob = add_ollama_model(stores.ollama, "qwen3", "latest", gguf_bytes(tmp_path, "qwen3"))
    found = resolve("ollama:qwen3")
    assert found.path == blob and found.name == "ollama:qwen3" and found.store == "ollama"


def test_an_ollama_tag_picks_its_manifest(stores, tmp_path):
    add_ollama_model(stores.ollama, "qwen3", "latest", gguf_bytes(tmp_path, "qwen3"))
    small = add_ollama_model(stores.ollama, "qwen3", "0.6b", gguf_bytes(tmp_path, "llama"))
    assert resolve("ollama:qwen3:0.6b").path == small


def test_an_ollama_name_with_a_namespace_is_in_that_namespace(stores, tmp_path):
    blob = add_ollama_model(stores.ollama, "tiny", "q4", gguf_bytes(tmp_path, "llama"), namespace="someone")
    assert resolve("ollama:someone/tiny:q4").path == blob


def test_an_ollama_name_with_a_registry_is_in_that_registry(stores, tmp_path):
    blob = add_ollama_model(
        stores.ollama, "Tiny-GGUF", "Q4_K_M", gguf_bytes(tmp_path, "llama"), namespace="org", registry="hf.co"
    )
    assert resolve("ollama:hf.co/org/Tiny-GGUF:Q4_K_M").path == blob


def test_an_ollama_model_not_pulled_names_the_pull_command(stores):
    with pytest.raises(ModelError) as err:
        resolve("ollama:gemma3:1b")
    message = one_line(err)
    assert message.startswith("ollama:gemma3:1b is not in the Ollama store")
    assert str(stores.ollama) in message
    assert "`ollama pull gemma3:1b`" in message and "`kvchat models`" in message


def test_an_ollama_blob_that_is_gone_names_it_and_the_pull_command(stores, tmp_path):
    blob = add_ollama_model(stores.ollama, "qwen3", "0.6b", gguf_bytes(tmp_path, "qwen3"))
    blob.unlink()
    with pytest.raises(ModelError) as err:
        resolve("ollama:qwen3:0.6b")
    assert f"its model blob {blob} is missing" in one_line(err) and "`ollama pull qwen3:0.6b`" in one_line(err)


def test_an_ollama_manifest_without_a_model_layer_says_so(stores, tmp_path):
    add_ollama_model(stores.ollama, "qwen3", "0.6b", gguf_bytes(tmp_path, "qwen3"))
    manifest = stores.ollama / "manifests" / "registry.ollama.ai" / "library" / "qwen3" / "0.6b"
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.license"}]}))
    with pytest.raises(ModelError) as err:
        resolve("ollama:qwen3:0.6b")
    assert "names no model layer" in one_line(err)


@pytest.mark.parametrize("name", ["ollama:", "ollama:../../etc:passwd", "ollama:a/b/c/d"])
def test_a_malformed_ollama_name_is_refused(name, stores):
    with pytest.raises(ModelError) as err:
        resolve(name)
    assert "not an Ollama model name" in one_line(err)


# --- LM Studio --------------------------------------------------------------------------


def test_an_lmstudio_repo_with_one_gguf_is_that_file(stores):
    gguf = write_gguf(stores.lmstudio / "pub" / "Tiny-GGUF" / "tiny-Q4_K_M.gguf", "llama")
    write_gguf(stores.lmstudio / "pub" / "Tiny-GGUF" / "mmproj-tiny-f16.gguf", "clip")  # a vision projector
    found = resolve("lmstudio:pub/Tiny-GGUF")
    assert found.path == gguf and found.name == "lmstudio:pub/Tiny-GGUF"


def test_an_lmstudio_repo_with_several_ggufs_asks_for_one(stores):
    for quant in ("Q4_K_M", "Q8_0"):
        write_gguf(stores.lmstudio / "pub" / "Tiny-GGUF" / f"tiny-{quant}.gguf", "llama")
    with pytest.raises(ModelError) as err:
        resolve("lmstudio:pub/Tiny-GGUF")
    assert "holds 2 GGUF files" in one_line(err) and "lmstudio:pub/Tiny-GGUF/tiny-Q4_K_M.gguf" in one_line(err)
    assert resolve("lmstudio:pub/Tiny-GGUF/tiny-Q8_0.gguf").path.name == "tiny-Q8_0.gguf"


def test_an_lmstudio_model_not_downloaded_names_where_kvchat_looked(stores):
    with pytest.raises(ModelError) as err:
        resolve("lmstudio:pub/Nothing-GGUF")
    assert str(stores.lmstudio) in one_line(err) and "download it in LM Studio" in one_line(err)


# --- loading what was found ---------------------------------------------------------------


def ask(spec: str, capsys, monkeypatch, tmp_path: Path, *extra: str) -> tuple[int, list[str], str]:
    """`kvchat ask hi --model SPEC` in this process, its data under tmp_path: exit code,
    stderr lines, stdout."""
    from kvchat.cli import main

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVCHAT_DB", str(tmp_path / "kvchat.db"))
    argv = ["ask", "hi", "--model", spec, "--device", "cpu", "--dtype", "float32", "--recall", "off", *extra]
    code = main([*argv, "--max-new-tokens", "2", "--no-save", "--json"])
    out, err = capsys.readouterr()
    return code, err.strip().splitlines(), out


@pytest.fixture(scope="module")
def tiny_llama_files(tiny_llama_dir) -> dict[str, bytes]:
    """The tiny Llama's files (config, weights, the embedded model's tokenizer), as a hub
    repo holds them."""
    return {f.name: f.read_bytes() for f in tiny_llama_dir.iterdir()}


def test_a_repo_id_in_the_cache_loads_and_answers_under_that_name(
    stores, tiny_llama_files, capsys, monkeypatch, tmp_path
):
    add_hf_repo(stores.hub, "kvchat-tests/Tiny-Llama", tiny_llama_files)
    code, lines, out = ask("kvchat-tests/Tiny-Llama", capsys, monkeypatch, tmp_path)
    assert code == 0, lines
    answer = json.loads(out)
    assert answer["model"] == "kvchat-tests/Tiny-Llama" and answer["new_tokens"] >= 1


def test_the_config_file_key_model_takes_a_repo_id_too(stores, capsys, monkeypatch, tmp_path):
    from kvchat.cli import main

    config = tmp_path / "config.toml"
    config.write_text('model = "Org/Not-Downloaded"\n')
    monkeypatch.setenv("KVCHAT_CONFIG", str(config))
    code = main(["ask", "hi", "--no-save"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(
        "kvchat: error: Org/Not-Downloaded is neither a folder here nor in the Hugging Face cache"
    )


@pytest.mark.parametrize("spec", ["path", "ollama"])
def test_a_file_without_a_suffix_that_is_not_a_gguf_is_refused_in_one_line(spec, stores, capsys, monkeypatch, tmp_path):
    text = b"not a model, just some text\n" * 10
    blob = add_ollama_model(stores.ollama, "notes", "latest", text)
    code, lines, _ = ask(str(blob) if spec == "path" else "ollama:notes", capsys, monkeypatch, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert f"{blob} is not a GGUF model file (it does not start with 'GGUF')" in lines[0]


@pytest.mark.slow  # converts the embedded model's GGUF once more (about 30 s)
def test_an_ollama_blob_without_a_suffix_converts_loads_and_answers_under_its_ollama_name(
    stores, capsys, monkeypatch, tmp_path
):
    from kvchat.model.sources import embedded_model_path

    blob = add_ollama_model(stores.ollama, "smollm2", "135m", embedded_model_path().read_bytes())
    assert blob.suffix == ""
    code, lines, out = ask("ollama:smollm2:135m", capsys, monkeypatch, tmp_path)
    assert code == 0, lines
    assert any("converting ollama:smollm2:135m once" in line for line in lines)
    answer = json.loads(out)
    assert answer["model"] == "ollama:smollm2:135m" and answer["new_tokens"] >= 1
