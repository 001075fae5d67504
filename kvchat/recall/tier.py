"""The recall tier: every token that leaves the window, kept on disk and recalled by
the query that needs it.

Any selection a compressor makes before the answer is written can lose the one fact the
answer needs; the decode step itself knows which tokens it needs. So, under every method,
each recalling layer also keeps:

- a **cold store** (`kvchat.recall.cold_store`): the key and value of every token,
  appended once as it leaves the window, one row per token with each KV head's key in 8
  bits (turned back to before RoPE) and value in 4 (`kvchat.recall.row_codec`: 102 bytes a
  head for d = 64), in an unlinked memory-mapped file (the disk space goes back with the
  cache, even if the process dies); counted in `cold_bytes()`;
- an **index in RAM** (`kvchat.recall.key_index`): every cold key in 4 bits a channel,
  per token, on the slow half of the RoPE pairs, plus a row bias; counted in `nbytes`
  (the cache's kv_bytes) and held by a byte budget (`kvchat.cache.budget`).

At every decode step, and every prefill chunk once tokens have gone cold, each KV head
scores its cold rows with the pass's queries (the largest over a GQA group's query heads
and `CHUNK_QUERIES` rows of a chunk), reads the best `recall` rows, turns their keys to
where they sit (`_place`) and attends them as single tokens (a = b = 0) beside sinks,
middle and window (`RecallTier.recall`). Every step
chooses its own rows: copying a number moves one token a step, and rows chosen a few
steps back no longer hold the next digit. Tokens that leave the window one at a time wait
in a RAM stage of `STAGE_ROWS` rows, attended exactly, and are written together.

Two things help a detail past the model's trained context be read back
(docs/decisions/0015-recalled-rows-before-the-window.md): in a session that passes the
context, each pass lays its recalled rows out in token order just before the window
(`_place`); and each prefill chunk pins its best block of cold tokens for every
recalling layer, which the answer's steps recall beside their own rows (`RecallPins`).

Only the model's retrieval layers recall (`ranks`); a tier outside them keeps nothing.
Nothing is counted twice: a middle entry that is the exact token blocks its row, and the
middle's merged stand-ins make room for the recalled tokens by `MERGED_RULES` (`scale`,
the default: a head's stand-ins all multiply their weights by (W - R)/W, W the tokens
they stand for, R the rows the head recalls, so token counts are conserved; `add` leaves
them as they are). Rows are numbered by token, not by position, so a compaction
(`reposition`, `kvchat.cache.positions`) or a method switch moves them with the hot
cache; as the stored keys carry no position, a compaction rewrites no row, only the
index. A saved session keeps the rows (`segments`, `kvchat.storage.cold`) and a resume
rebuilds the index from their keys (`finish_load`).

Why 4-bit keys per token: docs/decisions/0001-recall-ranks-4-bit-keys.md; why only the
retrieval layers: docs/decisions/0006-only-retrieval-layers-keep-cold-rows.md; the tier as
a whole: docs/design.md, "The recall tier".

This module sees tensors only: no model, no storage, no settings.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ParamSpec, TypeVar, cast

import torch
from torch import Tensor

from kvchat.kv_types import Entries, StateDict, rerotate, tensor_bytes
from kvchat.recall.cold_store import ColdStore, Segment
from kvchat.recall.key_index import INDEX_SLACK, KeyIndex, key_index, top_rows
from kvchat.runtime import one_thread, threads

# How the middle's merged stand-ins make room for recalled tokens (module docstring).
MERGED_RULES = ("scale", "add")
DEFAULT_MERGED_RULE = "scale"
# Stored rows decoded and turned into a new index per slice (a compaction, a resume):
# bounds the float copies they make.
REINDEX_ROWS = 4096
# Decode passes one selection serves (`RecallTier.every`; 1: every step chooses, see the
# module docstring). An ablation hook, as `mass_stride` is.
RECALL_EVERY = 1
# Tokens staged in RAM before they are written together (`RecallTier.append`).
STAGE_ROWS = 16
# Tokens a pass sends cold that the next pass writes (`append`): a question, not a chunk.
DEFER_ROWS = 64
# Query rows of a prefill chunk (a later turn's message) that rank the cold rows for it,
# evenly spaced, the last included: scoring costs as much per query as per cold row. The
# last row alone lost the needle asked in a later turn in 4 of 9 cases at 2k (`window`):
# the question's own tokens fetch it.
CHUNK_QUERIES = 4
# Blocks of consecutive cold tokens each layer pins for every recalling layer at a prefill
# chunk (`RecallPins`), and their length.
PIN_BLOCKS = 1
PIN_BLOCK = 16
# Recalls whose rows the log (`RecallTier.start_log`) holds before folding them into its
# union: one fold per this many passes keeps the per-step cost to a list append.
LOG_FOLD = 64

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _inference(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run `method` in inference mode. The tier's tensors are made and updated in place
    during forward passes (inference mode) and also outside them (an exact prefill's
    flush evicts after the passes, a copy forks): in-place updates of inference tensors
    are allowed only in inference mode."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return wrapper


class RecallPins:
    """Cold tokens that every recalling layer of a cache attends, beside its own best rows,
    until the next prefill chunk: the blocks a chunk's queries rank highest in any layer
    (`RecallTier._best_blocks`).

    A question names what its answer will copy: in SnapKV's terms, the end of a prompt
    predicts what the generation attends to. Measured on a 16k needle: at the question's
    chunk the needle's block ranked in the top 5 in 5 of 14 retrieval layers, at the
    answer's first step in 1; forced into every retrieval layer it was read back, recalled
    by the steps alone it was not (docs/decisions/0015-recalled-rows-before-the-window.md).
    So the blocks a chunk finds are pinned for every layer, and the answer's steps keep
    them. Blocks, not tokens: a number is several tokens, and its sentence says what it is.

    The cache starts each pass (`start_pass`); within a chunk's pass the layers add their
    blocks in order, replacing what the last chunk pinned."""

    def __init__(self, tokens: Tensor | None = None) -> None:
        self.tokens = torch.zeros(0, dtype=torch.long) if tokens is None else tokens.long().cpu()
        self._replace = False

    def start_pass(self, length: int) -> None:
        """A forward pass of `length` tokens begins: a chunk (more than one) pins anew."""
        self._replace = length > 1

    def add(self, tokens: Tensor) -> None:
        """A layer's best blocks for this chunk."""
        tokens = tokens.long().cpu()
        if not self._replace:
            tokens = torch.cat([self.tokens, tokens])
        self.tokens, self._replace = tokens.unique(), False


