"""What a user's model folder or GGUF file must hold, checked before any weight loads.

Each check reads headers only (config.json, the safetensors headers, the GGUF metadata
and tensor table), so a refusal costs milliseconds, and each failure is a `ModelError`
of one line naming the cause and the way out: never a traceback from deep inside
transformers or safetensors.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

from kvchat.errors import ModelError
from kvchat.model.families import check_family, family_of_gguf

# A folder holds its tokenizer in one of these (fast tokenizers, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.tiktoken",
)
AGAIN = "copy or download it again"

# ggml tensor type id -> (elements per block, bytes per block), as gguf-py's
# GGML_QUANT_SIZES has them (a test checks that). Kept here: importing gguf takes 0.35 s,
# and a start from a GGUF's converted copy imports nothing of it otherwise.
GGML_BLOCKS = {
    **{0: (1, 4), 1: (1, 2), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)},
    **{2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40), 20: (32, 18), 39: (32, 17)},
    **{10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292)},
    **{16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 21: (256, 110), 22: (256, 82)},
    **{23: (256, 136), 29: (256, 56), 34: (256, 54), 35: (256, 66), 40: (64, 36), 41: (128, 18)},
}


def check_model(path: Path) -> str:
    """Check a model folder or GGUF file (already known to exist); its `model_type`."""
    return check_gguf(path) if path.is_file() else check_folder(path)


# A config without these would be filled in with transformers' defaults (a 7B-parameter
# Llama for "llama") and built: a crash for want of memory, not an error.
SIZE_KEYS = ("num_hidden_layers", "hidden_size")


def check_folder(folder: Path) -> str:
    family = folder_family(folder)
    check_family(family, folder)
    config = _read_json(folder / "config.json")
    text = config.get("text_config")
    sizes = text if isinstance(text, dict) else config
    for key in SIZE_KEYS:
        if not isinstance(sizes.get(key), int):
            raise ModelError(
                f"{folder / 'config.json'} gives no {key}, so the model's size is unknown; "
                "restore it from the model's source"
            )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise ModelError(
            f"{folder} has no tokenizer (no tokenizer.json, tokenizer.model or vocab.json); "
            "copy the tokenizer files from the model's source into the folder"
        )
    safetensors = sorted(folder.glob("*.safetensors"))
    if not safetensors and not any(folder.glob("pytorch_model*.bin")):
        raise ModelError(
            f"{folder} has no weights (no model.safetensors or pytorch_model.bin); "
            "copy the weight files from the model's source into the folder"
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        missing = sorted(set(_read_json(index).get("weight_map", {}).values()) - {f.name for f in safetensors})
        if missing:
            raise ModelError(f"{folder} lacks the weight file {missing[0]} that its index names; {AGAIN}")
    for file in safetensors:
        check_safetensors(file)
    return family


def folder_family(folder: Path) -> str:
    """The `model_type` that a folder's config.json names."""
    config = _read_json(folder / "config.json")
    family = config.get("model_type")
    if not isinstance(family, str) or not family:
        raise ModelError(
            f"{folder / 'config.json'} names no model_type, so the model family is unknown; "
            'a Hugging Face model config has one (e.g. "model_type": "llama")'
        )
    return family


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_bytes())
    except OSError as err:
        raise ModelError(f"cannot read {file}: {err.strerror or err}") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        where = f" at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise ModelError(f"{file} is not valid JSON{where}; restore it from the model's source") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file} is not a JSON object; restore it from the model's source")
    return data


