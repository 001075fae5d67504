"""A GGUF model's float32 safetensors copy, written one tensor at a time.

transformers' GGUF loading (`from_pretrained(gguf_file=...)`) dequantises every tensor of
the file into memory before it builds the model, so converting a 1B-parameter GGUF held
the whole model in float32 (4.3 GiB at its peak, docs/decisions/0014). Here the copy is
streamed instead: the GGUF stays memory-mapped (`gguf.GGUFReader`), each tensor is
dequantised by gguf-py, put through transformers' own per-architecture processing
(`TensorProcessor`: Llama's q/k permutation undone, Gemma's norm offset) under
transformers' own name map (`get_gguf_hf_weights_map`), and its bytes appended to a
safetensors file whose header went first (every tensor's name and shape are known from
the GGUF's table and the model's layout). One tensor at a time is in memory in float32,
with gguf-py's intermediates.

The copy holds the tensors transformers' conversion holds, bit for bit, with the same
config, generation config and tokenizer (tests/model/test_gguf_copy.py). A file this
cannot reproduce tensor by tensor raises `NotStreamable` before anything is written, and
the caller converts it the old way: an architecture whose processing merges several GGUF
tensors into one (the mixture-of-experts ones), one that transformers loads through its
newer GGUF path, or a file that leaves some weight of the model to its initialiser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The data starts at a multiple of this many bytes (safetensors needs 8; 64 keeps every
# float32 tensor of a usual width on a cache line when the copy is memory-mapped).
ALIGN = 64
FLOAT32 = np.dtype("<f4")


class NotStreamable(Exception):
    """This GGUF cannot be copied tensor by tensor; the message says why. Raised before
    anything is written."""


@dataclass(frozen=True)
class Planned:
    """One tensor of the copy: its name in the model, the GGUF tensor it comes from, its
    shape, and where its bytes go in the data section."""

    name: str
    source: Any  # a gguf.ReaderTensor
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class CopyPlan:
    """What `write_weights` writes: the GGUF's tensors in file order, each under the name
    the model loads it by, and the header's metadata (tied names, as safetensors'
    `save_model` records the ones it leaves out)."""

    gguf: Path
    model: Any  # the model built on the meta device: config, generation config, layout
    processor: Any  # transformers' TensorProcessor for the architecture
    key_mapping: dict[str, str]  # GGUF tensor name -> the model's
    tensors: list[Planned]
    metadata: dict[str, str]


def _one_to_one_processors() -> tuple[type, ...]:
    """transformers' tensor processors that turn one GGUF tensor into one tensor of the
    same shape, never touching others (the only ones a stream can apply as it goes)."""
    from transformers.modeling_gguf_pytorch_utils import (
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        NemotronTensorProcessor,
        TensorProcessor,
    )

    return (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor, NemotronTensorProcessor)


def plan(gguf: Path) -> CopyPlan:
    """Read `gguf`'s header and build its model on the meta device (no weights): which
    GGUF tensor becomes which tensor of the copy. Raises `NotStreamable` for a file the
    stream cannot reproduce exactly, and whatever transformers raises for one it cannot
    load at all (an unknown architecture, a damaged header)."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    # transformers' own reading of the metadata first: its refusals are the ones a user
    # met before this stream existed.
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    reader = GGUFReader(str(gguf))
    architecture = read_field(reader, "general.architecture")[0]
    if is_gguf_arch_supported(architecture):
        raise NotStreamable(f"transformers loads {architecture} GGUF files through its block-keeping path")
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if processor_class not in _one_to_one_processors():
        raise NotStreamable(f"{processor_class.__name__} does not map one GGUF tensor to one tensor")
    if reader.byte_order != "I":
        raise NotStreamable("the file's byte order is not this machine's")

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    processor = processor_class(config=parsed["config"])
    key_mapping = get_gguf_hf_weights_map(model, processor)

    # Tied weights are one tensor under several names; like safetensors' `save_model`,
    # the copy keeps the first name in sorted order and records the others against it.
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    kept_as = {name: sorted(names)[0] for names in shared.values() for name in names}
    metadata = {name: kept for name, kept in sorted(kept_as.items()) if name != kept}

    layout = model.state_dict()
    sources: dict[str, Any] = {}
    for tensor in reader.tensors:
        target = key_mapping.get(tensor.name)
        if target is None:
            continue  # a tensor the model has no place for (llama.cpp's rope_freqs): skipped, as transformers does
        kept = kept_as.get(target, target)
        if kept not in layout:
            raise NotStreamable(f"{tensor.name} maps to {kept}, which the model does not save")
        if kept in sources:
            raise NotStreamable(f"two GGUF tensors load into {kept}")
        sources[kept] = tensor
    missing = sorted(set(layout) - set(metadata) - set(sources))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise NotStreamable(f"the file holds no tensor for {missing[0]}{more}")

    tensors: list[Planned] = []
    offset = 0
    for name, tensor in sorted(sources.items(), key=lambda item: item[1].data_offset):
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape != tuple(layout[name].shape):
            raise NotStreamable(f"{tensor.name} is {list(shape)}, the model's {name} {list(layout[name].shape)}")
        size = int(np.prod(shape, dtype=np.int64)) * FLOAT32.itemsize
        tensors.append(Planned(name, tensor, shape, offset, offset + size))
        offset += size
    return CopyPlan(gguf, model, processor, key_mapping, tensors, metadata)


