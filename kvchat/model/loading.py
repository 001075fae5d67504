"""Model loading: the embedded SmolLM2 GGUF, any local HF folder or GGUF file (found by
`kvchat.model.sources` from what the user typed), bitsandbytes.

Nothing here downloads: every load is `local_files_only`, and the hub is switched off
for the process before transformers is imported.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import inspect
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers' GGUF loader draws its own tqdm bar; a chat app should not.
os.environ.setdefault("TQDM_DISABLE", "1")


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (then as before). Importing torch and
    transformers and building a model make about a million long-lived objects, which the
    collector would otherwise walk again and again (importing them took 3.8-4.0 s with it
    and 2.9-3.4 s without, on the 2-core box under load); reference counting still frees
    what dies at once. After a load, `load_engine` freezes what exists (`gc.freeze`:
    modules and the model live as long as the process), so later collections, and the
    process's exit, no longer walk it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The engine imports this module before anything else of its own: the hub is off before
# transformers reads its settings, and torch and transformers load with the collector paused.
with gc_paused():
    import torch
    import transformers

    # What the imports made lives as long as the process: out of the collector's sight
    # (a first full collection after them walked it for about 0.1 s).
    gc.freeze()

# (after torch: kvchat's modules import it too, and it loads under gc_paused above)
from kvchat.errors import ModelError  # noqa: E402
from kvchat.kv_types import LayerGeometry  # noqa: E402
from kvchat.model.families import FamilyAdapter, adapter_for  # noqa: E402
from kvchat.model.preflight import check_model  # noqa: E402
from kvchat.model.sources import embedded_model_path as embedded_model_path  # noqa: E402  (re-exported)
from kvchat.model.sources import resolve  # noqa: E402
from kvchat.optional import INSTALL  # noqa: E402
from kvchat.paths import models_dir  # noqa: E402
from kvchat.runtime import cpu_has_fast_bf16  # noqa: E402


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM
    tokenizer: Any
    source: str  # what the user asked for (--model), "embedded" for the default
    fingerprint: str  # stable hash of what was loaded and how (snapshots check it)
    device: torch.device
    dtype: torch.dtype
    quant: str | None
    weights: str = "float"  # "float" (weights in `dtype`) or "int8" (weight-only int8 linears)
    from_cache: bool = False  # int8 weights read from the weight cache (nothing quantised in this load)
    label: str = ""  # the user's name for the model (`kvchat.model.sources.ModelSource.name`)

    @property
    def config(self) -> Any:
        """The language model's config (a multimodal model's text config)."""
        return self.model.config.get_text_config()

    @functools.cached_property
    def adapter(self) -> FamilyAdapter:
        """The model family's adapter: where the layers are, what each one does."""
        return adapter_for(self.model)

    @functools.cached_property
    def geometry(self) -> list[LayerGeometry]:
        """Each layer's RoPE, sliding window and soft-capping (`FamilyAdapter.geometry`)."""
        return self.adapter.geometry()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        return self.adapter.max_positions()

    @property
    def precision(self) -> str:
        """How the weights run, for display: "int8+bf16", "float32", "8bit", ..."""
        if self.quant:
            return self.quant
        dtype = str(self.dtype).removeprefix("torch.")
        return f"int8+{dtype.replace('bfloat16', 'bf16')}" if self.weights == "int8" else dtype

    @property
    def name(self) -> str:
        """The model as the user named it (a repo id, `ollama:NAME:TAG`, a folder's name),
        never the file it resolved to (a snapshot hash, an Ollama blob's digest)."""
        if self.label:
            return self.label
        return "SmolLM2-135M-Instruct" if self.source == "embedded" else Path(self.source).name

    def bytes_per_token(self) -> int:
        """KV bytes one exact token costs across all layers (keys + values)."""
        elem = torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else 1
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def cache_keyword(model: Any) -> str:
    """The keyword `model.forward` takes the cache by. transformers 5.24 renamed
    `past_key_values` to `cache` in some models (the old name still works there, with a
    FutureWarning on every start) and kept it in others, so ask the model."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelError(f"unknown device {device!r}; use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but no CUDA GPU is visible to PyTorch; use --device cpu")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `--dtype int8`: int8 weight-only linears computing in bfloat16 (kvchat/model/int8.py).
INT8 = "int8"


def resolve_dtype(dtype: str, device: torch.device) -> tuple[str, torch.dtype]:
    """(weight format, compute dtype) for `--dtype`. The weight format is "int8"
    (weight-only int8 linears) or "float" (weights in the compute dtype).

    `auto` picks the fastest path measured for this hardware
    (docs/decisions/0004-int8-weights-on-cpu.md):
    - CUDA: bf16 where supported, else fp16;
    - a CPU with native bf16 (AVX512-BF16 or AMX): int8 weights + bf16 compute, about
      3x the fp32 decode speed; greedy answers agree with fp32's for a prefix, not token
      for token;
    - any other CPU: float32 (bf16 is emulated there and int8 needs bf16 compute).
    `float32` is always the exact path."""
    if dtype == "auto":
        if device.type == "cuda":
            return "float", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if cpu_has_fast_bf16():
            from kvchat.model.int8 import int8_available

            if int8_available():
                return INT8, torch.bfloat16
        return "float", torch.float32
    if dtype == INT8:
        if device.type != "cpu":
            raise ModelError("--dtype int8 is the CPU fast path; on a GPU use --dtype bfloat16 or --quant 8bit")
        return INT8, torch.bfloat16
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; use auto, int8, {', '.join(DTYPES)}")
    return "float", DTYPES[dtype]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _source_identity(path: Path) -> str:
    """Content identity of a model file or folder: weights by size+name, configs by hash."""
    if path.is_file():
        stat = path.stat()
        return f"file:{path.name}:{stat.st_size}:{_file_digest(path)[:16]}"
    parts = []
    for f in sorted(path.iterdir()):
        if f.suffix in (".json", ".model", ".txt", ".tiktoken"):
            parts.append(f"{f.name}:{_file_digest(f)[:16]}")
        elif f.is_file():
            parts.append(f"{f.name}:{f.stat().st_size}")
    return "dir:" + ";".join(parts)


def fingerprint_for(identity: str, dtype: torch.dtype, quant: str | None) -> str:
    raw = json.dumps({"source": identity, "dtype": str(dtype), "quant": quant}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _check_path(path: Path) -> None:
    """A file is taken for a GGUF whatever its name (an Ollama blob has no suffix): the
    preflight reads its first bytes and refuses anything else in one line."""
    if not path.exists():
        raise ModelError(f"model path {path} does not exist; pass a local HF model folder or a GGUF file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json; it is not a Hugging Face model folder")
    if not os.access(path, os.R_OK):
        raise ModelError(f"model path {path} is not readable (permissions)")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _as_model_error(err: Exception, doing: str) -> Exception:
    """What to raise for an error from transformers' loading: a missing package kvchat
    names an install command for as it is (the front end prints that command), anything
    else as one line."""
    if isinstance(err, ModelError):
        return err
    if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] in INSTALL:
        return err
    return ModelError(f"{doing}: {_first_line(err)}")


def _check_tokenizer(tokenizer: Any, folder: Path) -> None:
    """transformers builds some tokenizers (Qwen2's) with an empty vocabulary when the
    folder holds none of their files; such a tokenizer turns text into no ids."""
    try:
        ids = tokenizer("Hello", add_special_tokens=False).input_ids
    except Exception as err:
        raise ModelError(f"the tokenizer in {folder} cannot encode text ({_first_line(err)})") from None
    if not ids:
        raise ModelError(
            f"the tokenizer in {folder} turns text into no tokens (an empty vocabulary); "
            "copy the model's tokenizer files into the folder"
        )


StatusFn = Callable[[str], None]


def _copy_folder(gguf: Path) -> Path:
    """Where the converted copy of `gguf` lives: keyed by the file's name, size and
    modification time, so finding it costs one stat (no hashing of the file)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return models_dir() / f"{gguf.stem}-{key}"


def converted_copy(gguf: Path, on_status: StatusFn | None = None, label: str = "") -> tuple[Path, str] | None:
    """A float32 safetensors copy (weights, config, tokenizer) of a GGUF model under the
    models folder, made once: transformers' GGUF loading dequantises every tensor in
    Python at every load, the copy loads memory-mapped in about 2 s. The copy is written
    tensor by tensor (`kvchat.model.gguf_copy`), so making it never holds the float32
    model in memory; a file the stream cannot reproduce exactly is converted through
    transformers (`convert_with_transformers`). Returns (folder, content identity of the
    GGUF), or None when the copy cannot be written (a read-only models folder): the
    caller then loads the GGUF itself. `label` names the model in the status line (an
    Ollama blob's own name is its digest); transformers takes a GGUF file of any name."""
    folder = _copy_folder(gguf)
    source = folder / "source.json"
    if (folder / "config.json").is_file() and source.is_file():
        try:
            return folder, json.loads(source.read_text())["identity"]
        except (ValueError, KeyError):
            pass  # a damaged record: convert again below
    from kvchat.model.gguf_copy import NotStreamable, write_copy

    if on_status is not None:
        on_status(f"converting {label or gguf.name} once to {folder} (about 20 s; later starts load the copy)")
    identity = _source_identity(gguf)
    tmp = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    try:
        try:
            write_copy(gguf, tmp)
        except NotStreamable:
            convert_with_transformers(gguf, tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "identity": identity}))
        try:
            tmp.rename(folder)  # atomic: a half-written copy is never used
        except OSError:
            if not (folder / "source.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written copy left behind
        raise
    return folder, identity


def convert_with_transformers(gguf: Path, folder: Path) -> None:
    """The float32 copy of `gguf` written into `folder` through transformers' GGUF loading:
    the whole model dequantised in memory, then saved. For the files the stream
    (`kvchat.model.gguf_copy`) cannot reproduce exactly."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # save_pretrained refuses GGUF-loaded models; the weights are plain floats now, so
    # write them and a config without the GGUF quantisation entry directly.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)


def _stat_key(folder: Path) -> str:
    """Where a model folder is and when its files last changed: a rewritten file (same
    name and size, other weights) gives another key, at the cost of a few stats."""
    root = folder.resolve()
    parts = [str(root)]
    for f in sorted(root.iterdir()):
        if f.is_file():
            stat = f.stat()
            parts.append(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def int8_cache(folder: Path, fingerprint: str) -> tuple[Path, dict[str, str]]:
    """(where the int8 weights of the model in `folder` are cached, the metadata that file
    must carry to be used). The metadata names the folder's files as they are now (path,
    sizes, modification times), the cache's format and the kvchat and transformers
    versions that wrote it (the file holds buffers transformers computes, such as RoPE
    frequencies): when any of these changes, the weights are quantised again."""
    from kvchat import __version__
    from kvchat.model.int8 import CACHE_FORMAT

    expect = {
        "format": CACHE_FORMAT,
        "kvchat": __version__,
        "transformers": transformers.__version__,
        "source": _stat_key(folder),
    }
    return models_dir() / f"{folder.name}-{fingerprint}.int8.safetensors", expect


def _loaded_int8(
    folder: Path,
    int8_file: Path,
    source: str,
    label: str,
    fingerprint: str,
    dev: torch.device,
    dtype: torch.dtype,
    tokenizer: Any = None,
) -> LoadedModel:
    """The int8 fast path from its weight cache (see `load_model`); `tokenizer` when the
    caller has loaded it already."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from kvchat.model.int8 import load_quantized

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = load_quantized(config, str(int8_file), dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)  # type: ignore[assignment]  # a transformers model
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=str(source),
        fingerprint=fingerprint,
        device=dev,
        dtype=dtype,
        quant=None,
        weights=INT8,
        from_cache=True,
        label=label,
    )


