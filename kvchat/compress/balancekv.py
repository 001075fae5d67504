"""`balancekv`: BalanceKV ("Streaming Attention Approximation via Discrepancy Theory", Han,
Kapralov, Kochetkova, Sheth and Zandieh, arXiv 2502.07861; docs/methods.md).

The middle is compressed by repeated *halvings*: a discrepancy walk signs the tokens so
that the two halves carry (nearly) the same softmax-weighted value sum for every query,
one half is kept and its weight doubled. Two walks:

- mode `code` (default): the authors' walk, as in their code: blocks of block-centred keys,
  gain gamma herding, exact-half selection over the whole list, weights multiply. Each
  entry carries a numerator weight w (a = log w) and a count weight (b = level * log 2
  with `den_weight="count"`, or b = log w with `"same"`).
- mode `paper`: the paper's Algorithm 1, SoftmaxBalance (its Algorithm 2) with
  value-norm buckets for the numerator and a separate instance on (k, 1) for the
  denominator; a token kept by only one of them is a numerator-only (b = -inf) or
  denominator-only (a = -inf) entry.

Two schedules decide which halvings run:

- `stream` (default): MergeAndReduce (the paper's Algorithm 4) over batches of `batch`
  tokens, run lazily: tokens stay exact while the budget allows; over budget, the oldest
  full batch of the lowest level holding one is reduced (its survivors join the next
  level), which is the paper's merge-and-reduce tree executed only as far as the budget
  needs. When no level holds a full batch, a shorter buffer is reduced early (see
  `_stream_fit`).
- `prefill` (the authors' LongBench setting): the whole middle is halved (blocks of
  `block`) until it fits; later tokens are appended exact until the budget is exceeded.
  Then whole *levels* are halved, lowest first, until it fits again: a halving only ever
  walks entries of one count (see `_prefill_fit`), so a one-shot prefill is the authors'
  T whole-middle halvings and later overflows are merge-and-reduce over levels, never a
  mixed list.

An incoming entry that stands for w tokens (log_weights) enters with numerator and count
weight w, so with budget >= everything ingested nothing is halved and the entries are
exact.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvchat.compress import register
from kvchat.compress.base import (
    NEG_INF,
    Compressor,
    LayerSpec,
    Param,
    generator_state,
    incoming_log_weights,
    set_generator_state,
)
from kvchat.kv_types import Entries, Repositioner, StateDict, state_tensor, tensor_bytes

LOG2 = math.log(2.0)
# exp(80) ~ 5.5e34: kernel entries stay finite in fp32 even when multiplied by <v, v>.
MAX_EXPONENT = 80.0
# The reference code adds this to every value inner product (keeps the kernel positive
# definite when values are orthogonal).
KERNEL_JITTER = 1e-8
# SoftmaxBalance's constant c = 30 * log(n / delta) (paper, Algorithm 2).
SOFTMAX_BALANCE_C = 30.0


# ---------------------------------------------------------------------------------------
# Mode `code`: the block walk and the exact-half selection (the authors' code)


def _code_signs(
    keys: Tensor, values: Tensor, log_w: Tensor, block: int, params: dict[str, Any], gen: torch.Generator
) -> Tensor:
    """Signs (+1/-1) of the walk over B lists of n entries, cut into blocks of `block`
    walked in parallel. keys/values [B, n, d], log_w [B, n] -> signs [B, n]."""
    lists, n, d = keys.shape
    blocks = math.ceil(n / block)
    pad = blocks * block - n
    count = lists * blocks
    valid = (torch.arange(blocks * block, device=keys.device) < n).view(1, blocks, block, 1).float()
    k = F.pad(keys.float(), (0, 0, 0, pad)).view(lists, blocks, block, d)
    # Values enter multiplied by their numerator weight: the walk balances w * v.
    v = F.pad(values.float() * log_w.exp()[..., None], (0, 0, 0, pad)).view(count, block, d)
    # Centre each block on its real rows only (the reference zero-pads and lets the
    # padding shift the mean and the kernel; masking keeps the last block's signs clean).
    mean = (k * valid).sum(2, keepdim=True) / valid.sum(2, keepdim=True)
    centred = ((k - mean) * valid).view(count, block, d)
    # K_ij = exp(min(tau <c_i, c_j>/sqrt d - beta, 80)) * (w_i w_j <v_i, v_j> + c0), built
    # scaled by gamma in as few passes over the b x b blocks as possible: beta and gamma
    # move into one factor e^-beta * gamma applied on the (small) value side.
    exponent = torch.bmm(centred * (params["temperature"] / math.sqrt(d)), centred.transpose(1, 2))
    factor = params["gamma"] * math.exp(-params["beta"])
    # c0 is an extra constant value coordinate: the same walk also balances the count.
    value_term = torch.bmm(v * factor, v.transpose(1, 2)).add_((params["c0"] + KERNEL_JITTER) * factor)
    kernel = exponent.clamp_(max=MAX_EXPONENT + params["beta"]).exp_().mul_(value_term)
    if pad:
        row_valid = valid.expand(lists, -1, -1, -1).reshape(count, block, 1)
        kernel.mul_(row_valid).mul_(row_valid.transpose(1, 2))
    # Walk all blocks at once; drift[:, j] = gamma * sum over signed i of sign_i K_ij
    # (K is symmetric, so row i of every block is the update after sign i).
    # sign_i = +1 iff U_i < 1/2 - gamma * y_i, i.e. iff gamma * y_i < 1/2 - U_i.
    slack = (0.5 - torch.rand(count, block, generator=gen)).t().contiguous().to(keys.device)
    # The reference fixes the first sign (+1): the walk starts from its row.
    signs = _walk(kernel, slack, kernel[:, 0, :], first=1)
    return signs.view(lists, -1)[:, :n]


def _walk(kernel: Tensor, slack: Tensor, drift: Tensor, first: int) -> Tensor:
    """The sequential part of both walks, for B lists at once: sign_i = +1 iff drift[:, i]
    < slack[i], then drift += sign_i * kernel[:, i, :]. kernel [B, n, n], slack [n, B],
    drift [B, n] (the walk's state before entry `first`; signs before it are +1).
    Returns signs [B, n] (float, +-1).

    The loop runs in NumPy on the CPU, where a step's two small operations cost less than
    as torch calls (a 256-entry walk of 3 lists with its kernel: 3.0 -> 1.8 ms, one
    thread). It is the same arithmetic (float32; sign * kernel is exact, so each update
    rounds once either way)."""
    k = kernel.detach().to("cpu", torch.float32).numpy()
    limit = slack.detach().to("cpu", torch.float32).numpy()
    state = drift.detach().to("cpu", torch.float32).numpy().copy()
    lists, n = state.shape
    signs = np.ones((n, lists), dtype=np.float32)
    for i in range(first, n):
        sign = np.where(state[:, i] < limit[i], np.float32(1.0), np.float32(-1.0))
        signs[i] = sign
        state += sign[:, None] * k[:, i, :]
    return torch.from_numpy(signs.T.copy()).to(kernel.device)


def _exact_half(signs: Tensor) -> tuple[Tensor, Tensor]:
    """Exact-half selection over whole lists (the last step of the authors' walk).

    signs [B, n] -> (kept [B, n//2] indices in sequence order, doubled [B, n//2] bool:
    the kept entry stands for its prefix group and its numerator weight doubles)."""
    _, n = signs.shape
    half = n // 2
    plus = signs > 0
    reach_plus = (plus.cumsum(-1) == half).int().argmax(-1)
    reach_minus = ((~plus).cumsum(-1) == half).int().argmax(-1)
    cut = torch.maximum(reach_plus, reach_minus)  # [B]: the later sign to reach half
    cut_group = plus.gather(1, cut[:, None])
    index = torch.arange(n, device=signs.device)
    in_prefix = index <= cut[:, None]
    # rank 0: prefix tokens outside the cut's group (kept, x2); 1: the unbalanced tail
    # (kept, x1, as many as needed); 2: the cut's group in the prefix (dropped).
    rank = torch.where(in_prefix & (plus != cut_group), 0, torch.where(in_prefix, 2, 1))
    kept = torch.sort(rank, dim=-1, stable=True).indices[:, :half]
    return kept, rank.gather(1, kept) == 0


# ---------------------------------------------------------------------------------------
# Mode `paper`: SoftmaxBalance (the paper's Algorithm 2)


def _softmax_balance(
    keys: Tensor, weighted_values: Tensor, valid: Tensor, delta: float, gen: torch.Generator
) -> tuple[Tensor, int]:
    """One SoftmaxBalance call per list (B lists padded to L). keys [B, L, d],
    weighted_values [B, L, dv] (count weight times value; a 1-vector for the
    denominator), valid [B, L] bool. Returns (kept [B, L] bool: the smaller sign group,
    ties to +1) and the number of FAIL events (|y| > c R^2; p is clipped, never aborts)."""
    lists, length, d = keys.shape
    mask = valid.float()
    k = keys.float() * mask[..., None]
    v = weighted_values.float() * mask[..., None]
    # Kernel divided by R^2 = e^{r_key^2/sqrt d} r_val^2 (radii = the list's largest norms):
    # every entry is <= 1, so nothing overflows however large the norms are.
    r_key2 = (k * k).sum(-1).amax(-1)
    r_val2 = (v * v).sum(-1).amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = (k @ k.transpose(-1, -2) - r_key2[:, None, None]) / math.sqrt(d)
    kernel = exponent.exp() * (v @ v.transpose(-1, -2)) / r_val2[:, None, None]
    kernel = kernel * mask[:, :, None] * mask[:, None, :]
    count = mask.sum(-1).clamp_min(1.0)
    threshold = SOFTMAX_BALANCE_C * torch.log(count / delta)  # c, in units of R^2
    # sign_j = +1 with probability clip(1/2 - y_j / (2c)), i.e. iff y_j < c (1 - 2 U_j).
    slack = (threshold[:, None] * (1.0 - 2.0 * torch.rand(lists, length, generator=gen).to(keys.device))).t()
    slack = slack.contiguous()
    signs = _walk(kernel, slack, torch.zeros(lists, length, device=keys.device), first=0)
    # y_j = sum_{i<j} sign_i K_ij, recomputed in one product to count the FAIL events.
    walk = torch.tril(kernel, -1) @ signs[..., None]
    failures = int(((walk[..., 0].abs() > threshold[:, None]) & valid).sum())
    plus = (signs > 0) & valid
    minus = (signs < 0) & valid
    keep_plus = plus.sum(-1) <= minus.sum(-1)
    return torch.where(keep_plus[:, None], plus, minus), failures


# ---------------------------------------------------------------------------------------


class _CodeMiddle:
    """Mode `code`: one list per KV head, all heads the same length (exact-half keeps
    the same count in every head), in sequence order. `level` ([n], shared by all heads,
    non-increasing) counts the halvings each entry went through: the MergeAndReduce
    buffers in the stream schedule, the count classes that the prefill schedule halves
    one at a time. An entry of level l stands for 2^l times its incoming count."""

    def __init__(self, spec: LayerSpec, params: dict[str, Any], gen: torch.Generator) -> None:
        h, d = spec.num_kv_heads, spec.head_dim
        self.params = params
        self.gen = gen
        self.stream = params["schedule"] == "stream"
        self.keys = torch.zeros(h, 0, d, dtype=spec.dtype, device=spec.device)
        self.values = torch.zeros(h, 0, d, dtype=spec.dtype, device=spec.device)
        self.positions = torch.zeros(h, 0, dtype=torch.long, device=spec.device)
        self.log_w = torch.zeros(h, 0, dtype=torch.float32, device=spec.device)  # numerator: log w
        self.log_count = torch.zeros(h, 0, dtype=torch.float32, device=spec.device)  # tokens stood for
        self.level = torch.zeros(0, dtype=torch.long, device=spec.device)

    def _tensors(self) -> dict[str, Tensor]:
        names = ("keys", "values", "positions", "log_w", "log_count", "level")
        return {name: getattr(self, name) for name in names}

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def append(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights: Tensor) -> None:
        self.keys = torch.cat([self.keys, keys.to(self.keys.dtype)], 1)
        self.values = torch.cat([self.values, values.to(self.values.dtype)], 1)
        self.positions = torch.cat([self.positions, positions], 1)
        self.log_w = torch.cat([self.log_w, log_weights], 1)
        self.log_count = torch.cat([self.log_count, log_weights.clone()], 1)
        self.level = torch.cat([self.level, self.level.new_zeros(keys.shape[1])])

    def fit(self, budget: int) -> None:
        if budget <= 0:  # no room for any entry: the middle is dropped, not halved forever
            self._keep(torch.zeros(self.length, dtype=torch.bool, device=self.keys.device))
        elif self.stream:
            self._stream_fit(budget)
        else:
            self._prefill_fit(budget)

    def _keep(self, mask: Tensor) -> None:
        for name, tensor in self._tensors().items():
            setattr(self, name, tensor[mask] if name == "level" else tensor[:, mask])

    def _prefill_fit(self, budget: int) -> None:
        """Prefill schedule: while over budget, halve the whole lowest level holding two or
        more entries (one list, walk blocks of `block`); its survivors join the next level.

        A one-shot prefill holds one level, so this is the authors' T halvings of the whole
        middle (their LongBench setting). Later overflows never walk entries of different
        counts together: the walk's count coordinate (c0) is the same for every entry, and
        exact-half doubles every survivor's count, which is exact only when all counts are
        equal. Halving the whole middle at once would mix levels 0, 1, 2, ... and lose over
        half the count in a long chat (48 ingests of 64 tokens at budget 512: sum of counts
        0.35-0.56 of the tokens). Grouping by level is also the paper's own rule:
        SoftmaxBalance halves a set of equal weights and MergeAndReduce only merges outputs
        of one level (Algorithm 4); weighting c0 by count would be neither the paper nor the
        code.
        Lowest level first: new tokens are brought to the old tokens' density before the
        old are halved again (the stream schedule's early-reduction order, see below)."""
        while self.length > budget:
            sizes = torch.bincount(self.level).tolist()
            pairs = [lvl for lvl, size in enumerate(sizes) if size >= 2]
            if not pairs:
                self._merge_lowest_singles()
                continue
            lvl = pairs[0]
            start = int((self.level > lvl).sum())
            self._halve(start, sizes[lvl], sizes[lvl], self.params["block"], level=lvl + 1)

    def _stream_fit(self, budget: int) -> None:
        """Lazy MergeAndReduce: while over budget, reduce the oldest full batches of the
        lowest level holding one (as many at once as the excess needs; they are
        independent walks, run in parallel). When no level holds a full batch (budgets
        below batch x levels), reduce the lowest non-empty level's whole buffer early.
        Reducing the highest level instead would make its survivors the new highest level,
        reduced again, so the oldest tokens would collapse to nothing (on real keys at 1/4:
        mean error 0.157 against 0.136 with the lowest level). The
        lowest level's reduction also costs the least error (smallest weights)."""
        batch = self.params["batch"]
        freed_per_batch = batch - batch // 2
        while self.length > budget:
            sizes = torch.bincount(self.level).tolist()
            full = [lvl for lvl, size in enumerate(sizes) if size >= batch]
            pairs = [lvl for lvl, size in enumerate(sizes) if size >= 2]
            if full:
                lvl = full[0]
                start = int((self.level > lvl).sum())
                needed = math.ceil((self.length - budget) / freed_per_batch)
                count = min(sizes[lvl] // batch, needed)
                self._halve(start, count * batch, batch, batch, level=lvl + 1)
            elif pairs:
                lvl = pairs[0]
                start = int((self.level > lvl).sum())
                self._halve(start, sizes[lvl], sizes[lvl], sizes[lvl], level=lvl + 1)
            else:
                self._merge_lowest_singles()

    def _merge_lowest_singles(self) -> None:
        """Every level holds one entry (a budget below the number of levels): the two
        lowest become one. A walk cannot halve two entries of different weight, so the
        survivor is drawn with probability c_j / (c_1 + c_2) and stands for both: its
        count becomes c_1 + c_2 (exact) and its numerator weight w_j (c_1 + c_2) / c_j
        (unbiased). It takes the higher of the two levels."""
        newest, older = self.length - 1, self.length - 2
        counts = self.log_count[:, [older, newest]].exp()  # [H, 2]
        pick_newest = torch.rand(counts.shape[0], generator=self.gen).to(counts.device) < counts[:, 1] / counts.sum(1)
        survivor = torch.where(pick_newest, newest, older)
        rows = torch.arange(counts.shape[0], device=counts.device)
        total = counts.sum(1).log()
        self.log_w[rows, survivor] += total - self.log_count[rows, survivor]
        self.log_count[rows, survivor] = total
        # Heads may pick different survivors: move each head's survivor into slot `older`.
        for name in ("keys", "values", "positions", "log_w", "log_count"):
            tensor = getattr(self, name)
            tensor[rows, older] = tensor[rows, survivor]
        keep = torch.ones(self.length, dtype=torch.bool, device=self.keys.device)
        keep[newest] = False
        self._keep(keep)

    def _halve(self, start: int, span: int, list_len: int, block: int, level: int = 0) -> None:
        """Halve entries [start, start + span) as span / list_len independent lists
        (walk blocks of `block`), replacing them in place by their survivors (which
        form level `level`)."""
        h, _, d = self.keys.shape
        lists = span // list_len
        stop = start + span
        # An odd list halves its first list_len - 1 entries; the last one is carried
        # through with its weights unchanged (halving it too would lose one token's count).
        walked = list_len - list_len % 2

        def as_lists(x: Tensor) -> Tensor:
            return x[:, start:stop].reshape(h * lists, list_len, *x.shape[2:])

        def walked_part(x: Tensor) -> Tensor:
            return as_lists(x)[:, :walked]

        signs = _code_signs(
            walked_part(self.keys), walked_part(self.values), walked_part(self.log_w), block, self.params, self.gen
        )
        kept, doubled = _exact_half(signs)
        halved = torch.ones_like(doubled)
        if walked < list_len:
            carried = kept.new_full((kept.shape[0], 1), list_len - 1)
            kept = torch.cat([kept, carried], 1)
            doubled = torch.cat([doubled, torch.zeros_like(carried, dtype=torch.bool)], 1)
            halved = torch.cat([halved, torch.zeros_like(carried, dtype=torch.bool)], 1)
        survivors = kept.shape[1] * lists

        def select(x: Tensor) -> Tensor:
            chosen = as_lists(x)
            index = kept if x.dim() == 2 else kept[..., None].expand(-1, -1, d)
            picked = chosen.gather(1, index).reshape(h, survivors, *x.shape[2:])
            return torch.cat([x[:, :start], picked, x[:, stop:]], 1)

        doubling = (doubled.float() * LOG2).reshape(h, survivors)
        self.log_w = select(self.log_w)
        self.log_w[:, start : start + survivors] += doubling
        self.log_count = select(self.log_count)
        # h halved survivors stand for 2h tokens; a carried entry for what it stood for.
        self.log_count[:, start : start + survivors] += (halved.float() * LOG2).reshape(h, survivors)
        self.keys, self.values, self.positions = select(self.keys), select(self.values), select(self.positions)
        # A carried odd entry stays in its level: every entry of a level then stands for
        # the same count, which is what lets a halving double it exactly.
        new_level = torch.where(halved[0], level, level - 1).repeat(lists)
        self.level = torch.cat([self.level[:start], new_level, self.level[stop:]])
        if walked < list_len and lists > 1:  # keep levels non-increasing along the sequence
            order = torch.sort(-self.level, stable=True).indices
            self._keep(order)

    def entries(self) -> Entries:
        den = self.log_count if self.params["den_weight"] == "count" else self.log_w
        return Entries(self.keys, self.values, self.positions, self.log_w, den.clone())

    def state(self) -> StateDict:
        return dict(self._tensors())

    def load(self, state: StateDict) -> None:
        for name in self._tensors():
            if name in state:
                setattr(self, name, state[name])
        if "level" not in state:
            # A prefill snapshot without levels (it has mixed counts): each
            # entry's level from its count, oldest levels first (the order halvings need).
            self.level = (self.log_count[0] / LOG2).round().long().clamp_min(0)
            self._keep(torch.sort(-self.level, stable=True).indices)

    def nbytes(self) -> int:
        return tensor_bytes(*self._tensors().values())

    def reposition(self, fn: Repositioner) -> None:
        self.keys, self.positions = fn(self.keys, self.positions)


class _PaperMiddle:
    """Mode `paper`: per KV head, a chronological pool of tokens, each a member of its
    value-norm bucket's numerator instance (`num_level` >= 0) and/or of the denominator
    instance (`den_level` >= 0); level l means weight 2^l (times the incoming count).
    Buckets and smaller-side selection make the heads ragged, so each head has its own
    pool; heads over budget are reduced in lockstep (one batched walk per wave). Every
    instance buffer (role, bucket, level) is the pool's members at that level, in order."""

    FIELDS = ("keys", "values", "positions", "log_c", "num_level", "den_level", "bucket")
    NUMERATOR, DENOMINATOR = 0, 1

    def __init__(self, spec: LayerSpec, params: dict[str, Any], gen: torch.Generator) -> None:
        self.spec = spec
        self.params = params
        self.gen = gen
        self.stream = params["schedule"] == "stream"
        self.failures = 0  # SoftmaxBalance FAIL events (p clipped instead of aborting)
        d, device = spec.head_dim, spec.device
        self.heads: list[dict[str, Tensor]] = [
            {
                "keys": torch.zeros(0, d, dtype=spec.dtype, device=device),
                "values": torch.zeros(0, d, dtype=spec.dtype, device=device),
                "positions": torch.zeros(0, dtype=torch.long, device=device),
                "log_c": torch.zeros(0, dtype=torch.float32, device=device),
                "num_level": torch.zeros(0, dtype=torch.long, device=device),
                "den_level": torch.zeros(0, dtype=torch.long, device=device),
                "bucket": torch.zeros(0, dtype=torch.long, device=device),
            }
            for _ in range(spec.num_kv_heads)
        ]

    def append(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights: Tensor) -> None:
        # Bucket i holds 2^(i-1) < ||v|| <= 2^i (the paper's value-norm buckets).
        norms = values.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        buckets = torch.ceil(torch.log2(norms)).long()
        zeros = torch.zeros(keys.shape[1], dtype=torch.long, device=keys.device)
        for h, pool in enumerate(self.heads):
            new = {
                "keys": keys[h].to(self.spec.dtype),
                "values": values[h].to(self.spec.dtype),
                "positions": positions[h],
                "log_c": log_weights[h],
                "num_level": zeros,
                "den_level": zeros,
                "bucket": buckets[h],
            }
            for name in self.FIELDS:
                pool[name] = torch.cat([pool[name], new[name]])

    def fit(self, budget: int) -> None:
        # Heads over budget take their next wave of reductions together (one batched walk).
        while True:
            wave: list[tuple[dict[str, Tensor], int, Tensor]] = []
            for pool in self.heads:
                excess = pool["keys"].shape[0] - budget
                if excess > 0:
                    lists = self._stream_lists(pool, excess) if self.stream else self._prefill_lists(pool)
                    wave.extend((pool, role, members) for role, members in lists)
            if not wave:
                return
            self._reduce(wave)

    @staticmethod
    def _roles(pool: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """levels [2, m] (-1: not a member) and groups [2, m] for (numerator, denominator)."""
        levels = torch.stack([pool["num_level"], pool["den_level"]])
        groups = torch.stack([pool["bucket"], torch.zeros_like(pool["bucket"])])
        return levels, groups

    def _stream_lists(self, pool: dict[str, Tensor], excess: int) -> list[tuple[int, Tensor]]:
        """The next wave of MergeAndReduce reductions, as (role, member indices): at the
        lowest level where some instance has a full batch, the oldest full batches of
        every such instance (as many as the excess would need if each freed half a
        batch). Failing that, early reductions: every reducible buffer of the lowest level
        that has one (see `_reducible`)."""
        batch = self.params["batch"]
        levels, groups = self._roles(pool)
        member = levels >= 0
        roles = torch.arange(2, device=levels.device)[:, None].expand_as(levels)
        buffers, sizes = torch.unique(
            torch.stack([levels[member], roles[member], groups[member]], 1), dim=0, return_counts=True
        )
        if bool((sizes >= batch).any()):
            lowest = int(buffers[sizes >= batch, 0].min())
            needed = math.ceil(excess / (batch - batch // 2))
            lists: list[tuple[int, Tensor]] = []
            for (level, role, group), size in zip(buffers.tolist(), sizes.tolist()):
                if level == lowest and size >= batch:
                    members = torch.nonzero((levels[role] == level) & (groups[role] == group)).flatten()
                    lists.extend((role, chunk) for chunk in members[: min(size // batch, needed) * batch].split(batch))
            return lists
        reducible = self._reducible(pool, buffers, sizes)
        chosen = [i for i, ok in enumerate(reducible) if ok]
        if not chosen:  # only exact buckets and single entries left: the budget wins
            chosen = list(range(len(reducible)))
        lowest = min(int(buffers[i, 0]) for i in chosen)
        lists = []
        for i in chosen:
            level, role, group = buffers[i].tolist()
            if level == lowest:
                lists.append((role, torch.nonzero((levels[role] == level) & (groups[role] == group)).flatten()))
        return lists

    def _reducible(self, pool: dict[str, Tensor], buffers: Tensor, sizes: Tensor) -> list[bool]:
        """Which buffers (level, role, group) an early reduction may touch: not a
        numerator bucket holding fewer than t = `batch` entries in all (such buckets stay
        exact, kvchat's choice), and not a single entry (SoftmaxBalance keeps the smaller
        sign group, which for one entry is empty: its weight would be lost)."""
        batch = self.params["batch"]
        names, counts = torch.unique(pool["bucket"][pool["num_level"] >= 0], return_counts=True)
        bucket_sizes = dict(zip(names.tolist(), counts.tolist()))
        out = []
        for (_, role, group), size in zip(buffers.tolist(), sizes.tolist()):
            small_bucket = role == self.NUMERATOR and bucket_sizes.get(group, 0) < batch
            out.append(size >= 2 and not small_bucket)
        return out

    def _prefill_lists(self, pool: dict[str, Tensor]) -> list[tuple[int, Tensor]]:
        """One halving of every instance's whole list, in blocks of `block`; numerator
        buckets with fewer than t = `batch` entries stay exact (kvchat's choice) unless
        nothing else is left to halve."""
        levels, groups = self._roles(pool)
        lists: list[tuple[int, Tensor]] = []
        exact: list[tuple[int, Tensor]] = []
        for role in (self.NUMERATOR, self.DENOMINATOR):
            for group in torch.unique(groups[role][levels[role] >= 0]).tolist():
                members = torch.nonzero((levels[role] >= 0) & (groups[role] == group)).flatten()
                small = role == self.NUMERATOR and len(members) < self.params["batch"]
                for chunk in members.split(self.params["block"]):
                    (exact if small or len(chunk) < 2 else lists).append((role, chunk))
        return lists or exact  # the budget wins once only exact buckets are left

    def _balanced_vectors(self, pool: dict[str, Tensor], role: int, members: Tensor) -> Tensor:
        """What SoftmaxBalance balances for these members, [m, d]: the value (numerator)
        or the scalar 1 in one coordinate (denominator), times the member's weight."""
        level = pool["num_level" if role == self.NUMERATOR else "den_level"][members]
        weight = (pool["log_c"][members] + level * LOG2).exp()[:, None]
        if role == self.NUMERATOR:
            return pool["values"][members].float() * weight
        return F.pad(weight, (0, self.spec.head_dim - 1))

    def _reduce(self, wave: list[tuple[dict[str, Tensor], int, Tensor]]) -> None:
        """Run SoftmaxBalance on every list of the wave at once; survivors move up a
        level, the rest leave their instance; tokens left in no instance leave the pool."""
        length = max(len(members) for _, _, members in wave)

        def padded(rows: Tensor) -> Tensor:
            return F.pad(rows, (0, 0, 0, length - rows.shape[0]))

        keys = torch.stack([padded(pool["keys"][members].float()) for pool, _, members in wave])
        vectors = torch.stack([padded(self._balanced_vectors(pool, role, members)) for pool, role, members in wave])
        valid = (
            torch.arange(length, device=keys.device)
            < torch.tensor([len(members) for _, _, members in wave], device=keys.device)[:, None]
        )
        kept, failures = _softmax_balance(keys, vectors, valid, self.params["delta"], self.gen)
        self.failures += failures
        for row, (pool, role, members) in enumerate(wave):
            name = "num_level" if role == self.NUMERATOR else "den_level"
            moved = torch.where(kept[row, : len(members)], pool[name][members] + 1, -1)
            # Out of place: tensors handed out by state_dict() must not change under the caller.
            pool[name] = pool[name].index_put((members,), moved)
        for pool in self.heads:
            alive = (pool["num_level"] >= 0) | (pool["den_level"] >= 0)
            for name in self.FIELDS:
                pool[name] = pool[name][alive]

    def entries(self) -> Entries:
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        longest = max(pool["keys"].shape[0] for pool in self.heads)
        out = Entries.empty(h, d, self.spec.device, self.spec.dtype)
        keys = out.keys.new_zeros(h, longest, d)
        values = out.values.new_zeros(h, longest, d)
        positions = out.positions.new_zeros(h, longest)
        log_num = out.log_num.new_full((h, longest), NEG_INF)
        log_den = out.log_den.new_full((h, longest), NEG_INF)
        for i, pool in enumerate(self.heads):
            m = pool["keys"].shape[0]
            keys[i, :m], values[i, :m], positions[i, :m] = pool["keys"], pool["values"], pool["positions"]
            for name, target in (("num_level", log_num), ("den_level", log_den)):
                level = pool[name]
                target[i, :m] = torch.where(level >= 0, pool["log_c"] + level * LOG2, NEG_INF)
        return Entries(keys, values, positions, log_num, log_den)

    def state(self) -> StateDict:
        state: StateDict = {f"head{h}.{name}": pool[name] for h, pool in enumerate(self.heads) for name in self.FIELDS}
        state["failures"] = self.failures
        return state

    def load(self, state: StateDict) -> None:
        self.heads = [
            {name: state_tensor(state, f"head{h}.{name}") for name in self.FIELDS} for h in range(len(self.heads))
        ]
        self.failures = int(state["failures"])

    def nbytes(self) -> int:
        return sum(tensor_bytes(*pool.values()) for pool in self.heads)

    def reposition(self, fn: Repositioner) -> None:
        # One call over all heads (padded), as the cache's position compaction expects.
        entries = self.entries()
        keys, positions = fn(entries.keys, entries.positions)
        for h, pool in enumerate(self.heads):
            m = pool["keys"].shape[0]
            pool["keys"], pool["positions"] = keys[h, :m], positions[h, :m]


MODES = ("code", "paper")
SCHEDULES = ("stream", "prefill")
DEN_WEIGHTS = ("count", "same")


@register
class BalanceKV(Compressor):
    name = "balancekv"
    description = "BalanceKV: repeatedly keeps a balanced half of old tokens (discrepancy walk), survivors weighted."
    hyperparameters = (
        Param(
            "mode",
            str,
            "code",
            "code: the authors' block walk with exact halves (their results); paper: "
            "SoftmaxBalance with value-norm buckets and a separate denominator (paper Alg. 1/2)",
            "the authors' code",
            choices=MODES,
        ),
        Param(
            "schedule",
            str,
            "stream",
            "stream: merge-and-reduce over batches, only as far as the budget "
            "needs (paper Alg. 4); prefill: halve whole levels of the middle until it fits",
            "paper Alg. 4; prefill is their LongBench setting",
            choices=SCHEDULES,
        ),
        Param(
            "den_weight",
            str,
            "count",
            "code mode: count = denominator weight 2^level; same = the numerator's weight in both",
            "the authors' LongBench code; same is their needle code",
            choices=DEN_WEIGHTS,
        ),
        Param(
            "batch",
            int,
            256,
            "stream schedule: merge-and-reduce batch, one walk block each",
            "the paper's single-layer study",
            low=2,
        ),
        Param(
            "block",
            int,
            128,
            "prefill schedule: walk block of a whole-middle halving",
            "the authors' LongBench script",
            low=2,
        ),
        Param("gamma", float, 4.0, "code mode: walk gain", "the authors' code"),
        Param(
            "temperature",
            float,
            1.0,
            "code mode: kernel temperature τ in exp(τ⟨k,k'⟩/√d)",
            "the authors' LongBench code",
        ),
        Param("beta", float, 0.0, "code mode: kernel offset β in exp(… − β)", "the authors' code"),
        Param(
            "c0",
            float,
            0.025,
            "code mode: constant added to value inner products, balances the count too",
            "the authors' code",
        ),
        Param(
            "delta",
            float,
            0.01,
            "paper mode: SoftmaxBalance failure probability",
            "the paper leaves it free; kvchat's choice",
            low=0,
            high=1,
            open_low=True,
            open_high=True,
        ),
    )
    split_weights = True

    def __init__(self, spec: LayerSpec, budget: int, **params: Any) -> None:
        super().__init__(spec, budget, **params)
        self._check_params()
        self._gen = spec.generator("balancekv")
        middle = _CodeMiddle if self.params["mode"] == "code" else _PaperMiddle
        self._middle: _CodeMiddle | _PaperMiddle = middle(spec, self.params, self._gen)

    def _check_params(self) -> None:
        p = self.params
        for name, choices in (("mode", MODES), ("schedule", SCHEDULES), ("den_weight", DEN_WEIGHTS)):
            if p[name] not in choices:
                raise ValueError(f"balancekv: {name} must be one of {', '.join(choices)}, not {p[name]!r}")
        for name in ("batch", "block"):
            p[name] = int(p[name])
            if p[name] < 2:
                raise ValueError(f"balancekv: {name} must be at least 2")
        for name in ("gamma", "temperature", "beta", "c0", "delta"):
            p[name] = float(p[name])
        if not 0.0 < p["delta"] < 1.0:
            raise ValueError("balancekv: delta must lie in (0, 1)")

    @property
    def failures(self) -> int:
        """SoftmaxBalance FAIL events so far (mode paper; p is clipped, nothing aborts)."""
        return self._middle.failures if isinstance(self._middle, _PaperMiddle) else 0

    def ingest(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        log_weights: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> None:
        self._middle.append(keys, values, positions, incoming_log_weights(log_weights, positions))
        self._middle.fit(max(self.budget, 0))

    def entries(self) -> Entries:
        return self._middle.entries()

    def state_dict(self) -> StateDict:
        return {**self._middle.state(), "rng": generator_state(self._gen)}

    def load_state_dict(self, state: StateDict) -> None:
        self._middle.load(state)
        set_generator_state(self._gen, state_tensor(state, "rng"))

    def nbytes(self) -> int:
        return self._middle.nbytes()

    def reposition(self, fn: Repositioner) -> None:
        self._middle.reposition(fn)
