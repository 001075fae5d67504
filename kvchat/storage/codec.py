"""Snapshot bytes: the layer codec and the incremental (delta) planner.

Everything a snapshot's blobs depend on lives here; the database (`db`) only stores the
bytes and keeps, per session, the `Chain` this module plans against. Like the store, it
sees plain data only: flat per-layer dicts of tensors and scalars, never engine classes.

Layer blobs. One layer dict is one safetensors blob: tensors on CPU with their dtype,
scalars and the key order JSON-encoded in the blob's metadata (with the row dims and, for
a delta, how to rebuild each tensor from the parent's layer).

Incremental snapshots. A snapshot is either full (`parent_id` NULL) or a delta on its
parent. For every tensor of a layer the store remembers, in memory, one 64-bit hash per
row along the tensor's row dimension (the one that grows: a cache's sequence axis). The
next snapshot of that session compares row hashes instead of tensors, so no second copy
of the cache is kept: a tensor whose leading rows equal a contiguous run of the stored
rows (unchanged, appended to, or a sliding window that shifted) is written as that run's
offset + the new rows; one whose rows were dropped, moved or partly replaced (eviction,
merges) as a source row index per row + the rows not found; anything else is written whole. After the store's `MAX_DELTAS` deltas, or when
the chain's delta bytes pass its `COMPACT_SHARE` of their base (kvchat/storage/db.py), the next save is full again and
the chain is dropped once it has committed. A delta is one transaction like a full one,
so a kill while it is written leaves the chain ending at the previous complete state.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import safetensors.torch
import torch
from torch import Tensor

# Key in a layer blob's safetensors metadata holding the scalars and the key order.
_LAYER_META_KEY = "kvchat"
_LAYER_FORMAT = 1


Scalar = int | float | str | bool
LayerValue = Tensor | int | float | str | bool


# ---------------------------------------------------------------------------------
# Layer (de)serialisation: safetensors bytes, scalars JSON-encoded in the metadata.


def encode_layer(layer: Mapping[str, LayerValue], extra: Mapping[str, Any] | None = None) -> bytes:
    """One layer dict -> safetensors bytes (tensors on CPU, dtype kept; scalars typed).

    `extra` goes into the blob's metadata beside the key order (row dims, delta runs)."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Scalar | None] = {}
    storages: set[int] = set()
    for key, value in layer.items():
        if not isinstance(key, str):
            raise TypeError(f"layer keys must be str, got {key!r}")
        if isinstance(value, Tensor):
            t = value.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in storages:
                t = t.clone()  # safetensors refuses tensors that share memory
            elif t.numel():
                storages.add(ptr)
            tensors[key] = t
        elif value is None or isinstance(value, (bool, int, float, str)):
            scalars[key] = value
        else:
            raise TypeError(
                f"layer value {key!r} is {type(value).__name__}; the store takes tensors, int, float, str or bool"
            )
    order = [key for key in layer if not key.startswith(_SRC)]  # source indices are not layer keys
    meta = {"format": _LAYER_FORMAT, "order": order, "scalars": scalars, **(extra or {})}
    return safetensors.torch.save(tensors, metadata={_LAYER_META_KEY: json.dumps(meta)})


def _layer_meta(blob: bytes) -> dict[str, Any]:
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    return json.loads(header.get("__metadata__", {}).get(_LAYER_META_KEY, "{}"))


def layer_dims(blob: bytes) -> dict[str, int]:
    """The row dim of each tensor of a blob, as encoded (what `remember_layer` needs)."""
    return _layer_meta(blob).get("dims", {})