def _write_int8(model: Any, int8_file: Path, metadata: dict[str, str], dtype: torch.dtype) -> bool:
    """Quantise the float `model` into the int8 weight cache, one linear at a time
    (atomically: a half-written file is never read). False where it cannot be written."""
    from kvchat.model.int8 import quantize_to_file

    tmp = int8_file.with_name(f"{int8_file.name}.partial-{os.getpid()}")
    try:
        int8_file.parent.mkdir(parents=True, exist_ok=True)
        quantize_to_file(model, str(tmp), metadata, dtype)
        tmp.replace(int8_file)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def tied_key_mapping(folder: Path) -> dict[str, str]:
    """The `key_mapping` that loads a tied weight under the name transformers ties from.

    A tied weight is one tensor under two names; safetensors' `save_model` (and the GGUF
    copy, which writes as it does) keeps the first name in sorted order, the output
    embedding (`lm_head.weight`), and records the input embedding against it in the
    header's metadata. transformers ties the output to the input, so it finds the input
    missing, fills it with random numbers (0.1-0.25 s for SmolLM2's 28M-entry
    embedding on a 2-core EPYC) and only then swaps the tie round. Loading the kept
    tensor under the input's name gives the same tied tensor without that fill. Empty
    where the folder's single weight file records no such pair."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return {}
    from safetensors import safe_open
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    with safe_open(str(weights), "pt") as file:
        stored_as = file.metadata() or {}  # {name left out: the name its tensor is kept under}
    if not stored_as:
        return {}
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    ties: dict[str, str] = getattr(model_class, "_tied_weights_keys", None) or {}  # {tied: tied from}
    return {
        f"^{re.escape(target)}$": source
        for target, source in ties.items()
        if stored_as.get(source) == target and getattr(config.get_text_config(), "tie_word_embeddings", False)
    }


def load_model(
    path: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quant: str | None = None,
    on_status: StatusFn | None = None,
) -> LoadedModel:
    """Load a causal LM for kvchat. `path` is what the user typed for --model (a folder, a
    GGUF file, a repo id in the hub cache, `ollama:NAME`: `kvchat.model.sources`); None
    means the embedded SmolLM2 GGUF. A GGUF file is converted once to a safetensors copy
    under the models folder and loaded from there afterwards; `on_status` hears about
    that one-off step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    # bitsandbytes warns on every 8-bit matmul and about optional CPU kernels.
    warnings.filterwarnings("ignore", message="MatMul8bitLt")
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

    if quant not in (None, "4bit", "8bit"):
        raise ModelError(f"unknown --quant {quant!r}; use 4bit or 8bit")
    source = "embedded" if path is None else path
    found = resolve(path)
    model_path = found.path
    _check_path(model_path)
    if path is not None:
        # A user's folder or file: its family, tokenizer and weight files are checked
        # from their headers, so an odd one ends in one line, before anything loads.
        check_model(model_path)
    dev = resolve_device(device)
    weights, torch_dtype = resolve_dtype(dtype, dev)
    if quant is not None and weights == INT8:
        if dtype == INT8:
            raise ModelError("--dtype int8 and --quant are two weight formats; pick one")
        weights, torch_dtype = resolve_dtype("float32" if dev.type == "cpu" else "auto", dev)

    identity = None
    if model_path.is_file():
        try:
            copy = converted_copy(model_path, on_status, found.name)
        except Exception as err:
            raise _as_model_error(err, f"could not convert {model_path}") from None
        if copy is not None:
            model_path, identity = copy
        elif quant is not None:
            raise ModelError(f"--quant needs a float copy of {model_path.name}, and {models_dir()} is not writable")
    if identity is None:
        identity = _source_identity(model_path)

    # int8 weights are quantised from the exact float32 weights, then the rest is cast.
    load_dtype = torch.float32 if weights == INT8 else torch_dtype
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": load_dtype}
    if quant is not None:
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError as err:
            raise ModelError(f"--quant needs bitsandbytes ({err}); `pip install bitsandbytes`") from None
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=quant == "8bit",
            load_in_4bit=quant == "4bit",
            bnb_4bit_compute_dtype=torch_dtype,
        )
        kwargs["device_map"] = {"": dev}
    fingerprint = fingerprint_for(identity, torch_dtype, quant or (INT8 if weights == INT8 else None))
    int8_file: Path | None = None
    int8_meta: dict[str, str] = {}
    if weights == INT8 and model_path.is_dir():
        from kvchat.model.int8 import read_metadata

        int8_file, int8_meta = int8_cache(model_path, fingerprint)
        try:
            if int8_file.is_file() and read_metadata(str(int8_file)) == int8_meta:
                return _loaded_int8(model_path, int8_file, source, found.name, fingerprint, dev, torch_dtype)
        except (OSError, ValueError, RuntimeError) as err:
            warnings.warn(f"ignoring the int8 weight cache {int8_file}: {err}", stacklevel=2)
    try:
        if model_path.is_file():
            folder, gguf_file = model_path.parent, model_path.name
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            # (a quantised load keeps transformers' own naming: bitsandbytes' loader is not
            # checked against the rename)
            renamed = tied_key_mapping(model_path) if quant is None else {}
            if renamed:
                kwargs["key_mapping"] = renamed
            model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except Exception as err:  # whatever transformers or safetensors raise for files they cannot read
        raise _as_model_error(err, f"could not load the model from {model_path}") from None
    if path is not None:
        _check_tokenizer(tokenizer, model_path)
    if quant is None:
        model.to(dev)  # type: ignore[arg-type]  # transformers' stub of `to` wants a model
    model.eval()
    if getattr(model.config, "quantization_config", None) is not None and quant is None:
        model.config.quantization_config = None  # GGUF weights are dequantised now
    if weights == INT8:
        from kvchat.model.int8 import quantize_linears

        if int8_file is not None:
            if on_status is not None:
                name = "the embedded model" if path is None else found.name
                on_status(f"quantising {name} to int8 once (a few seconds; later starts read {int8_file})")
            # The float32 weights are memory-mapped from their file; quantised one linear at
            # a time into the weight cache, they are never copied whole, and the model runs
            # on the cache mapped as later starts map it.
            if _write_int8(model, int8_file, int8_meta, torch_dtype):
                del model
                loaded = _loaded_int8(
                    model_path, int8_file, source, found.name, fingerprint, dev, torch_dtype, tokenizer
                )
                loaded.from_cache = False  # quantised in this load
                return loaded
        quantize_linears(model, torch_dtype)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=str(source),
        fingerprint=fingerprint,
        device=dev,
        dtype=torch_dtype,
        quant=quant,
        weights=weights,
        label=found.name,
    )
