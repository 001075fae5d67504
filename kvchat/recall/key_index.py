"""The recall tier's index (kvchat/recall/tier.py): every cold key in 4 bits a channel, per
token, in RAM; what each selection ranks the cold rows by.

Only some channels of each key are kept (`ranking_channels`: the low-frequency half of
the RoPE pairs). Each row and KV head keeps its own minimum `lo` and step
`(max - min) / 15` over those channels and one 4-bit code per channel, so that for a
query q: q·k ≈ lo·Σq + step·(q·code). A row's quantisation depends on that row alone, so
rows are quantised once, as they arrive, whatever comes later.

Three layouts of the same numbers (`key_index` picks the fastest that runs here):

- `KeyIndex`, anywhere: codes two to a byte, [H, m/2, rows] (channels first, so that
  scoring reads each as one contiguous row), `lo` and `step` in float32; scoring unpacks
  the codes and runs one batched matmul. m/2 + 8 bytes a token and KV head.
- `PackedKeyIndex`, on a CPU whose PyTorch has the int4 weight kernel: the codes in that
  kernel's own layout (`_convert_weight_to_int4pack_for_cpu`, per KV head, rows in blocks
  of `PACK_BLOCK`) with `step` and `lo + 8·step` in bfloat16 as its scale and offset, so
  scoring is one fused int4 matmul per KV head: 2.9-3.9x faster than unpacking at 1k-7k
  cold rows (measured on a 2-core x86-64 machine), at m/2 + 4 bytes a token and KV head.
  The bfloat16 scale and offset move a score by about 0.1 against the float32 ones, on
  scores of about ±25: the needle grid is the check that it ranks as well.
- `NativeKeyIndex`, on an x86-64 CPU with AVX512-VNNI or AVX2 where kvchat's kernel was built
  and runs (`kvchat.native.ranking_path`): the codes in blocks of 16 rows for integer
  products, the same bfloat16 `lo` and `step`, and a pass ranks in one call that also
  keeps the top rows (`top`), 4-6x faster than the packed layout's chain of ops (measured
  on a 2-core AMD EPYC, Zen 5).

Why per-token 4-bit keys rather than page bounds or a low-rank projection: they rank the
needle's tokens as exact keys do, at a fraction of the bytes
(docs/decisions/0001-recall-ranks-4-bit-keys.md).

Rows are consecutive tokens (tokens leave the window in order, each once), so row i is
token `first + i` (an index into everything the session fed, not a position: a
compaction moves positions, never tokens); only `first` is kept (`follows`).

This module sees tensors only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat import native
from kvchat.kv_types import tensor_bytes
from kvchat.runtime import int4_available

# Rows of a block in the native layout (`kvchat/native/_coldrank.c`: one vector's 16 lanes).
NATIVE_BLOCK = 16
# Rows the index grows by at least when it runs out of room.
INDEX_SLACK = 1024
# Rows the CPU int4 kernel packs together when their count is a multiple of it: each
# block's layout depends on its own rows only, so a block is packed again as it fills.
PACK_BLOCK = 64


def ranking_channels(inv_freq: Tensor) -> Tensor:
    """The key channels the index keeps: both channels of the half of the RoPE pairs that
    rotate slowest (pair i is channels i and i + d/2, rotating at `inv_freq[i]`). Fast
    pairs mostly say where a token is; the slow ones what it is, which is what a query
    looking back thousands of tokens matches. Measured at the digit step of a 2k needle
    probe, over the layers that retrieve it: the number's tokens ranked as high on the
    slow half as on every channel (and better in some heads), at half the bytes and half
    the scoring work."""
    pairs = inv_freq.numel()
    slow = inv_freq.float().argsort()[: max(1, pairs // 2)]  # smallest frequency first
    return torch.cat([slow, slow + pairs])


def quantise(keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(codes uint8 in 0..15, lo, step) of keys [..., m] in float32, per row."""
    lo = keys.amin(-1)
    step = ((keys.amax(-1) - lo) / 15).clamp_(min=1e-12)
    code = ((keys - lo[..., None]) / step[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return code, lo, step


class KeyIndex:
    """Every cold key in 4 bits a channel, per token: the portable layout (module
    docstring)."""

    def __init__(self, heads: int, head_dim: int, device: torch.device, channels: Tensor | None = None) -> None:
        self.channels = torch.arange(head_dim, device=device) if channels is None else channels.to(device)
        if self.channels.numel() % 2:
            raise ValueError("the 4-bit key index needs an even number of channels")
        self.heads, self.head_dim, self.device = heads, head_dim, device
        self.half = self.channels.numel() // 2
        everything = torch.arange(head_dim, device=device)
        self._all = self.channels.numel() == head_dim and bool((self.channels == everything).all())
        self.rows = 0
        self.first = 0  # token of row 0
        self._allocate(0)

    def _allocate(self, capacity: int) -> None:
        # [H, m/2, capacity]: channels first (a matmul over a transposed operand runs at
        # half the speed).
        self.codes = torch.zeros(self.heads, self.half, capacity, dtype=torch.uint8, device=self.device)
        self.lo = torch.zeros(self.heads, capacity, device=self.device)
        self.step = torch.zeros(self.heads, capacity, device=self.device)

    def _grow(self, capacity: int) -> None:
        codes, lo, step = self.codes, self.lo, self.step
        self._allocate(capacity)
        self.codes[:, :, : self.rows] = codes[:, :, : self.rows]
        self.lo[:, : self.rows], self.step[:, : self.rows] = lo[:, : self.rows], step[:, : self.rows]

    @property
    def capacity(self) -> int:
        return self.lo.shape[1]

    def follows(self, tokens: Tensor) -> bool:
        """Whether `tokens` [b] are the next rows' tokens (consecutive, on from the last
        row)."""
        if tokens.numel() == 0:
            return True
        start = int(tokens[0])
        if self.rows and start != self.first + self.rows:
            return False
        return tokens.numel() == 1 or int(tokens[-1]) - start == tokens.numel() - 1

    def append(self, keys: Tensor, tokens: Tensor) -> None:
        """Keys [H, b, d] and tokens [b] of b new cold tokens (`follows(tokens)`)."""
        b = keys.shape[1]
        if b == 0:
            return
        if not self.rows:
            self.first = int(tokens[0])
        if self.rows + b > self.capacity:
            self._grow(max(self.rows + b, 2 * self.capacity, INDEX_SLACK))
        k = keys.to(self.device, torch.float32)
        if not self._all:
            k = k[..., self.channels]
        self._store(*quantise(k))
        self.rows += b

    def _store(self, code: Tensor, lo: Tensor, step: Tensor) -> None:
        """Rows [rows, rows + b) from their codes [H, b, m], lo and step [H, b]."""
        half, end = self.half, self.rows + code.shape[1]
        self.codes[:, :, self.rows : end] = (code[..., :half] | (code[..., half:] << 4)).transpose(1, 2)
        self.lo[:, self.rows : end], self.step[:, self.rows : end] = lo, step

    def _query(self, query: Tensor) -> Tensor:
        return query if self._all else query.index_select(-1, self.channels)

    def scores(self, query: Tensor) -> Tensor:
        """q·k of every row for queries [H, n, d] (the rows of each KV head), the largest
        over the queries: [H, rows] float32."""
        return self.rank_scores(query).float()

    def rank_scores(self, query: Tensor) -> Tensor:
        """`scores` in the dtype the layout computes them in (what a recall ranks by: a
        conversion to float32 would add no information, only a copy)."""
        q = self._query(query).float()
        packed = self.codes[:, :, : self.rows]
        codes = torch.cat([packed & 15, packed >> 4], 1).float()  # [H, m, rows]
        dot = torch.bmm(q, codes)  # [H, n, rows]
        lo, step = self.lo[:, None, : self.rows], self.step[:, None, : self.rows]
        return torch.addcmul(q.sum(-1, keepdim=True) * lo, dot, step).amax(1)

    def top(self, query: Tensor, k: int, bias: Tensor | None = None) -> Tensor:
        """The k rows of highest score per KV head for queries [H, n, d], [H, k], in no
        order; `bias` [H, capacity] float32 is added to the scores first (-inf: a row
        chosen only where fewer than k others are left)."""
        scores = self.rank_scores(query)  # (a new tensor in every layout: biased in place)
        if bias is not None:
            scores.add_(bias[:, : self.rows])
        return top_rows(scores, k)

    def copy(self) -> KeyIndex:
        twin = type(self)(self.heads, self.head_dim, self.device, self.channels)
        twin.rows, twin.first = self.rows, self.first
        twin._copy_rows(self)
        return twin

    def _copy_rows(self, other: KeyIndex) -> None:
        self.codes = other.codes[:, :, : other.rows].clone()
        self.lo, self.step = other.lo[:, : other.rows].clone(), other.step[:, : other.rows].clone()

    def nbytes(self) -> int:
        """The live rows (spare room is not counted, as for the window)."""
        return tensor_bytes(self.codes[:, :, : self.rows], self.lo[:, : self.rows], self.step[:, : self.rows])

    def bytes_per_row(self) -> int:
        """RAM a row takes per KV head (as `nbytes` counts it)."""
        return self.half + 8


class PackedKeyIndex(KeyIndex):
    """The same index in the CPU int4 kernel's layout (module docstring): per KV head a
    packed weight [capacity, m/2] (capacity a whole number of `PACK_BLOCK`s) and its
    scale and offset [1, capacity, 2] in bfloat16; the codes of the last, partly filled
    block are kept [H, PACK_BLOCK, m] to pack it again as rows come."""

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // PACK_BLOCK) * PACK_BLOCK
        m = 2 * self.half
        self.packed = torch.zeros(self.heads, capacity, self.half, dtype=torch.uint8, device=self.device)
        self.scales = torch.zeros(self.heads, 1, capacity, 2, dtype=torch.bfloat16, device=self.device)
        self._views: tuple[int, Tensor, list[Tensor], list[Tensor]] | None = None
        if not hasattr(self, "_block"):
            self._block = torch.zeros(self.heads, PACK_BLOCK, m, dtype=torch.int32, device=self.device)

    def _grow(self, capacity: int) -> None:
        packed, scales = self.packed, self.scales
        self._allocate(capacity)
        self.packed[:, : packed.shape[1]] = packed
        self.scales[:, :, : scales.shape[2]] = scales

    @property
    def capacity(self) -> int:
        return self.packed.shape[1]

    def _store(self, code: Tensor, lo: Tensor, step: Tensor) -> None:
        end = self.rows + code.shape[1]
        self.scales[:, 0, self.rows : end, 0] = step
        self.scales[:, 0, self.rows : end, 1] = lo + 8 * step  # (code - 8)·scale + offset = lo + code·step
        at, done = self.rows, 0
        m = 2 * self.half
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        while at < end:  # block by block: fill the block's codes, pack it again
            block = at - at % PACK_BLOCK
            whole = (end - at) // PACK_BLOCK * PACK_BLOCK if at == block else 0
            if whole:  # whole blocks at once (every KV head's: blocks are packed alone)
                packed = convert(code[:, done : done + whole].reshape(-1, m).to(torch.int32), 8)
                self.packed[:, at : at + whole] = packed.view(self.heads, whole, self.half)
                at, done = at + whole, done + whole
                continue
            take = min(end, block + PACK_BLOCK) - at
            self._block[:, at - block : at - block + take] = code[:, done : done + take]
            packed = convert(self._block.reshape(-1, m), 8)
            self.packed[:, block : block + PACK_BLOCK] = packed.view(self.heads, PACK_BLOCK, self.half)
            at, done = at + take, done + take
            if at % PACK_BLOCK == 0:
                self._block.zero_()

    def rank_scores(self, query: Tensor) -> Tensor:
        """[H, rows] bfloat16, the kernel's own output (a view of whole blocks' scores)."""
        q = self._query(query).to(torch.bfloat16).contiguous()
        m = 2 * self.half
        packed, scales = self._head_views()
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        # One max over the stacked queries, not one per KV head: 5 µs less a layer.
        out = torch.stack([kernel(q_h, w, m, s) for q_h, w, s in zip(q.unbind(0), packed, scales)])
        return out.amax(1)[:, : self.rows]

    def _head_views(self) -> tuple[list[Tensor], list[Tensor]]:
        """Each KV head's packed rows and scales, in whole blocks (the kernel's layout),
        kept until rows arrive or the buffers change: a decode step scores in every
        recalling layer, and slicing them afresh was a third of its small ops."""
        rows = -(-self.rows // PACK_BLOCK) * PACK_BLOCK
        views = self._views
        if views is None or views[0] != rows or views[1] is not self.packed:
            views = (
                rows,
                self.packed,
                [w[:rows] for w in self.packed.unbind(0)],
                [s[:, :rows] for s in self.scales.unbind(0)],
            )
            self._views = views
        return views[2], views[3]

    def _copy_rows(self, other: KeyIndex) -> None:
        assert isinstance(other, PackedKeyIndex)
        self.packed, self.scales = other.packed.clone(), other.scales.clone()
        self._block = other._block.clone()

    def nbytes(self) -> int:
        return tensor_bytes(self.packed[:, : self.rows], self.scales[:, :, : self.rows])

    def bytes_per_row(self) -> int:
        return self.half + 4


class NativeKeyIndex(KeyIndex):
    """The same index for kvchat's own kernel (`kvchat/native/_coldrank.c`), on a CPU with
    AVX512-VNNI or AVX2: codes in blocks of `NATIVE_BLOCK` rows laid out so that one VNNI
    instruction scores 4 channels of 16 rows, two AVX2 ones 8 rows each ([H, capacity /
    16, 8m] uint8: the C file's header), `lo` and `step` bfloat16 [H, capacity] (as the
    packed layout's). A pass ranks in one call per layer (`top`): the scores, their
    largest over the queries, the row bias and the top-k in one scan, where PyTorch takes
    an int4 matmul, a max, an add, a flip and a topk. The query is quantised to int8 per
    row (scale max|q| / 127) for the integer products; m/2 + 4 bytes a token and KV head,
    as the packed layout. Every call goes through `kvchat.native`'s checked wrappers."""

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // NATIVE_BLOCK) * NATIVE_BLOCK
        m = 2 * self.half
        self.blocks = torch.zeros(self.heads, capacity // NATIVE_BLOCK, 8 * m, dtype=torch.uint8, device=self.device)
        self.lo = torch.zeros(self.heads, capacity, dtype=torch.bfloat16, device=self.device)
        self.step = torch.zeros(self.heads, capacity, dtype=torch.bfloat16, device=self.device)

    def _grow(self, capacity: int) -> None:
        blocks, lo, step = self.blocks, self.lo, self.step
        self._allocate(capacity)
        self.blocks[:, : blocks.shape[1]] = blocks
        self.lo[:, : lo.shape[1]], self.step[:, : step.shape[1]] = lo, step

    @property
    def capacity(self) -> int:
        return self.lo.shape[1]

    def _store(self, code: Tensor, lo: Tensor, step: Tensor) -> None:
        end = self.rows + code.shape[1]
        native.pack_codes(code.contiguous(), self.blocks, self.rows)
        self.lo[:, self.rows : end], self.step[:, self.rows : end] = lo, step

    @staticmethod
    def _kernel_query(query: Tensor) -> Tensor:
        """The query as the kernel reads it: every channel (it picks the ranking ones),
        float32 or bfloat16, contiguous."""
        if query.dtype not in (torch.bfloat16, torch.float32):
            query = query.float()
        return query.contiguous()

    def rank_scores(self, query: Tensor) -> Tensor:
        """[H, rows] float32: the scores `top` ranks by."""
        out = torch.empty(self.heads, self.rows)
        if self.rows:
            q = self._kernel_query(query)
            native.rank_scores(self.blocks, self.lo, self.step, self.rows, q, self.channels, out)
        return out

    def top(self, query: Tensor, k: int, bias: Tensor | None = None) -> Tensor:
        out = torch.empty(self.heads, k, dtype=torch.long)
        if bias is not None:
            bias = bias.float().contiguous()
        q = self._kernel_query(query)
        native.rank_top_rows(self.blocks, self.lo, self.step, self.rows, q, self.channels, out, bias)
        return out

    def _copy_rows(self, other: KeyIndex) -> None:
        assert isinstance(other, NativeKeyIndex)
        self.blocks, self.lo, self.step = other.blocks.clone(), other.lo.clone(), other.step.clone()

    def nbytes(self) -> int:
        rows = self.rows
        return rows * self.half * self.heads + tensor_bytes(self.lo[:, :rows], self.step[:, :rows])

    def bytes_per_row(self) -> int:
        return self.half + 4


class RowCount(KeyIndex):
    """The rows of a tier that does not recall (a layer outside the model's retrieval
    layers, `kvchat.calibration.calibrate.recall_layers`): their count and first token, no keys.
    Its rows stay on disk for a saved session; the index is built from them again if
    the layer is ever chosen (a resumed session reads every row back through `append`)."""

    def _allocate(self, capacity: int) -> None:
        pass

    @property
    def capacity(self) -> int:
        return self.rows

    def append(self, keys: Tensor, tokens: Tensor) -> None:
        if keys.shape[1] and not self.rows:
            self.first = int(tokens[0])
        self.rows += keys.shape[1]

    def rank_scores(self, query: Tensor) -> Tensor:
        raise RuntimeError("a tier that does not recall keeps no key index")

    def _copy_rows(self, other: KeyIndex) -> None:
        pass

    def nbytes(self) -> int:
        return 0

    def bytes_per_row(self) -> int:
        return 0


def native_scoring_available(channels: int) -> bool:
    """Whether kvchat's own ranking kernel runs here for `channels` (a multiple of 8, at
    most 256): the extension was built and the CPU has AVX512-VNNI or AVX2
    (`kvchat.native.ranking_path`)."""
    return channels % 8 == 0 and channels <= 256 and native.ranking_path() is not None


def packed_scoring_available(channels: int) -> bool:
    """Whether this PyTorch build has the CPU int4 kernel (`kvchat.runtime.int4_available`,
    the probe the int4 weights use) for `channels`: one group of that many channels per
    row, a group size the kernel takes (32, 64, 128 or 256)."""
    return channels in (32, 64, 128, 256) and int4_available()


def key_index(
    heads: int,
    head_dim: int,
    device: torch.device,
    channels: Tensor | None = None,
    ranks: bool = True,
) -> KeyIndex:
    """The index in the fastest layout this device has (module docstring); `ranks`
    False: rows counted only (`RowCount`)."""
    if not ranks:
        return RowCount(heads, head_dim, device, channels)
    m = head_dim if channels is None else channels.numel()
    if torch.device(device).type == "cpu" and native_scoring_available(m):
        return NativeKeyIndex(heads, head_dim, device, channels)
    if torch.device(device).type == "cpu" and packed_scoring_available(m):
        return PackedKeyIndex(heads, head_dim, device, channels)
    return KeyIndex(heads, head_dim, device, channels)


def top_rows(scores: Tensor, k: int) -> Tensor:
    """The k rows of highest score per KV head, [H, k], in no order. On a CPU the rows
    are scanned newest first: torch's top-k keeps a heap of the best k seen so far and
    pays for every score that enters it, and cold scores rise towards the newest rows,
    so oldest first lets in the most (real scores of an 8k window decode: 53 µs a layer
    oldest first, 36 newest first, flip included)."""
    if scores.device.type != "cpu":
        return scores.topk(k, dim=-1, sorted=False).indices
    return (scores.shape[-1] - 1) - scores.flip(-1).topk(k, dim=-1, sorted=False).indices