def decode_layer(blob: bytes, parent: Mapping[str, LayerValue] | None = None) -> dict[str, LayerValue]:
    """safetensors bytes written by encode_layer -> the layer dict, in its original key order.

    A delta blob names, per tensor, the run [start, start + count) of the parent's rows
    along its row dim that precedes the rows it stores; `parent` is that decoded layer."""
    meta = _layer_meta(blob)
    tensors = safetensors.torch.load(blob)
    runs = meta.get("runs", {})
    gathers = meta.get("gathers", {})
    if (runs or gathers) and parent is None:
        raise ValueError("a delta layer needs the layer it applies to")
    for key in [*runs, *gathers]:
        if not isinstance(parent.get(key), Tensor):  # type: ignore[union-attr]
            raise ValueError(f"delta key {key!r} has no tensor to apply to")
    for key, (dim, start, count) in runs.items():
        base = cast(Tensor, parent[key])  # type: ignore[index]  # a tensor: checked above
        tensors[key] = torch.cat([base.narrow(dim, start, count), tensors[key]], dim)
    for key, (dim, shape) in gathers.items():
        tensors[key] = _apply_gather(parent[key], dim, shape, tensors.pop(_SRC + key), tensors[key])  # type: ignore[index, arg-type]
    scalars = meta.get("scalars", {})
    values: dict[str, Any] = {**tensors, **scalars}
    order = meta.get("order", list(values))
    return {key: values[key] for key in order}


# ---------------------------------------------------------------------------------
# Row hashes: what the store remembers of a written tensor, instead of the tensor.

_HASH_SEED = 0x6B766368


@functools.lru_cache(maxsize=64)
def _hash_weights(words: int) -> Tensor:
    """Fixed odd 64-bit weights: a row's hash is its words' weighted sum mod 2**64."""
    gen = torch.Generator().manual_seed(_HASH_SEED + words)
    return torch.randint(-(2**62), 2**62, (words,), generator=gen, dtype=torch.int64) * 2 + 1


def row_hashes(t: Tensor, dim: int) -> Tensor:
    """int64 [lead, rows]: one hash per row of `t` along `dim`, per index of the dims before it.

    A linear hash with random odd weights: rows that differ collide with probability about
    2**-64 (more only for rows differing solely in high bits of every word). It costs one
    pass over the tensor and keeps 8 bytes per row instead of the row."""
    t = t.detach().to("cpu").contiguous()
    lead = 1
    for size in t.shape[:dim]:
        lead *= size
    rows = t.shape[dim]
    if t.numel() == 0:
        return torch.zeros(lead, rows, dtype=torch.int64)
    raw = t.reshape(-1).view(torch.uint8).reshape(lead, rows, -1)
    words = raw.view(torch.int64) if raw.shape[-1] % 8 == 0 else raw.to(torch.int64)
    return (words * _hash_weights(words.shape[-1])).sum(-1)


@dataclass
class Stored:
    """What the store keeps of one written tensor: its layout and its row hashes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    hashes: Tensor


@dataclass
class Chain:
    """The newest snapshot of a session as a Store wrote or read it: the next delta's base."""

    snapshot_id: int
    base_id: int
    base_bytes: int
    delta_bytes: int
    deltas: int
    layers: list[dict[str, Stored]]


def _row_dim(t: Tensor, old: Stored | None, hint: int | None) -> int:
    """The dim that grows: the one whose size changed, else the remembered one, else the longest."""
    if old is not None and old.dtype == t.dtype and len(old.shape) == t.ndim:
        changed = [i for i in range(t.ndim) if old.shape[i] != t.shape[i]]
        if len(changed) == 1:
            return changed[0]
        if not changed:
            return old.dim
    if hint is not None and 0 <= hint < t.ndim:
        return hint
    return max(range(t.ndim), key=lambda i: t.shape[i])


def _longest_run(new: Tensor, old: Tensor) -> tuple[int, int]:
    """(start, count): the most leading rows of `new` equal to old[:, start:start+count]
    for every lead index, with the run reaching the end of old or of new (unchanged,
    appended, or a window shifted left)."""
    if new.shape[0] != old.shape[0] or new.shape[1] == 0 or old.shape[1] == 0:
        return 0, 0
    first = new[:, 0:1]
    candidates = torch.nonzero((old == first).all(0)).flatten().tolist()
    best = (0, 0)
    for start in candidates[:8]:
        count = min(old.shape[1] - start, new.shape[1])
        if count > best[1] and torch.equal(new[:, :count], old[:, start : start + count]):
            best = (start, count)
    return best


