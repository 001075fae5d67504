"""The recall tier's rows on disk: the key (before RoPE) and value of every cold token of a
layer, one row each, quantised (`kvchat.recall.row_codec`), in memory-mapped, already
unlinked temporary files (`kvchat.recall.tier` is the tier built on them).

Apart from `kvchat.recall.tier` (the index and the recall of each pass) because this part is
plain storage: append rows, read rows, share rows with a fork, and hand the rows out as
segments (`ColdStore.segments`) for a saved session to copy (`kvchat.storage.cold`), or
take them back in (`ColdStore.append_rows`) on resume.

Every file has an identity (`ColdFile.ident`): rows once written are never rewritten, so
(file, row range) names their content. The store of saved sessions compares these names to
know which rows it already holds, without reading or hashing a row.

Tensors only: no model, no storage, no settings.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvchat import native
from kvchat.recall import row_codec

# Rows a new file is first sized for (it doubles as it fills).
FIRST_FILE_ROWS = 1024

# One stretch of a layer's cold rows: (the identity of the file that holds them, the
# layer's row number of the first of them, the rows uint8 [n, H, unit], a view into the file).
Segment = tuple[str, int, Tensor]


class ColdFile:
    """One memory-mapped, already unlinked temporary file of rows uint8 `[H, unit]` (one
    token: each KV head's quantised key and value, `kvchat.recall.row_codec`). It only
    grows; a row once written is never rewritten, so another cache may read the rows
    written before it forked."""

    def __init__(self, folder: str | Path | None, heads: int, unit: int) -> None:
        fd = self._fd = _nameless_file(folder)  # it lives as long as this descriptor and the mappings
        self._close = weakref.finalize(self, os.close, fd)
        # What names this file's rows (they never change once written): see the module doc.
        self.ident = uuid.uuid4().hex
        self.row = (heads, unit)
        self.row_bytes = math.prod(self.row)
        self.capacity = 0  # rows
        self.view: Tensor | None = None  # uint8 [capacity, H, unit]
        self._mapped: mmap.mmap | None = None  # the mapping `view` reads

    def ensure(self, rows: int) -> Tensor:
        """Room for `rows` rows; returns the row view."""
        if rows > self.capacity:
            size = max(rows, 2 * self.capacity, FIRST_FILE_ROWS)
            os.ftruncate(self._fd, size * self.row_bytes)
            # The old mapping goes with its last view; both map the same file.
            mapped = self._mapped = mmap.mmap(self._fd, size * self.row_bytes)
            self.view = torch.frombuffer(mapped, dtype=torch.uint8).view(size, *self.row)
            self.capacity = size
        assert self.view is not None
        return self.view

    def release(self) -> None:
        """Unmap the pages reads have mapped (they stay in the system's page cache, and the
        next read maps them again). A read maps the page of each row it reads and, by the
        kernel's fault-around, up to 15 pages beside it: rows recalled across a long
        document map nearly the whole file into the process's resident memory (some 0.3 GB
        of rows after a 64k-token document), which it does not need to hold."""
        if self._mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mapped.madvise(mmap.MADV_DONTNEED)

    def write(self, start: int, rows: Tensor, view: Tensor) -> None:
        """Rows uint8 [n, H, unit] at row `start` (inside `ensure`d room). Through the file
        descriptor where the system has `pwrite`: a write through the mapping faults
        each new page in, and in a decode loop some of those faults stalled for 1-2 ms
        (tens of µs through `pwrite`); the mapping then reads what was written (one page
        cache)."""
        if not hasattr(os, "pwrite"):
            view[start : start + rows.shape[0]] = rows
            return
        data = memoryview(rows.contiguous().numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
        done, at = 0, start * self.row_bytes
        while done < len(data):  # a regular file takes it whole, but a write may stop short
            done += os.pwrite(self._fd, data[done:], at + done)


def _nameless_file(folder: str | Path | None) -> int:
    """A new file in `folder` (None: the system's temp folder) that no name leads to: made
    without one (`O_TMPFILE`) where the system and the filesystem can, so that a process
    killed at any moment leaves nothing behind; else made with a name and unlinked at
    once (a kill between the two left an empty `kvchat-cold-*.kv`)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            return os.open(tempfile.gettempdir() if folder is None else folder, flag | os.O_RDWR, 0o600)
        except OSError:
            pass  # a filesystem without it (EOPNOTSUPP), or an older kernel (EISDIR)
    fd, path = tempfile.mkstemp(prefix="kvchat-cold-", suffix=".kv", dir=folder)
    os.unlink(path)
    return fd


@dataclass
class _Part:
    """Rows [first, stop) of a store, held in `file` from its row `first - base` on."""

    file: ColdFile
    first: int
    stop: int
    base: int


class ColdStore:
    """The key (before RoPE) and value of every cold token of one layer, one quantised row
    each (`kvchat.recall.row_codec`), on disk; read back in `dtype`.

    `parts` are read-only rows shared with the cache this one was forked from; `own`
    holds the rows from `own_first` on. The own file is created by the first write: a
    cache that never evicts opens none. Nothing is closed by hand: a file goes when the
    last store reading it is dropped."""

    def __init__(self, folder: str | Path | None, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.folder, self.heads, self.head_dim, self.dtype = folder, heads, head_dim, dtype
        self.unit = row_codec.unit_bytes(head_dim)
        self.parts: list[_Part] = []
        self.own: ColdFile | None = None
        self.own_first = 0
        self.rows = 0
        # Where each head's unit starts, in units of the file: row * H + head (`read`).
        self._heads = torch.arange(heads)[:, None]

    def _own(self) -> ColdFile:
        if self.own is None:
            self.own = ColdFile(self.folder, self.heads, self.unit)
        return self.own

    def append(self, keys: Tensor, values: Tensor) -> Tensor:
        """Rows for b new tokens: keys (before RoPE) and values [H, b, d]. Returns the rows
        as written, uint8 [b, H, unit] (`decoded` reads them as a later read will)."""
        rows = row_codec.encode(keys, values)
        self._append(rows)
        return rows

    def append_rows(self, rows: Tensor) -> None:
        """Whole rows uint8 [n, H, unit] as `segments` gives them (a saved tier read back)."""
        if rows.ndim != 3 or tuple(rows.shape[1:]) != (self.heads, self.unit) or rows.dtype != torch.uint8:
            raise ValueError(
                f"cold rows {tuple(rows.shape)} {rows.dtype} do not fit this tier's "
                f"[n, {self.heads}, {self.unit}] uint8"
            )
        self._append(rows)

    def _append(self, rows: Tensor) -> None:
        n = rows.shape[0]
        if n == 0:
            return
        own = self._own()
        view = own.ensure(self.rows + n - self.own_first)
        own.write(self.rows - self.own_first, rows, view)
        self.rows += n

    def read(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The keys (before RoPE) and values of `rows` [H, r] (cold rows per KV head):
        [H, r, d] each in `dtype`, on the CPU."""
        return row_codec.decode(self.units(rows), self.head_dim, self.dtype)

    def units(self, rows: Tensor) -> Tensor:
        """The quantised units uint8 [H, r, unit] of `rows` [H, r] (`read`, before decoding).

        One gather per file read from. A fork reads its older rows from the files it
        shares and its newer ones from its own: each file is gathered at the rows clamped
        into it, and a later file's rows replace an earlier one's from its first row on
        (the sources are consecutive stretches, oldest first). A decode step reads this
        way in every recalling layer, so it is a few ops whatever the rows: no test of
        which files the rows fall in (each test waits for its answer).

        Where kvchat's recall kernel runs (`kvchat.native.use("coldrank")`), one call
        copies each row's unit out of the file that holds it: the PyTorch path below is a
        few small ops a source, in every recalling layer of every step."""
        h, r = rows.shape
        rows = rows.cpu()
        sources = self._sources()
        if native.use("coldrank") and sources:
            out = torch.empty(h, r, self.unit, dtype=torch.uint8)
            where = [(p.file.view, p.first, p.stop, p.base) for p in sources]
            native.gather_rows(where, rows.to(torch.long).contiguous(), out)
            return out
        got: Tensor | None = None
        for part in sources:
            view = part.file.view
            assert view is not None
            local = rows if part.base == 0 else rows - part.base
            if got is not None or len(self.parts):
                local = local.clamp(0, view.shape[0] - 1)
            at = (local * self.heads + self._heads).flatten()  # (row, head) in units of the file
            units = view.view(-1, self.unit).index_select(0, at).view(h, r, self.unit)
            got = units if got is None else torch.where((rows >= part.first)[:, :, None], units, got)
        assert got is not None, "rows outside the store"
        return got

    def decoded(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (before RoPE) and values [H, n, d] in `dtype` of whole rows uint8
        [n, H, unit] (a `segments` view: a compaction or a resume reads the rows in order)."""
        return row_codec.decode(rows.transpose(0, 1), self.head_dim, self.dtype)

    def _sources(self) -> list[_Part]:
        sources = list(self.parts)
        if self.own is not None:
            sources.append(_Part(self.own, self.own_first, 1 << 62, self.own_first))
        return sources

    def segments(self, start: int = 0, stop: int | None = None) -> list[Segment]:
        """Rows [start, stop) (None: to the last), uint8 [n, H, unit], as views into the files that hold them,
        in order, each named by its file (`Segment`). No row is copied."""
        stop = self.rows if stop is None else min(stop, self.rows)
        out: list[Segment] = []
        for part in self._sources():
            a, b = max(start, part.first), min(stop, part.stop)
            if a < b and part.file.view is not None:
                out.append((part.file.ident, a, part.file.view[a - part.base : b - part.base]))
        return out

    def release(self) -> None:
        """Unmap the pages reads mapped, in every file this store reads (`ColdFile.release`)."""
        for part in self._sources():
            part.file.release()

    def fork(self) -> ColdStore:
        """A store for a copy of the cache: the rows written so far are shared (they never
        change); the twin writes its own from there on."""
        twin = ColdStore(self.folder, self.heads, self.head_dim, self.dtype)
        twin.parts = list(self.parts)
        if self.own is not None and self.rows > self.own_first:
            twin.parts.append(_Part(self.own, self.own_first, self.rows, self.own_first))
        twin.own_first = twin.rows = self.rows
        return twin

    def nbytes(self, rows: int | None = None) -> int:
        """Bytes of the rows this store reads (shared rows included), or of `rows` rows."""
        return (self.rows if rows is None else rows) * self.heads * self.unit