def _header(copy: CopyPlan) -> bytes:
    """The safetensors header (length prefix included), padded with spaces so that the
    data starts at a multiple of ALIGN."""
    header: dict[str, Any] = {"__metadata__": copy.metadata} if copy.metadata else {}
    for t in copy.tensors:
        header[t.name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [t.start, t.end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return len(raw).to_bytes(8, "little") + raw


def converted(copy: CopyPlan, planned: Planned) -> np.ndarray:
    """One tensor of the copy, in float32, as transformers' GGUF loading makes it:
    gguf-py's dequantisation, then the architecture's processor."""
    from gguf import dequantize

    source = planned.source
    weights = dequantize(source.data, source.tensor_type)
    result = copy.processor.process(
        weights=weights, name=source.name, tensor_key_mapping=copy.key_mapping, parsed_parameters={"tensors": {}}
    )
    # transformers casts with `torch.Tensor.to(float32)`; numpy's cast rounds the same way.
    out = np.ascontiguousarray(result.weights, dtype=FLOAT32)
    if out.shape != planned.shape:
        raise ValueError(f"{source.name} came out {list(out.shape)}, not {list(planned.shape)}")
    return out


def write_weights(copy: CopyPlan, path: Path) -> None:
    """Write the copy's model.safetensors: the header, then each tensor's bytes as it is
    dequantised (one at a time), then check that safetensors reads it back."""
    from safetensors import safe_open

    with path.open("wb") as f:
        f.write(_header(copy))
        for planned in copy.tensors:
            f.write(converted(copy, planned).data)  # C-contiguous: its buffer is its bytes in order
    with safe_open(str(path), framework="pt") as check:
        if set(check.keys()) != {t.name for t in copy.tensors}:
            raise ValueError(f"{path} does not hold the tensors it was written with")


def write_copy(gguf: Path, folder: Path) -> None:
    """Write the float32 copy of `gguf` into `folder` (which exists): config.json,
    generation_config.json, model.safetensors and the tokenizer's files, as transformers'
    conversion would save them. Raises `NotStreamable` (before writing anything) where
    the caller must convert it the old way."""
    from transformers import AutoTokenizer

    copy = plan(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config = copy.model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if copy.model.generation_config is not None:
        copy.model.generation_config.save_pretrained(folder)
    write_weights(copy, folder / "model.safetensors")
    tokenizer.save_pretrained(folder)