_SRC = "#src#"  # blob key prefix of a gathered tensor's source-row indices


def _match_rows(new: Tensor, old: Tensor) -> Tensor:
    """int32 [lead, n_new]: for each new row the index of an old row with the same hash
    (same lead index), -1 where there is none."""
    if old.shape[1] == 0:
        return torch.full(new.shape, -1, dtype=torch.int32)
    ordered, order = old.sort(dim=1)
    at = torch.searchsorted(ordered, new.contiguous()).clamp(max=old.shape[1] - 1)
    found = ordered.gather(1, at) == new
    return torch.where(found, order.gather(1, at), -1).to(torch.int32)


def _apply_gather(base: Tensor, dim: int, shape: list[int], src: Tensor, fresh: Tensor) -> Tensor:
    """Rebuild a tensor from the parent's rows named by `src` and the stored fresh rows."""
    lead, rows = src.shape
    old = base.contiguous().reshape(lead, base.shape[dim], -1)
    out = torch.empty(lead, rows, old.shape[-1], dtype=base.dtype)
    found = src >= 0
    heads = torch.arange(lead).unsqueeze(1).expand(lead, rows)
    out[found] = old[heads[found], src[found].long()]
    out[~found] = fresh.to(base.dtype)
    return out.reshape(shape)


def plan_layer(
    layer: Mapping[str, LayerValue], old: dict[str, Stored] | None, hints: Mapping[str, int]
) -> tuple[dict[str, LayerValue], dict[str, Any], dict[str, Stored]]:
    """(what to write, blob metadata, what to remember) for one layer; old=None: whole."""
    write: dict[str, LayerValue] = {}
    dims: dict[str, int] = {}
    runs: dict[str, list[int]] = {}
    gathers: dict[str, list[Any]] = {}
    remember: dict[str, Stored] = {}
    for key, value in layer.items():
        if not isinstance(value, Tensor) or value.ndim == 0:
            write[key] = value
            continue
        previous = old.get(key) if old is not None else None
        dim = _row_dim(value, previous, hints.get(key))
        hashes = row_hashes(value, dim)
        dims[key] = dim
        remember[key] = Stored(tuple(value.shape), value.dtype, dim, hashes)
        comparable = (
            previous is not None
            and previous.dim == dim
            and previous.dtype == value.dtype
            and len(previous.shape) == value.ndim
            and all(previous.shape[i] == value.shape[i] for i in range(value.ndim) if i != dim)
        )
        if not comparable:
            write[key] = value
            continue
        assert previous is not None
        start, count = _longest_run(hashes, previous.hashes)
        src = _match_rows(hashes[:, count:], previous.hashes)
        if count and bool((src < 0).all()):  # unchanged, appended, or a shifted window
            runs[key] = [dim, start, count]
            write[key] = value.narrow(dim, count, value.shape[dim] - count)
            continue
        src = _match_rows(hashes, previous.hashes)
        found = src >= 0
        if bool(found.any()):  # rows dropped, moved or replaced (eviction, merges)
            gathers[key] = [dim, list(value.shape)]
            lead = hashes.shape[0]
            write[key] = value.detach().to("cpu").contiguous().reshape(lead, hashes.shape[1], -1)[~found]
            write[_SRC + key] = src
        else:
            write[key] = value
    extra: dict[str, Any] = {"dims": dims}
    if runs:
        extra["runs"] = runs
    if gathers:
        extra["gathers"] = gathers
    return write, extra, remember


def remember_layer(layer: Mapping[str, LayerValue], dims: Mapping[str, int]) -> dict[str, Stored]:
    """What to remember of a decoded layer: the row hashes of its tensors along `dims`."""
    return {
        key: Stored(tuple(v.shape), v.dtype, dims[key], row_hashes(v, dims[key]))
        for key, v in layer.items()
        if isinstance(v, Tensor) and v.ndim > 0 and key in dims
    }