def check_safetensors(file: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header naming each tensor's
    byte range, then exactly those bytes: a truncated or damaged file fails here."""
    size = file.stat().st_size
    damaged = f"{file} is truncated or damaged"
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{damaged} ({size:,} bytes, no header); {AGAIN}")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ModelError(f"{damaged} ({size:,} bytes, shorter than its header); {AGAIN}")
        try:
            header = json.loads(f.read(length))
            ranges = [entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"]
            end = max((int(stop) for _, stop in ranges), default=0)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ModelError(f"{damaged} (its header cannot be read); {AGAIN}") from None
    if 8 + length + end != size:
        raise ModelError(f"{damaged} ({size:,} bytes of the {8 + length + end:,} its header describes); {AGAIN}")


def check_gguf(file: Path) -> str:
    """Check a GGUF file's header and tensor table against its size, its family, and that
    it describes a whole model; its `model_type`."""
    metadata = gguf_metadata(file)
    architecture = _architecture(file, metadata)
    family = family_of_gguf(architecture)
    check_family(family, file)
    # Without these, transformers would fill in its defaults (a 7B-parameter Llama for a
    # "llama" file) and build that: a crash for want of memory, not an error.
    for key in (f"{architecture}.block_count", f"{architecture}.embedding_length", "tokenizer.ggml.tokens"):
        if key not in metadata:
            raise ModelError(
                f"{file} has no {key} in its metadata, so it is not a whole model (an adapter, or a partial "
                "export?); pass a GGUF model file"
            )
    return family


def model_family(path: Path) -> str:
    """The `model_type` of a model folder or GGUF file, from its config or GGUF header
    alone (for listing: nothing else is checked, the family is not refused)."""
    return family_of_gguf(_architecture(path, gguf_metadata(path))) if path.is_file() else folder_family(path)


def _architecture(file: Path, metadata: dict[str, object]) -> str:
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise ModelError(f"{file} names no general.architecture, so the model family is unknown")
    return architecture


def gguf_metadata(file: Path) -> dict[str, object]:
    """A GGUF file's metadata (arrays as None), after checking that the file holds every
    tensor byte its table names (a truncated download fails here, not mid-conversion)."""
    size = file.stat().st_size
    if size == 0:
        raise ModelError(f"{file} is empty; {AGAIN}")
    with file.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(
                f"{file} is not a GGUF model file (it does not start with 'GGUF'); pass a .gguf model or a HF folder"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                return _read_gguf(file, blob, size)
            except (struct.error, UnicodeDecodeError, OverflowError, ValueError):
                raise ModelError(f"{file} is truncated or damaged (its GGUF header cannot be read); {AGAIN}") from None


def _read_gguf(file: Path, blob: mmap.mmap, size: int) -> dict[str, object]:
    version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ModelError(f"{file} is GGUF version {version}; kvchat reads versions 2 and 3")
    metadata: dict[str, object] = {}
    pos = 24
    for _ in range(metadata_count):
        key, pos = _gguf_string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _gguf_value(blob, pos + 4, kind)
    end = 0
    for _ in range(tensor_count):
        _, pos = _gguf_string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        if dims > 8:
            raise ValueError(f"a tensor of {dims} dimensions")
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        elements = 1
        for dim in shape:
            elements *= dim
        block, block_bytes = GGML_BLOCKS.get(ggml_type, (1, 0))  # (an unknown type: transformers says so)
        end = max(end, offset + elements // block * block_bytes)
    alignment = metadata.get("general.alignment")
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = 32  # llama.cpp's default
    data_start = (pos + alignment - 1) // alignment * alignment
    if data_start + end > size:
        raise ModelError(
            f"{file} is truncated ({size:,} bytes of the {data_start + end:,} its header describes); {AGAIN}"
        )
    return metadata


# GGUF metadata value types: the fixed-size ones (struct format), 8 a string, 9 an array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    if pos + 8 + length > len(blob):
        raise struct.error("string past the end of the file")
    return blob[pos + 8 : pos + 8 + length].decode("utf-8"), pos + 8 + length


def _gguf_value(blob: mmap.mmap, pos: int, kind: int) -> tuple[object, int]:
    if kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == 8:
        return _gguf_string(blob, pos)
    if kind != 9:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _GGUF_SCALARS:  # skipped: no check needs an array's values
        pos += count * struct.calcsize(_GGUF_SCALARS[item])
    elif item == 8:  # strings (a vocabulary): walk their lengths
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + length
    else:
        raise ValueError(f"GGUF array of value type {item}")
    if pos > len(blob):
        raise struct.error("array past the end of the file")
    return None, pos