@dataclass
class Recalled:
    """What one forward pass recalls in one layer: the segment `(keys, values, weights,
    weights)` (weight 0 for a recalled row, -inf for a blocked one; None when all are 0)
    and the middle's log-weights to attend with beside it (the stand-ins scaled, see
    `MERGED_RULES`)."""

    keys: Tensor  # [H, r, d]
    values: Tensor  # [H, r, d]
    weights: Tensor | None  # [H, r] float32; None: every row is recalled (all 0)
    rows: Tensor  # [H, r] cold row of each entry
    middle_num: Tensor  # [H, m] float32
    middle_den: Tensor  # [H, m] float32


class RecallTier:
    """One layer's cold store + key index, and the recall of each forward pass."""

    # Set by `clear` (which `__init__` calls); declared here for the type checker.
    _staged: int
    _stage_first: int
    _deferred: tuple[Tensor, Tensor, Tensor] | None
    _held: Recalled | None
    _pin_state: tuple[tuple, tuple[Tensor, Tensor | None, Tensor, Tensor]] | None

    def __init__(
        self,
        *,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        recall: int,
        folder: str | Path | None = None,
        rule: str | None = None,
        channels: Tensor | None = None,
        every: int = RECALL_EVERY,
        ranks: bool = True,
        inv_freq: Tensor | None = None,
        pins: RecallPins | None = None,
    ) -> None:
        """`recall`: cold tokens recalled per KV head per forward pass; `folder`: where the
        cold file goes (None: the system's temp folder); `rule`: how merged stand-ins make
        room (`MERGED_RULES`); `channels`: the key channels the index ranks by (None: all;
        `ranking_channels`); `every`: decode passes one selection serves (`RECALL_EVERY`);
        `ranks` False: its layer is not one of the model's retrieval layers: the tier keeps
        nothing and its layer attends as without recall; `inv_freq`: the layer's RoPE
        frequencies (`kvchat.kv_types.LayerGeometry`), by which recalled keys are moved
        into the pass's layout (`recall`; None: a layer without RoPE, whose keys never turn);
        `pins`: the cache's tokens pinned for every recalling layer (`RecallPins`; None:
        this tier recalls its own best rows only)."""
        rule = DEFAULT_MERGED_RULE if rule is None else rule
        if recall < 1:
            raise ValueError("recall must be at least 1")
        if rule not in MERGED_RULES:
            raise ValueError(f"merged rule {rule!r}: choose one of {', '.join(MERGED_RULES)}")
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.per_step, self.folder, self.rule = int(recall), folder, rule
        self.channels, self.every, self.ranks = channels, every, bool(ranks)
        self.inv_freq, self.pins = inv_freq, pins
        # Whether recalled rows are laid out before the window (`_place`): the cache's
        # to set, for a session that passes the trained context.
        self.lay_out = False
        # Rows attended per KV head, summed over every recall (what the metrics count);
        # never reset, so a count over an answer is a difference (`start_log`).
        self.total = self._log_from = 0.0
        self._logging = False
        # Rows are numbered by token (`KeyIndex`). A row appended now at position p is
        # token p + `shift` (the cache's origin shift: 0 until a compaction), and
        # `token_of` reads the middle's positions [H, m] as tokens (None: they are the
        # tokens, no compaction yet). Both are the cache's to set (`kvchat.cache.positions`).
        self.shift = 0
        self.token_of: Callable[[Tensor], Tensor] | None = None
        # A saved state's tier, waiting for its rows (`load_state`, `finish_load`).
        self._expect: tuple[int, int, Tensor | None] | None = None
        self.clear()

    @property
    def rows(self) -> int:
        """Cold rows (staged ones are written first: everything that reads rows sees them)."""
        self._flush()
        return self.index.rows

    @property
    def per_step(self) -> int:
        """Cold rows recalled per KV head and pass."""
        return self._per_step

    @per_step.setter
    def per_step(self, rows: int) -> None:
        self._per_step = int(rows)
        self._held = None  # a held selection has the old count of rows

    @property
    def every(self) -> int:
        return self._every

    @every.setter
    def every(self, passes: int) -> None:
        if int(passes) < 1:
            raise ValueError("a recalled selection serves at least one pass")
        self._every = int(passes)
        self._held = None

    # -- writes ---------------------------------------------------------------------------
    @_inference
    def append(self, keys: Tensor, values: Tensor, positions: Tensor, stage: bool = False) -> None:
        """Tokens leaving the window, oldest first: keys/values [H, b, d], positions [b].
        Tokens that do not follow on from the last row (none do: tokens leave the window
        in order, each once) start the tier again.

        `stage` (the layer's compressor keeps no middle, so no middle entry can stand for
        these tokens): a method that evicts one token a step (`window`) would pay a file
        write and a quantisation per token and layer; up to `STAGE_ROWS` tokens wait in
        RAM instead, attended exactly at every pass (`recall`), and are written together
        when the buffer is full, or whenever anything reads the rows (`rows`).

        Other appends of up to `DEFER_ROWS` tokens are written by the next pass, before it
        ranks, or by whatever reads the rows first: the tokens a later turn's question
        pushes out of the window are then written after its first token is out, not
        before it.
        Until then they are views of the window's storage, which only ever writes after
        its live tokens, so they stay as they were (`kvchat.cache.window_buffer`)."""
        if not self.ranks:  # it never recalls, so it keeps nothing (the module docstring)
            return
        b = keys.shape[1]
        if stage and b > 0 and self._staged + b <= STAGE_ROWS:
            # (the token of the first is all a staged row needs: one read, no other op)
            first = int(positions[0]) + self.shift
            if not self._staged or first == self._stage_first + self._staged:
                self._stage(keys, values, first)
                if self._staged == STAGE_ROWS:
                    self._flush()
                return
        self._flush()
        if 0 < b <= DEFER_ROWS:
            self._deferred = (keys, values, positions.cpu() + self.shift)
            return
        self._write(keys, values, positions.cpu() + self.shift)

    def _write(self, keys: Tensor, values: Tensor, tokens: Tensor) -> None:
        """Rows for `tokens`, whose keys are rotated for their positions now (token less
        the shift). The store keeps them turned back to before RoPE; the index ranks them
        as the store keeps them, turned to their positions again, so that an index rebuilt
        from the stored rows (a compaction, a resume) is the same numbers."""
        if not self.index.follows(tokens):
            self.clear()
        at = (tokens - self.shift)[None].to(torch.float64)
        rows = self.store.append(self._turned(keys, -at), values)
        self._index_rows(self.index, rows, at, tokens)

    def _index_rows(self, index: KeyIndex, rows: Tensor, positions: Tensor, tokens: Tensor) -> None:
        """Add stored `rows` uint8 [n, H, unit] (`tokens` [n]) to `index`, their keys decoded
        and turned to `positions` [H or 1, n] (float64). The one way every index row is
        made, on the CPU, as the rows are written and as they are read back (a compaction,
        a resume), so that both give the same numbers on any device."""
        keys, _ = self.store.decoded(rows)
        index.append(self._turned(keys, positions).to(self.device), tokens)

    def _turned(self, keys: Tensor, to: Tensor) -> Tensor:
        """`keys` [H, n, d] turned by `to` [H or 1, n] positions (float64; no turn in a layer
        without RoPE)."""
        if self.inv_freq is None:
            return keys
        return rerotate(keys, to.to(keys.device).expand(keys.shape[0], -1), self.inv_freq)

    def _stage(self, keys: Tensor, values: Tensor, first: int) -> None:
        b = keys.shape[1]
        if not self._staged:
            self._stage_first = first
        self._stage_keys.narrow(1, self._staged, b).copy_(keys)
        self._stage_values.narrow(1, self._staged, b).copy_(values)
        self._staged += b

    def _flush(self) -> None:
        """Write the deferred rows, then the staged ones (`append`; in that order they came)."""
        if self._deferred is not None:
            keys, values, tokens = self._deferred
            self._deferred = None
            with torch.inference_mode():
                self._write(keys, values, tokens)
        if not self._staged:
            return
        n, self._staged = self._staged, 0
        with torch.inference_mode():
            self._write(
                self._stage_keys[:, :n],
                self._stage_values[:, :n],
                torch.arange(self._stage_first, self._stage_first + n),
            )

    @_inference
    def clear(self) -> None:
        """Forget every cold token (a compaction moved the positions they were rotated for;
        a loaded state brings none). The old file goes once no fork reads it."""
        self.store = ColdStore(self.folder, self.heads, self.head_dim, self.dtype)
        self.index = key_index(self.heads, self.head_dim, self.device, self.channels, self.ranks)
        # Rows staged in RAM (`append`): `_staged` rows from token `_stage_first`, in
        # buffers of STAGE_ROWS rows (a fixed cost of the tier: `fixed_bytes`).
        self._stage_keys, self._stage_values = torch.zeros(
            2, self.heads, STAGE_ROWS if self.ranks else 0, self.head_dim, dtype=self.dtype, device=self.device
        )
        self._staged = self._stage_first = 0
        self._deferred = None  # (keys, values, tokens)
        # The last single-token pass's selection and how many passes it has served
        # (`recall`); the rows of it the log notes.
        self._held = None
        self._held_passes = 0
        self._held_logged: Tensor | None = None
        # After a compaction: the position [H, n] each of the first n rows' keys are now
        # rotated for (fractional, `reposition`); later rows sit at their token - shift.
        self.cold_pos: Tensor | None = None
        self.last: tuple[int, Tensor | None] | None = None  # the last recall's (rows, weights)
        # The log's rows (`start_log`): recalls not yet folded, and their union so far.
        # The rows they name are gone with the tier, so the log starts again too.
        self._pending: list[Tensor] = []
        self._hits: Tensor | None = None  # [capacity] bool: row recalled by some head
        # Derived from (middle, rows), kept until either changes (`_refresh`): per cold row
        # 0 (a candidate) or -inf (the middle holds it exactly), added to the scores.
        self._middle: Entries | None = None
        self._rows_seen = 0
        self._row_bias = torch.zeros(self.heads, 0, device=self.device)
        self._middle_num = self._middle_den = torch.zeros(self.heads, 0, device=self.device)
        self._candidates = torch.zeros(self.heads, dtype=torch.long, device=self.device)
        self._has_candidates = False
        self._any_blocked = False
        # What `_pinned` derived, and from what.
        self._pin_state = None

    @_inference
    def fork(self) -> RecallTier:
        """An independent tier for a copy of the cache (shares the written rows on disk)."""
        self._flush()
        twin = RecallTier(
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            recall=self.per_step,
            folder=self.folder,
            rule=self.rule,
            channels=self.channels,
            every=self.every,
            ranks=self.ranks,
            inv_freq=self.inv_freq,
        )
        twin.store, twin.index = self.store.fork(), self.index.copy()
        twin.shift = self.shift  # `token_of` reads the copy's own layer: the cache sets it
        twin.cold_pos = None if self.cold_pos is None else self.cold_pos.clone()
        return twin

    # -- saved sessions ----------------------------------------------------------------------
    def segments(self) -> list[Segment]:
        """Every row, as views into the files that hold them (what a saved session copies;
        `ColdStore.segments`)."""
        self._flush()
        return self.store.segments()

    def release_pages(self) -> None:
        """Unmap the cold file pages that reads mapped (`ColdFile.release`)."""
        self.store.release()

    def state_dict(self) -> StateDict:
        """What a snapshot keeps of the tier beside its rows (which are saved apart, as
        `segments`): the token of row 0, the row count and, after a compaction, where the
        rotated rows now sit."""
        self._flush()
        state: StateDict = {"recall.first": self.index.first, "recall.rows": self.rows}
        if self.cold_pos is not None:
            state["recall.pos"] = self.cold_pos.cpu().clone()
        return state

    @_inference
    def load_state(self, state: StateDict) -> None:
        """Start empty, waiting for the rows of `state` (`load_rows`, then `finish_load`).
        A state without a tier (recall off, or a snapshot that holds no tier) leaves it
        empty."""
        self.clear()
        self._expect = None
        if "recall.rows" in state:
            pos = state.get("recall.pos")
            self._expect = (
                int(state["recall.first"]),
                int(state["recall.rows"]),
                pos if isinstance(pos, Tensor) else None,
            )

    @_inference
    def load_rows(self, rows: Tensor) -> None:
        """The next saved rows, in order: uint8 [n, H, unit] as `segments` gives them, or
        the exact rows [n, 2, H, d] a tier kept before its rows were quantised (keys rotated
        for where their tokens sat when saved; they are turned back and quantised here)."""
        if rows.ndim == 4 and rows.is_floating_point() and self._expect is not None:
            if tuple(rows.shape[1:]) != (2, self.heads, self.head_dim):
                raise ValueError(
                    f"cold rows {tuple(rows.shape)} do not fit this tier's [n, 2, {self.heads}, {self.head_dim}]"
                )
            first, _, pos = self._expect
            at = torch.arange(self.store.rows, self.store.rows + rows.shape[0]).expand(self.heads, -1)
            keys = rows[:, 0].transpose(0, 1).to(self.dtype)
            self.store.append(self._turned(keys, -self._row_positions(at, first, pos)), rows[:, 1].transpose(0, 1))
            return
        self.store.append_rows(rows)

    @_inference
    def finish_load(self) -> bool:
        """After the saved rows: rebuild the index from their keys (as the rows are now
        rotated). False, the tier left empty, when the rows are not the ones the state
        names (missing or too many)."""
        expect, self._expect = self._expect, None
        if expect is None or expect[1] == 0:
            fits = self.store.rows == 0
            self.clear()
            return fits
        first, rows, pos = expect
        if self.store.rows != rows or (
            pos is not None and (pos.ndim != 2 or pos.shape[0] != self.heads or pos.shape[1] > rows)
        ):
            self.clear()
            return False
        self.cold_pos = None if pos is None else pos.to(torch.float32).clone()
        self.index = self._indexed(self._row_positions(torch.arange(rows).expand(self.heads, -1), first), first)
        return True

    # -- positions after a compaction --------------------------------------------------------
    def positions(self) -> Tensor:
        """The position [H, rows] (float) where each row's token sits now."""
        self._flush()
        every = torch.arange(self.rows).expand(self.heads, -1)
        return self._row_positions(every).to(torch.float32)

    def tokens(self) -> Tensor:
        """The token [rows] of each row."""
        self._flush()
        return torch.arange(self.index.first, self.index.first + self.rows)

    @_inference
    def reposition(self, new_pos: Tensor, shift: int) -> None:
        """A compaction re-packed the hot cache's positions: the cold tokens now sit at
        `new_pos` [H, rows] (fractional positions are fine), and rows appended from now on
        are numbered with the new `shift`. The stored rows carry no position, so none is
        rewritten (forks keep reading the same files); the index is quantised again from
        the keys turned to their new positions, in slices of `REINDEX_ROWS`."""
        self._flush()
        self._held = None  # chosen beside the old middle and index: the next pass chooses again
        self.index = self._indexed(new_pos.to(torch.float64), self.index.first)
        self.cold_pos = new_pos.to(torch.float32).clone() if self.rows else None
        self.shift = int(shift)
        self._middle = None  # the bias and scaled middle are derived again at the next pass

    def _indexed(self, positions: Tensor, first: int) -> KeyIndex:
        """A new index of every stored row (row 0 is token `first`), its key turned to
        `positions` [H, rows] (float64): a compaction's and a resume's."""
        index = key_index(self.heads, self.head_dim, self.device, self.channels, self.ranks)
        for _ident, start, part in self.store.segments():
            for at in range(0, part.shape[0], REINDEX_ROWS):
                rows = part[at : at + REINDEX_ROWS]
                a, b = start + at, start + at + rows.shape[0]
                self._index_rows(index, rows, positions[:, a:b], torch.arange(first + a, first + b))
        return index

    # -- reads ----------------------------------------------------------------------------
    @_inference
    def read(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values [H, r, d] of cold `rows` [H, r] as a pass attends them where
        their tokens sit now: the stored keys turned to their positions (`_place`)."""
        self._flush()
        keys, values = self.store.read(rows)
        return self._place(keys.to(self.device), rows, None), values.to(self.device)

    @_inference
    def blocked(self, middle: Entries) -> Tensor:
        """Cold rows [H, rows] that are not recalled beside `middle`: those it holds as
        exact single tokens (a = b = 0 at their position)."""
        self._flush()
        self._refresh(middle)
        return torch.isinf(self._row_bias[:, : self.rows])

    @_inference
    def select(self, query: Tensor, r: int | None = None, exclude: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The cold rows to recall for `query` [Hq, L, d] (a GQA group's query heads
        adjacent): per KV head the `r` rows of highest score by the index (the largest over
        the group's queries and the L rows), [H, min(r, rows)], and which of them may be
        attended, [H, min(r, rows)] bool. `exclude` [H, rows] bool: rows not to recall
        (None: none); an excluded row is chosen only when too few others are left."""
        self._flush()
        bias = None if exclude is None else torch.zeros(exclude.shape, device=self.device)
        if bias is not None:
            bias.masked_fill_(cast(Tensor, exclude), -math.inf)  # bias is set only with exclude
        rows = self.index.top(self._ranking_query(query), min(self.per_step if r is None else r, self.rows), bias)
        valid = torch.ones_like(rows, dtype=torch.bool) if exclude is None else ~exclude.gather(1, rows)
        return rows, valid

    @_inference
    def recall(self, query: Tensor, middle: Entries, before: int | None = None) -> Recalled | None:
        """The recalled segment for this forward pass's `query` [Hq, L, d]: the chosen
        cold rows (`_choose`), then the staged ones (`append`); None when there are
        neither (nothing cold, or the middle holds every cold token exactly, as `full`
        does). A middle that changed (it might now hold a staged token) writes the staged
        rows first: they are ranked with the rest. A prefill chunk attends them exactly,
        as a step does (in the app none are left by then: the end of an answer writes
        them, `end_log`).

        `before`: the position of the window's first token. In a session that passes the
        trained context (`lay_out`), the chosen rows are then laid out for this pass
        (`_place`): in token order, on consecutive positions that end where the staged
        rows (which keep their own, the positions just before the window) begin. None:
        each row is attended where its token sits now.

        Runs on one thread (its ops are small: a topk over a few thousand scores took 35 µs
        on two threads, 12 µs on one), but for a chunk's scoring in PyTorch (`_choose`)."""
        with one_thread() as engine_threads:
            return self._recall(query, middle, engine_threads, before)

    def _recall(self, query: Tensor, middle: Entries, engine_threads: int, before: int | None) -> Recalled | None:
        if self._deferred is not None or middle is not self._middle:
            self._flush()
        chosen = self._choose(query, middle, engine_threads)
        staged = self._staged
        if chosen is None and not staged:
            return None
        if chosen is None:
            # Rows are staged only beside a compressor without a middle (`append`, and a
            # changed middle wrote them above): its own, empty, weights stand.
            return Recalled(
                self._stage_keys[:, :staged],
                self._stage_values[:, :staged],
                None,
                torch.zeros(self.heads, 0, dtype=torch.long, device=self.device),
                middle.log_num,
                middle.log_den,
            )
        keys = self._place(chosen.keys, chosen.rows, None if before is None else before - staged)
        if not staged:
            return chosen if keys is chosen.keys else replace(chosen, keys=keys)
        weights = chosen.weights
        if weights is not None:
            weights = torch.cat([weights, weights.new_zeros(self.heads, staged)], 1)
        return Recalled(
            torch.cat([keys, self._stage_keys[:, :staged]], 1),
            torch.cat([chosen.values, self._stage_values[:, :staged]], 1),
            weights,
            chosen.rows,
            chosen.middle_num,
            chosen.middle_den,
        )

    def _place(self, keys: Tensor, rows: Tensor, end: int | None) -> Tensor:
        """`keys` [H, r, d] of cold `rows` [H, r], as the store keeps them (before RoPE),
        turned to where this pass attends them: in a session that passes the model's trained
        context (`lay_out`) and given the window's start `end`, to consecutive positions
        that end there, in token order (a row's number is its token's); otherwise to where
        each row's token sits now (`_row_positions`).

        Where a recalled row sits decides whether the model reads it. A compaction moves
        cold keys to positions between the packed entries around their tokens, fractional
        and up to the model's trained context away from the query: a detail recalled there
        was not read back. Laid out just before the window, the recalled tokens and the
        window read as one short passage, at distances the model handles best, as in
        InfLLM and ReAttention. It must hold from the session's first pass: laid out only
        from the first compaction on, a 16k needle was lost again. Inside the trained
        context every row sits where its token is, as the whole cache would hold it:
        laying them out there made next-token predictions worse
        (docs/decisions/0015-recalled-rows-before-the-window.md)."""
        if self.inv_freq is None or not rows.numel():
            return keys
        if self.lay_out and end is not None:
            target = (end - rows.shape[1] + rows.argsort(1).argsort(1)).to(torch.float64)
        else:
            target = self._row_positions(rows)
        return self._turned(keys, target)

    def _row_positions(self, rows: Tensor, first: int | None = None, moved: Tensor | None = None) -> Tensor:
        """The position [H, r] (float64) where each of `rows` [H, r] sits now: after a
        compaction, where it moved the first rows to (`cold_pos`, or `moved`); otherwise,
        and for rows written since, its token less the cache's shift (row 0 is token
        `first`; None: the index's)."""
        first = self.index.first if first is None else first
        moved = self.cold_pos if moved is None else moved
        at = (rows.to(torch.float64) + (first - self.shift)).cpu()
        if moved is None:
            return at
        count = moved.shape[1]
        inside = rows.cpu() < count
        kept = moved.gather(1, rows.cpu().clamp(max=count - 1)).to(torch.float64)
        return torch.where(inside, kept, at)

    def _choose(self, query: Tensor, middle: Entries, engine_threads: int) -> Recalled | None:
        """The `recall` cold rows of highest score for `query`, read from the file, or
        None when no row may be recalled. A single-token pass reuses the last one's
        choice for up to `every` passes while the middle stays the same (`RECALL_EVERY`:
        1 by default, every step choosing)."""
        held = self._held
        if held is not None and query.shape[1] == 1 and self._held_passes < self.every and self._middle is middle:
            self._held_passes += 1
            self.total += self.recalled()
            if self._logging and self._held_logged is not None:
                self._log(self._held_logged)
            return held
        self._held = None
        if not self.index.rows:
            return None
        self._refresh(middle)
        if not self._has_candidates:
            return None
        rows_now = self.index.rows
        # A chunk's scoring (`CHUNK_QUERIES` rows of each query head against every cold
        # row) is the one op of a recall big enough to gain from the engine's threads in
        # PyTorch's int4 kernel: 319 -> 194 µs at 7k cold rows, 1 -> 2 threads (kvchat's
        # own kernel runs on one).
        ranking = self._ranking_query(query)
        scores = None
        with threads(engine_threads if query.shape[1] > 1 else 1):
            if query.shape[1] > 1 and self.pins is not None:
                scores = self.index.rank_scores(ranking)  # one scan for the pins and the rows
                self.pins.add(self._best_blocks(scores))
            pinned, bias, middle_num, middle_den = self._pinned(rows_now)
            k = min(self.per_step, rows_now - pinned.numel())
            if k <= 0:
                own = torch.zeros(self.heads, 0, dtype=torch.long, device=self.device)
            elif scores is not None:
                own = top_rows(scores if bias is None else scores + bias[:, :rows_now], k)
            else:
                own = self.index.top(ranking, k, bias)
        rows = torch.cat([pinned.expand(self.heads, -1), own], 1) if pinned.numel() else own
        # A blocked row (score -inf) is chosen only where a head has fewer candidates than
        # rows to recall; otherwise every recalled row counts and no mask is needed.
        weights = None
        if bias is not None:
            weights = bias.gather(1, own)
            if pinned.numel():
                weights = torch.cat([self._row_bias[:, pinned], weights], 1)
            if bool(torch.isfinite(weights).all()):
                weights = None
        keys, values = self.store.read(rows)
        if keys.device != self.device:
            keys, values = keys.to(self.device), values.to(self.device)
        self.last = (rows.shape[1], weights)
        self.total += self.recalled()
        logged = rows if weights is None else torch.where(torch.isfinite(weights), rows, -1)
        if self._logging:
            self._log(logged)
        chosen = Recalled(keys, values, weights, rows, middle_num, middle_den)
        if query.shape[1] == 1 and self.every > 1:
            self._held, self._held_passes, self._held_logged = chosen, 1, logged
        return chosen

    def _best_blocks(self, scores: Tensor) -> Tensor:
        """The tokens [n] of the `PIN_BLOCKS` blocks of `PIN_BLOCK` consecutive cold rows
        that a prefill chunk's queries score highest (`scores` [H, rows], as the index
        ranks by), over this layer's KV heads, and of the block after each: each head's
        scores are standardised (heads score on different scales), a row takes its best
        head's, a block its best row's."""
        scores = scores.float()
        spread = scores.std(1, keepdim=True).clamp(min=1e-6)
        best = ((scores - scores.mean(1, keepdim=True)) / spread).amax(0)
        rows = best.numel()
        padded = torch.full((-(-rows // PIN_BLOCK) * PIN_BLOCK,), -math.inf, device=best.device)
        padded[:rows] = best
        blocks = padded.view(-1, PIN_BLOCK).amax(1)
        top = blocks.topk(min(PIN_BLOCKS, blocks.numel())).indices
        # Each with the block after it: what a passage says comes after what names it (a
        # needle's block boundary fell between "number is" and its digits).
        tokens = (top[:, None] * PIN_BLOCK + torch.arange(2 * PIN_BLOCK, device=top.device)).flatten()
        return tokens[tokens < rows].cpu() + self.index.first

    def _pinned(self, rows: int) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """For a pass over `rows` cold rows (after `_refresh`): the rows [p] (ascending) of
        the tokens pinned for every recalling layer (`RecallPins`) that this tier holds,
        the bias the ranking adds (the pinned rows come once each, so the ranking picks
        the others; None: nothing pinned or blocked) and the middle's log-weights beside
        them (the stand-ins make room for the pinned rows too). Derived again only when
        the pins, the middle, the rows or the rows per step change: a decode step reuses
        what the chunk before it derived."""
        tokens = None if self.pins is None else self.pins.tokens
        key = (tokens, self._middle, self._row_bias, rows, self.per_step)
        held = self._pin_state
        if held is not None and all(a is b or (isinstance(a, int) and a == b) for a, b in zip(held[0], key)):
            return held[1]
        if tokens is None or not tokens.numel():
            pinned = torch.zeros(0, dtype=torch.long, device=self.device)
        else:
            at = tokens - self.index.first
            pinned = at[(at >= 0) & (at < rows)].to(self.device)
        bias = self._row_bias if self._any_blocked else None
        middle_num, middle_den = self._middle_num, self._middle_den
        if pinned.numel():
            bias = self._row_bias.clone()  # (all 0 where nothing is blocked)
            bias[:, pinned] = -math.inf
            middle_num, middle_den = self._scaled_middle(cast(Entries, self._middle), self._candidates, pinned.numel())
        derived = (pinned, bias, middle_num, middle_den)
        self._pin_state = (key, derived)
        return derived

    def _ranking_query(self, query: Tensor) -> Tensor:
        """The rows of `query` [Hq, L, d] that rank the cold rows (at most `CHUNK_QUERIES`
        of its L), per KV head: [H, G·L', d]."""
        if query.shape[1] > CHUNK_QUERIES:
            query = query[:, chunk_queries(query.shape[1], query.device)]
        hq, length, d = query.shape
        return query.reshape(self.heads, hq // self.heads * length, d)

    def _refresh(self, middle: Entries) -> None:
        """Bring the row bias and the scaled middle up to date: in full when the middle
        changed (an eviction, a refit, a switch or a load: the layer hands over a new
        `Entries` object each time), for the new rows only when just rows came (a method
        without a middle evicts one token a step)."""
        if self._middle is middle and self._rows_seen == self.index.rows:
            return
        h, dev, rows = self.heads, self.device, self.index.rows
        if self._middle is middle and self._row_bias.shape[1] >= rows:
            # Only rows came: they are candidates (the middle did not change to hold them).
            self._row_bias[:, self._rows_seen : rows] = 0.0
            self._candidates += rows - self._rows_seen
            self._has_candidates = True
            self._rows_seen = rows
            return
        bias = torch.zeros(h, self.index.capacity, device=dev)
        if middle.length and rows:
            exact = (middle.log_num == 0) & (middle.log_den == 0)
            tokens = middle.positions if self.token_of is None else self.token_of(middle.positions)
            at = tokens.to(dev) - self.index.first
            held = exact.to(dev) & (at >= 0) & (at < rows)
            marks = torch.zeros(h, bias.shape[1], dtype=torch.int32, device=dev)
            marks.scatter_add_(1, torch.where(held, at, torch.zeros_like(at)), held.to(torch.int32))
            bias.masked_fill_(marks > 0, -math.inf)
        self._row_bias = bias
        self._candidates = (bias[:, :rows] == 0).sum(1)  # [H]
        self._has_candidates = bool(self._candidates.any())
        self._any_blocked = bool((self._candidates < rows).any())
        self._middle_num, self._middle_den = self._scaled_middle(middle, self._candidates)
        self._middle, self._rows_seen = middle, rows

    def _scaled_middle(self, middle: Entries, candidates: Tensor, pinned: int = 0) -> tuple[Tensor, Tensor]:
        """The middle's log-weights beside a recalled segment of `per_step` rows and
        `pinned` more (`MERGED_RULES`)."""
        a, b = middle.log_num, middle.log_den
        if self.rule == "add" or not middle.length:
            return a, b
        exact = (a == 0) & (b == 0)
        merged = ~exact & (torch.isfinite(a) | torch.isfinite(b))
        if not bool(merged.any()):
            return a, b
        stands_for = torch.where(merged & torch.isfinite(b), b.exp(), torch.zeros_like(b)).sum(1)  # W [H]
        recalled = candidates.to(stands_for.device, stands_for.dtype).clamp(max=self.per_step + pinned)  # R [H]
        share = ((stands_for - recalled).clamp(min=1.0) / stands_for.clamp(min=1.0)).log()  # log((W - R) / W)
        share = torch.where(stands_for > 0, share, torch.zeros_like(share))[:, None]
        return torch.where(merged, a + share, a), torch.where(merged, b + share, b)

    # -- accounting -----------------------------------------------------------------------
    @_inference
    def start_log(self) -> None:
        """Start a log of what is recalled (an answer's decode steps; `end_log` reads it)."""
        self._logging, self._log_from = True, self.total
        self._pending, self._hits = [], None

    @_inference
    def end_log(self) -> tuple[float, Tensor]:
        """Stop the log: (rows attended per KV head, summed over the passes since
        `start_log`; the tokens [n] of the cold rows some KV head recalled, ascending).
        Rows of a tier cleared meanwhile (a compaction) are not in it. Writes the staged
        rows, so that every tier, recalling or not, ends an answer with its rows written
        (what `nbytes` counts then)."""
        self._logging = False
        self._flush()
        self._fold()
        since = self.total - self._log_from
        if self._hits is None:
            return since, torch.zeros(0, dtype=torch.long)
        rows = self._hits[: self.rows].nonzero().flatten().cpu()
        return since, rows + self.index.first

    def _log(self, rows: Tensor) -> None:
        """Keep a reference only (no work on the step's path); fold now and then."""
        self._pending.append(rows)
        if len(self._pending) >= LOG_FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        flat = torch.cat([rows.flatten() for rows in self._pending])
        self._pending = []
        rows = self.index.rows  # (not `rows`: folding must not write the staged rows)
        flat = flat[(flat >= 0) & (flat < rows)]
        if self._hits is None or self._hits.numel() < rows:
            hits = torch.zeros(max(rows, INDEX_SLACK), dtype=torch.bool, device=flat.device)
            if self._hits is not None:
                hits[: self._hits.numel()] = self._hits
            self._hits = hits
        self._hits[flat] = True

    def recalled(self) -> float:
        """Rows attended per KV head by the last recall (0 before any)."""
        if self.last is None:
            return 0.0
        rows, weights = self.last
        return float(rows) if weights is None else float(torch.isfinite(weights).sum()) / self.heads

    def nbytes(self) -> int:
        """RAM the tier holds for its live rows: the 4-bit key index, the row bias derived
        from it, after a compaction where the rotated rows sit, and the staging buffers
        (`fixed_bytes`). Staged rows count once written (`rows`); deferred ones (`append`)
        at once, as the rows they become: a byte budget plans the pass after them."""
        extra = 0 if self.cold_pos is None else tensor_bytes(self.cold_pos)
        index = self.index.nbytes() + tensor_bytes(self._row_bias[:, : self.index.rows])
        return self.fixed_bytes() + index + extra + self._deferred_rows() * self.bytes_per_row()

    def fixed_bytes(self) -> int:
        """RAM the tier holds whatever its rows: the staging buffers (`append`)."""
        return tensor_bytes(self._stage_keys, self._stage_values)

    def bytes_per_row(self, compacted: bool | None = None) -> int:
        """RAM one more cold token costs this tier (every KV head), as `nbytes` counts it:
        its index row (4-bit codes, minimum and step: `KeyIndex.bytes_per_row`), float32
        row bias and, after a compaction (`compacted`; None: whether one has happened),
        its float32 position. What a byte budget plans the index by (`kvchat.cache.budget`)."""
        compacted = self.cold_pos is not None if compacted is None else compacted
        bias = 4 if self.ranks else 0
        return self.heads * (self.index.bytes_per_row() + bias + (4 if compacted else 0))

    def cold_bytes(self) -> int:
        """Bytes of exact keys and values of the tier's cold rows: those on disk and the
        staged or deferred ones, which go there next (`append`). Writes nothing: the app's
        status bar asks from the UI thread while the model's thread appends (a write from
        there would race the stage)."""
        return self.store.nbytes(self.store.rows + self._staged + self._deferred_rows())

    def _deferred_rows(self) -> int:
        deferred = self._deferred  # (read once: the status bar asks while the model's thread appends)
        return 0 if deferred is None else deferred[0].shape[1]


def chunk_queries(length: int, device: torch.device) -> Tensor:
    """The `CHUNK_QUERIES` rows of an L-row chunk that rank for it: evenly spaced, the
    first and the last included."""
    return torch.linspace(0, length - 1, CHUNK_QUERIES, device=device).round().long()
