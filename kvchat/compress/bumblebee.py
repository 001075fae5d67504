"""`bumblebee`: streaming submodular summarisation of the middle ("BumbleBee: Dynamic
KV-Cache Streaming Submodular Summarization for Infinite-Context Transformers", Kumari et
al., COLM 2024; docs/methods.md).

The middle is an exact subset of the tokens (a = b = the entry's log-weight, 0 for plain
tokens) chosen to keep g(A) = lam * f_FL(A) + (1 - lam) * c(A) high:

- diversity, facility location on key similarity: f_FL(A) = sum_{v in V} max_{a in A}
  sim(v, a), sim = (1 + cos)/2 on post-RoPE keys;
- importance, concave over modular: c(A) = sum_u phi(sum_{v in A} m_u(v)), u the query
  heads of the GQA group, m_u(v) the attention v accumulated from head u.

A batch larger than the whole budget (a prefill) is summarised with the offline greedy of
Algorithm 1 over summary + batch (V = that pool) when that pool has at most greedy_max
tokens; a longer one streams in pieces of STREAM_BATCH. Otherwise a batch streams in (Algorithm 2):
its tokens join S' = summary + batch, and members of S' whose removal costs g least are
evicted until the summary fits. Algorithm 2 offers one candidate at a time; for a batch
of b candidates that is b sequential decisions, a Python loop that took 16-17% of decode
time at 8k. Here the b evictions are made in rounds over all heads at once: each round
evicts, in each head independently, the members of least marginal whose nearest neighbour
is not evicted in the same round (a member whose neighbour leaves would gain marginal), and
marginals are recomputed between rounds. A batch of one is exactly Algorithm 2; for larger batches the
rounds are a relaxation (measured in docs/methods.md). With V = S', removing i only loses
i's own coverage, so its facility-location marginal is count_i * (1 - nn_sim(i)); a
nearest-neighbour cache over the summary keeps this O(|S| d) per round.

Both phases optimise the same objective: f_FL is normalised by the weight of its ground
set, f_FL(A) / sum_v count_v (the mean coverage of V, in [0, 1]). Unnormalised, the greedy's
diversity gain would be a sum over up to greedy_max tokens (hundreds) while a streaming
marginal is a single term (at most 1), so one lam would mean two different trade-offs.

An entry that already stands for exp(w) tokens counts exp(w) times in V (weighted facility
location); its attention mass already includes the weight.

Both selection loops are long chains of small sequential decisions, so they run on the
CPU: in kvchat's kernels where those run (`kvchat.native.use`: the offline greedy,
`_greedy.c`; the streaming append and rounds, `_summary.c`), in NumPy otherwise (a small
NumPy operation runs on the calling thread; a small torch reduction enters an OpenMP
region, which stalls when the cores are busy). The greedy's n x n cosines are one torch
product (bf16 is native there). Only unit keys, weights, scores and positions cross; the
kept set comes back as indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvchat import native
from kvchat.compress import register
from kvchat.compress.base import (
    Compressor,
    LayerSpec,
    Param,
    generator_state,
    incoming_log_weights,
    set_generator_state,
)
from kvchat.kv_types import Entries, Repositioner, StateDict, state_tensor, tensor_bytes
from kvchat.runtime import cpu_has_fast_bf16

# Stochastic greedy (Mirzasoleiman et al., AAAI 2015): each greedy step evaluates a random
# sample of (pool / budget) * ln(1 / eps) remaining tokens, which keeps 1 - 1/e - eps of
# the optimum in expectation for about ln(1 / eps) similarity rows per pool token.
GREEDY_EPSILON = 0.01
# Rows of similarity computed at once when (re)building the nearest-neighbour cache, so
# that a large summary never materialises a full |S| x |S| matrix per head.
SIMILARITY_BLOCK = 1024
# The largest batch streamed in one piece (a flush streams in pieces of this size);
# decode batches (64) are smaller.
STREAM_BATCH = 256


@dataclass
class _Tokens:
    """Per-entry data of a set of tokens, all KV heads at once (leading axis: head)."""

    keys: Tensor  # [H, n, d], model dtype
    values: Tensor  # [H, n, d]
    positions: Tensor  # [H, n], int64
    log_weights: Tensor  # [H, n], float32: the entry stands for exp(w) tokens
    scores: Tensor  # [H, G, n], float64: attention mass accumulated from each query head
    # (the layout `observe` receives, so accumulating is one contiguous add per step)

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def take(self, index: Tensor) -> _Tokens:
        """Entries index [H, m] of every head, in that order."""

        heads, n = self.positions.shape
        # One index_select over the flattened heads: a gather with an index expanded over
        # the trailing dimensions costs about 20x more on the CPU.
        flat = (index + torch.arange(heads, device=index.device).unsqueeze(1) * n).flatten()

        def pick(t: Tensor) -> Tensor:
            return t.reshape(heads * n, *t.shape[2:]).index_select(0, flat).view(*index.shape, *t.shape[2:])

        group = self.scores.shape[1]
        per_row = index.repeat_interleave(group, 0)  # [H * G, m]: each query head's row
        scores = self.scores.reshape(heads * group, n).gather(1, per_row).view(heads, group, -1)
        return _Tokens(pick(self.keys), pick(self.values), pick(self.positions), pick(self.log_weights), scores)

    def part(self, start: int, stop: int) -> _Tokens:
        """Entries [start, stop) of every head."""
        return _Tokens(
            *(
                getattr(self, f.name)[..., start:stop, :] if f.name in _ROWS else getattr(self, f.name)[..., start:stop]
                for f in fields(self)
            )
        )

    @staticmethod
    def cat(parts: list[_Tokens]) -> _Tokens:
        return _Tokens(
            *(torch.cat([getattr(p, f.name) for p in parts], -2 if f.name in _ROWS else -1) for f in fields(_Tokens))
        )


_ROWS = {"keys", "values"}  # fields with one row per entry ([H, n, d]); the others end in n


@dataclass
class _Pool:
    """What selection reads of a set of tokens, as CPU arrays."""

    unit: np.ndarray  # [H, n, d] float32: keys scaled to unit length (cosine = dot)
    count: np.ndarray  # [H, n] float64: tokens each entry stands for, exp(w)
    mass: np.ndarray  # [H, G, n] float64: accumulated attention per query head
    positions: np.ndarray  # [H, n] int64

    @staticmethod
    def of(tokens: _Tokens) -> _Pool:
        return _Pool(
            unit=_unit(tokens.keys),
            count=np.exp(tokens.log_weights.cpu().numpy().astype(np.float64)),
            mass=np.ascontiguousarray(tokens.scores.cpu().numpy()),
            positions=tokens.positions.cpu().numpy(),
        )


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """cos between unit keys a [H, r, d] and unit keys b [H, n, d] -> [H, r, n].

    The product runs in torch: NumPy's BLAS keeps its own thread pool, outside the engine's
    thread count (with the cores shared, its threads made this product 20x slower), and
    torch reads b transposed in place. Neighbour searches compare cosines and convert only
    the winners to sim = (1 + cos)/2: the map is monotone, so the maxima are the same."""
    a_t, b_t = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(b)
    return torch.matmul(a_t, b_t.transpose(1, 2)).numpy()


def _nearest_of(scores: np.ndarray, *, cosines: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Nearest neighbour along the last axis of cosines (or of sims, cosines=False; -inf
    marks excluded entries): sim = (1 + cos)/2 and index; a row with nothing left gives
    similarity 0 (no coverage) and index -1."""
    if scores.shape[-1] == 0:
        return np.zeros(scores.shape[:-1], dtype=np.float32), np.full(scores.shape[:-1], -1, dtype=np.int64)
    index = scores.argmax(-1)
    value = np.take_along_axis(scores, index[..., None], -1)[..., 0]
    found = np.isfinite(value)
    sim = (1 + value) / 2 if cosines else value
    return np.where(found, sim, 0).astype(np.float32), np.where(found, index, -1)


def _similarity_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the offline greedy's n x n cosines are held in for a layer of this dtype: bf16
    where the layer is bf16 and the CPU multiplies bf16 natively, float32 otherwise (the
    float32 path keeps float32 selections). bf16 cosines are within 2^-8 of the float32
    ones; on the greedy of real 4k prefills they picked the same tokens (docs/methods.md)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and cpu_has_fast_bf16() else torch.float32


def _unit(keys: Tensor) -> np.ndarray:
    k = keys.detach().to("cpu", torch.float32).numpy()
    return k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)


def _nearest(queries: np.ndarray, pool: np.ndarray, self_offset: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Nearest neighbour, by sim = (1 + cos)/2, of each unit query [H, r, d] among unit
    pool keys [H, p, d]: (similarity, pool index); query i is pool entry self_offset + i,
    excluded, when self_offset is given."""
    h, r, _ = queries.shape
    best = np.zeros((h, r), dtype=np.float32)
    where = np.full((h, r), -1, dtype=np.int64)
    for start in range(0, r, SIMILARITY_BLOCK):
        rows = slice(start, start + SIMILARITY_BLOCK)
        cos = _cosines(queries[:, rows], pool)
        if self_offset is not None:
            block = np.arange(cos.shape[1])
            cos[:, block, block + self_offset + start] = -np.inf
        best[:, rows], where[:, rows] = _nearest_of(cos)
    return best, where


class _Objective:
    """The two marginal terms of g_lambda and how one decision mixes them."""

    def __init__(self, lam: float, phi: str, alpha: float, beta: float, normalize: str) -> None:
        self.lam, self.phi, self.alpha, self.beta, self.normalize = lam, phi, alpha, beta, normalize

    def concave(self, x: np.ndarray) -> np.ndarray:
        """phi(x), float64: log(1 + x), or the inverse of g(y) = alpha y^(1/alpha) + beta y."""
        if self.phi == "log":
            return np.log1p(x)
        a, b = self.alpha, self.beta
        if a == 0.5:  # 0.5 y^2 + b y = x has a closed-form root
            return np.sqrt(b * b + 2 * x) - b
        # g is convex and increasing, so Newton from an upper bound decreases monotonically
        # to the root; g(y) >= a y^(1/a) and g(y) >= b y give the bound.
        y = (x / a) ** a
        if b > 0:
            y = np.minimum(y, x / b)
        for _ in range(100):
            slope = np.maximum(y, 1e-300) ** (1 / a - 1) + b
            step = np.where(x > 0, (a * y ** (1 / a) + b * y - x) / slope, 0.0)
            y = y - step
            if np.all(np.abs(step) <= 1e-14 * (1 + y)):
                break
        return y

    def kernel_args(self) -> dict[str, Any]:
        """The objective as kvchat's kernels take it (`kvchat.native.greedy_picks`,
        `summary_shrink`)."""
        return {
            "lam": float(self.lam),
            "phi_log": self.phi == "log",
            "alpha": float(self.alpha),
            "beta": float(self.beta),
            "minmax": self.normalize == "minmax",
        }

    def importance_gain(self, total: np.ndarray, mass: np.ndarray) -> np.ndarray:
        """Gain of adding each candidate to a set: sum_u phi(A_u + m_u) - phi(A_u);
        total [H, G, 1], mass [H, G, R] -> [H, R]."""
        return (self.concave(total + mass) - self.concave(total)).sum(1)

    def importance_loss(self, mass: np.ndarray) -> np.ndarray:
        """Loss of removing each member of a set [H, G, n]: sum_u phi(A_u) - phi(A_u - m_u)."""
        total = mass.sum(-1, keepdims=True)
        return (self.concave(total) - self.concave(np.maximum(total - mass, 0))).sum(1)

    def mix(self, diversity: np.ndarray, importance: np.ndarray, live: np.ndarray | None = None) -> np.ndarray:
        """lam * diversity + (1 - lam) * importance, per head over the last axis (minmax
        scales over the `live` candidates only, when given)."""
        if self.normalize == "minmax":
            diversity, importance = _minmax(diversity, live), _minmax(importance, live)
        return self.lam * diversity.astype(np.float64) + (1 - self.lam) * importance


def _minmax(x: np.ndarray, live: np.ndarray | None = None) -> np.ndarray:
    low = x.min(-1, keepdims=True, initial=np.inf, where=True if live is None else live)
    span = x.max(-1, keepdims=True, initial=-np.inf, where=True if live is None else live) - low
    return np.where(span > 0, (x - low) / np.where(span > 0, span, 1), 0.0)


class _StreamingSummary:
    """Algorithm 2 over a pool = the current summary followed by the incoming batch.

    Slot i is pool entry i (the batch's slots come alive as `append` inserts them). An
    eviction only marks its slots dead (count and mass 0, marginal +inf), so each head
    evicts its own number of members per round; the survivors are gathered once, when every
    head is down to the budget. `source` maps each result slot to its pool index: the
    result is a set of pool indices.
    """

    def __init__(self, pool: _Pool, held: int, nn_sim: np.ndarray, nn_idx: np.ndarray, objective: _Objective) -> None:
        h, size = pool.positions.shape
        self.objective = objective
        self.length = held
        self.heads = np.arange(h)
        # Read-only arrays are the pool's own; the ones an eviction changes are copies. All
        # are contiguous in the dtypes the rounds' kernel reads.
        self.unit = np.ascontiguousarray(pool.unit, dtype=np.float32)
        self.positions = np.ascontiguousarray(pool.positions, dtype=np.int64)
        self.count, self.mass = pool.count.astype(np.float64), pool.mass.astype(np.float64)
        self.source = np.broadcast_to(np.arange(size), (h, size)).copy()
        self.nn_sim = np.zeros((h, size), dtype=np.float32)
        self.nn_idx = np.full((h, size), -1, dtype=np.int64)
        self.nn_sim[:, :held], self.nn_idx[:, :held] = nn_sim, nn_idx
        self.alive = np.zeros((h, size), dtype=bool)
        self.alive[:, :held] = True

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pool indices, nn_sim, nn_idx), nn_idx in the order of the pool indices."""
        n = self.length
        return self.source[:, :n], self.nn_sim[:, :n], self.nn_idx[:, :n]

    def append(self) -> None:
        """Insert the rest of the pool (the batch) into the summary, updating the neighbour
        cache (no eviction: `shrink` follows); in kvchat's kernel where it is built."""
        size, held = self.unit.shape[1], self.length
        if native.use("summary"):
            native.summary_append(self.unit, held, SIMILARITY_BLOCK, self.nn_sim, self.nn_idx)
            self.alive[:, held:], self.length = True, size
        while self.length < size:  # bounded similarity blocks
            self._append_block(min(SIMILARITY_BLOCK, size - self.length))

    def _append_block(self, k: int) -> None:
        """Insert the next k pool entries."""
        n = self.length
        self.alive[:, n : n + k] = True
        new = self.unit[:, n : n + k]
        # One product serves both directions: new vs everyone, and (transposed) the older
        # members' similarity to the new tokens.
        cos = _cosines(new, self.unit[:, : n + k])  # [H, k, n + k]
        if n:
            # The closest new token of each older member, looked up only for the members
            # it is closer to than their neighbour (an argmax across rows is slow in NumPy).
            older = cos[:, :, :n]
            best_sim = (1 + older.max(1)) / 2  # [H, n]
            head, member = np.nonzero(best_sim > self.nn_sim[:, :n])
            self.nn_sim[head, member] = best_sim[head, member]
            self.nn_idx[head, member] = older[head, :, member].argmax(1) + n
        block = np.arange(k)
        cos[:, block, n + block] = -np.inf  # a token is not its own neighbour
        self.nn_sim[:, n : n + k], self.nn_idx[:, n : n + k] = _nearest_of(cos)
        self.length = n + k

    def shrink(self, budget: int) -> None:
        """Evict members of least marginal g(i | S - i), in rounds, until every head holds
        `budget` members, then gather the survivors. (A head's rounds are its own.)"""
        if native.use("summary") and self.length == self.alive.shape[1]:
            self._shrink_native(budget)
        else:
            while True:
                # At most a block per round keeps the neighbour search of `_evict` bounded.
                excess = np.minimum(self.alive.sum(1) - budget, SIMILARITY_BLOCK)
                if excess.max() <= 0:
                    break
                self._evict(self._cheapest(excess))
        self._gather()

    def _shrink_native(self, budget: int) -> None:
        """`shrink`'s rounds in kvchat's kernel (`kvchat/native/_summary.c`), a head at a
        time: the same losses, ranks, evictions and neighbour searches, in place."""
        native.summary_shrink(
            self.unit,
            self.count,
            self.mass,
            self.positions,
            self.alive,
            self.nn_sim,
            self.nn_idx,
            budget=budget,
            block=SIMILARITY_BLOCK,
            **self.objective.kernel_args(),
        )

    def _losses(self) -> np.ndarray:
        """g(i | S - i) of every live member [H, n], f_FL normalised by the weight of
        V = S; +inf for dead slots."""
        n = self.length
        alive, count = self.alive[:, :n], self.count[:, :n]  # dead slots count 0
        weight = np.maximum(count.sum(-1, keepdims=True), np.finfo(np.float64).tiny)
        diversity = count * (1 - self.nn_sim[:, :n]) / weight
        importance = self.objective.importance_loss(self.mass[:, :, :n])  # dead mass is 0
        return np.where(alive, self.objective.mix(diversity, importance, alive), np.inf)

    def _cheapest(self, excess: np.ndarray) -> np.ndarray:
        """Members [H, n] (a mask) to evict this round: in each head h, among the excess[h]
        members of least marginal (ties: the oldest), those whose nearest neighbour is not
        a cheaper one of them. Evicting a member raises the marginal of the members it was
        nearest to, so those wait for the next round's recomputed marginals; with
        excess = 1 this is Algorithm 2's single argmin. Each head takes its own count."""
        n, heads = self.length, self.heads[:, None]
        loss, age = self._losses(), self.positions[:, :n]
        # Only the `reach` cheapest of each head are ranked: a partial selection, then a
        # sort of those (a full sort of every member would be most of a round's cost). A tie
        # across the cut would make the selection arbitrary there, so then all are sorted.
        reach = int(excess.max())
        part = np.broadcast_to(np.arange(n), loss.shape)
        if reach < n:
            cut = np.argpartition(loss, (reach - 1, reach), axis=1)
            if not (loss[heads, cut[:, reach - 1 : reach]] == loss[heads, cut[:, reach : reach + 1]]).any():
                part = cut[:, :reach]
        # ascending loss, then age
        order = np.take_along_axis(part, np.lexsort((age[heads, part], loss[heads, part]), axis=-1), 1)
        rank = np.full((len(loss), n), n)
        rank[heads, order] = np.arange(order.shape[1])
        nn = self.nn_idx[:, :n]
        # Dead slots rank after every live one (marginal +inf), so they are never taken;
        # a live member's neighbour is always live.
        nn_rank = np.where(nn >= 0, rank[heads, np.maximum(nn, 0)], n)
        return (rank < excess[:, None]) & ~(nn_rank < rank)

    def _evict(self, gone: np.ndarray) -> None:
        """Mark members gone [H, n] dead; live members whose nearest neighbour left search
        again among the live ones."""
        n, heads = self.length, self.heads[:, None]
        alive = self.alive[:, :n]
        alive &= ~gone
        self.count[:, :n][gone] = 0
        self.mass[:, :, :n] *= alive[:, None, :]
        nn = self.nn_idx[:, :n]
        lost = alive & (nn >= 0) & gone[heads, np.maximum(nn, 0)]
        rows_per_head = int(lost.sum(1).max())
        if rows_per_head == 0:
            return
        # Padded products for all heads: the rows that lost their neighbour come first.
        order = np.argsort(~lost, axis=1, kind="stable")[:, :rows_per_head]
        unit, dead = self.unit[:, :n], ~alive[:, None, :]
        for first in range(0, rows_per_head, SIMILARITY_BLOCK):
            rows = order[:, first : first + SIMILARITY_BLOCK]
            valid = lost[heads, rows]
            cos = _cosines(unit[heads, rows], unit)  # [H, rows, n]
            np.copyto(cos, -np.inf, where=dead)  # only live members are neighbours
            cos[heads, np.arange(rows.shape[1]), rows] = -np.inf  # a member is not its own neighbour
            best, where = _nearest_of(cos)
            self.nn_sim[heads, rows] = np.where(valid, best, self.nn_sim[heads, rows])
            self.nn_idx[heads, rows] = np.where(valid, where, self.nn_idx[heads, rows])

    def _gather(self) -> None:
        """Move every head's live members, in slot order, to the front of the result arrays
        (every head holds the same number: the budget, or all when they fit)."""
        n, heads = self.length, self.heads[:, None]
        alive = self.alive[:, :n]
        kept = int(alive[0].sum()) if len(alive) else 0
        if kept == n:
            return
        survivors = np.argsort(~alive, axis=1, kind="stable")[:, :kept]  # [H, kept]
        new_index = np.full(alive.shape, -1, dtype=np.int64)
        new_index[heads, survivors] = np.arange(kept)
        nn = self.nn_idx[heads, survivors]
        self.nn_idx[:, :kept] = np.where(nn >= 0, new_index[heads, np.maximum(nn, 0)], -1)
        self.nn_sim[:, :kept] = self.nn_sim[heads, survivors]
        self.source[:, :kept] = self.source[heads, survivors]
        self.length = kept


@register
class BumbleBee(Compressor):
    name = "bumblebee"
    description = "BumbleBee: keeps a subset of tokens that is both diverse (keys) and important (attention)."
    hyperparameters = (
        Param(
            "lam",
            float,
            0.5,
            "λ, weight of diversity vs importance: g = λ·f_FL + (1-λ)·c",
            "the slides give none; kvchat's choice, docs/methods.md",
            low=0,
            high=1,
        ),
        Param(
            "phi",
            str,
            "power",
            "concave φ of accumulated attention, power or log (log(1+x))",
            "the slides' two variants; power is the one of their streaming LongBench run",
            choices=("power", "log"),
        ),
        Param(
            "alpha",
            float,
            0.5,
            "power φ: inverse of α·y^(1/α) + β·y",
            "kvchat's choice, docs/methods.md",
            low=0,
            high=1,
            open_low=True,
        ),
        Param(
            "beta", float, 1.0, "power φ: linear part; 1/β is φ's slope at 0", "kvchat's choice, docs/methods.md", low=0
        ),
        Param(
            "normalize",
            str,
            "none",
            "minmax scales both terms to [0, 1] over the candidates before mixing",
            "a kvchat extension, off by default",
            choices=("none", "minmax"),
        ),
        Param(
            "greedy_max",
            int,
            4096,
            "largest summary + prefill batch selected by the offline greedy "
            "(Alg. 1); larger ones stream; 0 = always stream",
            "kvchat's choice, docs/methods.md",
            low=0,
        ),
    )
    needs_attention = True

    def __init__(self, spec: LayerSpec, budget: int, **params: Any) -> None:
        super().__init__(spec, budget, **params)
        p = self.params
        if not 0 <= p["lam"] <= 1:
            raise ValueError(f"bumblebee: lam must be in [0, 1], got {p['lam']}")
        if p["phi"] not in ("log", "power"):
            raise ValueError(f"bumblebee: phi must be log or power, got {p['phi']!r}")
        if not 0 < p["alpha"] <= 1 or p["beta"] < 0:
            raise ValueError("bumblebee: power phi needs 0 < alpha <= 1 and beta >= 0")
        if p["normalize"] not in ("none", "minmax"):
            raise ValueError(f"bumblebee: normalize must be none or minmax, got {p['normalize']!r}")
        self._objective = _Objective(float(p["lam"]), p["phi"], float(p["alpha"]), float(p["beta"]), p["normalize"])
        self._generator = spec.generator("bumblebee-greedy")
        self._generator_bytes = tensor_bytes(generator_state(self._generator))
        h, g, d, dev = spec.num_kv_heads, spec.group_size, spec.head_dim, spec.device
        self._kept = _Tokens(
            keys=torch.zeros(h, 0, d, device=dev, dtype=spec.dtype),
            values=torch.zeros(h, 0, d, device=dev, dtype=spec.dtype),
            positions=torch.zeros(h, 0, dtype=torch.long, device=dev),
            log_weights=torch.zeros(h, 0, device=dev),
            scores=torch.zeros(h, g, 0, dtype=torch.float64, device=dev),
        )
        # Nearest neighbour of each kept entry within the summary (sim 0, index -1: none).
        self._nn_sim = np.zeros((h, 0), dtype=np.float32)
        self._nn_idx = np.zeros((h, 0), dtype=np.int64)

    def ingest(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        log_weights: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> None:
        h, b, _ = keys.shape
        dev = self.spec.device
        batch = _Tokens(
            keys=keys.to(dev, self.spec.dtype),
            values=values.to(dev, self.spec.dtype),
            positions=positions.to(dev, torch.long),
            log_weights=incoming_log_weights(log_weights, positions).to(dev),
            scores=(
                torch.zeros(h, self.spec.group_size, b, dtype=torch.float64, device=dev)
                if scores is None
                else scores.to(dev, torch.float64)
            ),
        )
        budget = max(self.budget, 0)
        if b > budget and self._kept.length + b <= self.params["greedy_max"]:
            # A batch that alone overflows the summary is a prefill: Algorithm 1.
            tokens = _Tokens.cat([self._kept, batch])
            pool = _Pool.of(tokens)
            self._keep(tokens, pool.positions, *self._greedy(pool, budget))
            return
        # Algorithm 2 takes one token at a time; a larger batch (the flush of a held
        # prefill) streams in pieces of STREAM_BATCH, each evicted in rounds. One piece of
        # thousands would cost a similarity product quadratic in its size. A batch of no
        # tokens still runs once: it brings the summary within a lowered budget.
        for first in range(0, max(b, 1), STREAM_BATCH):
            self._stream(batch.part(first, first + STREAM_BATCH), budget)

    def _stream(self, batch: _Tokens, budget: int) -> None:
        """S' = summary + batch, then evictions down to the budget (rounds)."""
        held = self._kept.length
        tokens = _Tokens.cat([self._kept, batch])
        pool = _Pool.of(tokens)
        work = _StreamingSummary(pool, held, self._nn_sim, self._nn_idx, self._objective)
        work.append()
        work.shrink(budget)
        self._keep(tokens, pool.positions, *work.result())

    def _greedy(self, pool: _Pool, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Algorithm 1 with V = the pool: `budget` picks of the largest gain g(A + e) - g(A),
        by stochastic greedy. Returns (pool indices [H, m], nn_sim, nn_idx) for
        m = min(budget, pool size).

        The loop works on cosines: with sim = (1 + cos)/2, a candidate's diversity gain
        sum_v count_v * max(0, sim(e, v) - cover_v) is half of sum_v count_v *
        max(cos(e, v), cover_v) - sum_v count_v * cover_v, cover_v now the best cosine of v
        to the picks (-1 before any: sim 0). The n x n cosines and the rows each step
        reads are in `_similarity_dtype` (bf16 on a bf16 layer where the CPU multiplies
        bf16 natively: a third of the product's time and half the bytes every step
        reads); the sums are float32 either way."""
        h, n = pool.positions.shape
        picked = min(budget, n)
        heads = np.arange(h)
        dtype = _similarity_dtype(self.spec.dtype)
        unit = torch.from_numpy(pool.unit).to(dtype)
        count = pool.count  # [H, n] float64
        uniform = bool((count == 1).all())  # a prefill: plain tokens, so the sums need no weights
        sample = math.ceil(n / max(budget, 1) * math.log(1 / GREEDY_EPSILON))
        if native.use("greedy"):
            picks = self._greedy_native(pool, unit, picked, sample, None if uniform else count)
            return self._picked(pool, picks)
        cosines = torch.matmul(unit, unit.transpose(1, 2)).view(h * n, n)  # row e of head k: k * n + e
        first_row = heads[:, None] * n
        count_column = None if uniform else torch.from_numpy(count.astype(np.float32))[..., None]  # [H, n, 1]

        def weighted(rows: Tensor) -> np.ndarray:
            """sum_v count_v * rows[..., v], float32: rows [H, R, n] -> [H, R]."""
            if count_column is None:
                return rows.sum(-1, dtype=torch.float32).numpy()
            return torch.matmul(rows.float(), count_column)[..., 0].numpy()

        weight = count.sum(-1, keepdims=True)  # [H, 1]: the weight of V
        cover = torch.full((h, 1, n), -1.0, dtype=dtype)
        covered = -weight  # sum_v count_v * cover_v, [H, 1]
        total = np.zeros((h, pool.mass.shape[1], 1))
        picks = np.empty((h, picked), dtype=np.int64)
        # The untaken tokens of each head are free[h, :n - step]; slot[h, e] is where token
        # e sits in it. A pick swaps the last untaken one into its slot.
        free = np.broadcast_to(np.arange(n), (h, n)).copy()
        slot = free.copy()
        for step in range(picked):
            untaken = n - step
            if sample >= untaken:
                cand = free[:, :untaken]  # every remaining token: the exact greedy step
            else:
                # `sample` uniform draws from the untaken tokens, with replacement: the
                # draws the stochastic greedy's bound counts (each uniform over V - A).
                draw = torch.rand(h, sample, generator=self._generator).numpy()
                at = np.minimum((draw * untaken).astype(np.int64), untaken - 1)
                cand = free[heads[:, None], at]  # [H, R]
            rows = cosines.index_select(0, torch.from_numpy((cand + first_row).ravel())).view(h, -1, n)
            torch.maximum(rows, cover, out=rows)  # each candidate's cover, were it picked
            reach = weighted(rows)
            # Over the weight of V (see the docstring), and halved: cosines to sims.
            diversity = (reach - covered) / (2 * weight)
            mass = pool.mass[heads[:, None], :, cand].transpose(0, 2, 1)  # [H, G, R]
            importance = self._objective.importance_gain(total, mass)
            choice = self._objective.mix(diversity, importance).argmax(-1)
            best = cand[heads, choice]
            picks[:, step] = best
            gone = slot[heads, best]
            last = free[:, untaken - 1].copy()
            free[heads, gone] = last
            slot[heads, last] = gone
            r = rows.shape[1]  # the pick's row is the new cover
            cover = rows.view(h * r, n).index_select(0, torch.from_numpy(heads * r + choice)).view(h, 1, n)
            covered = reach[heads, choice][:, None].astype(np.float64)
            total += pool.mass[heads, :, best][..., None]
        return self._picked(pool, picks)

    def _greedy_native(
        self, pool: _Pool, unit: Tensor, picked: int, sample: int, count: np.ndarray | None
    ) -> np.ndarray:
        """The loop of `_greedy` in kvchat's kernel (`kvchat/native/_greedy.c`): the same
        draws from the layer's generator (one call for every step that samples gives the
        numbers the per-step calls give), the same sums in the same precisions, one pass
        per step over its candidates' rows with the GIL released. A 4k prefill's layer:
        135 ms with the loop above, 33 ms here (about 12 of them the products), the same
        tokens kept (measured on a 2-core AMD EPYC, Zen 5).

        One head at a time, its n x n cosines written into one buffer the heads share: a
        layer's three at once would be 56 MB of fresh pages at a 4k prefill (63 ms a layer),
        and the flush runs two layers side by side."""
        h, n = pool.positions.shape
        draws = torch.rand(max(0, min(picked, n - sample)), h, sample, generator=self._generator)
        counts = None if count is None else np.ascontiguousarray(count, dtype=np.float32)
        weight = pool.count.sum(-1)
        mass = np.ascontiguousarray(pool.mass, dtype=np.float64)
        picks = np.empty((h, picked), dtype=np.int64)
        cosines = torch.empty(n, n, dtype=unit.dtype)
        objective = self._objective.kernel_args()
        for head in range(h):
            torch.matmul(unit[head], unit[head].T, out=cosines)
            native.greedy_picks(
                cosines,
                picked=picked,
                sample=sample,
                draws=draws,
                head=head,
                count=None if counts is None else counts[head],
                weight=float(weight[head]),
                mass=mass[head],
                out=picks[head],
                **objective,
            )
        return picks

    @staticmethod
    def _picked(pool: _Pool, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(picks, and their neighbours among themselves): the picks' nearest neighbours
        from float32 cosines (the streaming rule keeps them)."""
        picked = picks.shape[1]
        chosen = np.take_along_axis(pool.unit, picks[..., None], 1)
        among = _cosines(chosen, chosen)  # [H, m, m]
        among[:, np.arange(picked), np.arange(picked)] = -np.inf
        return (picks, *_nearest_of(among))

    def _keep(
        self,
        tokens: _Tokens,
        positions: np.ndarray,
        chosen: np.ndarray,
        nn_sim: np.ndarray,
        nn_idx: np.ndarray,
    ) -> None:
        """Keep tokens[chosen] ([H, m] indices; nn_idx indexes chosen) in position order,
        which is entries() order, with the neighbour cache re-indexed to match."""
        order = np.argsort(np.take_along_axis(positions, chosen, 1), axis=1, kind="stable")
        rank = np.argsort(order, axis=1)
        nn_idx = np.take_along_axis(nn_idx, order, 1)
        self._nn_sim = np.take_along_axis(nn_sim, order, 1)
        self._nn_idx = np.where(nn_idx >= 0, np.take_along_axis(rank, np.maximum(nn_idx, 0), 1), -1)
        index = torch.from_numpy(np.take_along_axis(chosen, order, 1)).to(self.spec.device)
        self._kept = tokens.take(index)

    def observe(self, mass: Tensor) -> None:
        self._kept.scores.add_(mass.to(self._kept.scores.device))

    def entries(self) -> Entries:
        k = self._kept
        return Entries(k.keys, k.values, k.positions, k.log_weights, k.log_weights.clone())

    def state_dict(self) -> StateDict:
        k = self._kept
        return {
            "keys": k.keys,
            "values": k.values,
            "positions": k.positions,
            "log_weights": k.log_weights,
            "scores": k.scores.clone(),  # [H, G, n], as observe gives it (a copy: observe adds in place)
            "nn_sim": torch.from_numpy(self._nn_sim.copy()),
            "nn_idx": torch.from_numpy(self._nn_idx.copy()),
            "generator": generator_state(self._generator),
        }

    def load_state_dict(self, state: StateDict) -> None:
        dev = self.spec.device
        self._kept = _Tokens(
            keys=state_tensor(state, "keys").to(dev),
            values=state_tensor(state, "values").to(dev),
            positions=state_tensor(state, "positions").to(dev),
            log_weights=state_tensor(state, "log_weights").to(dev),
            scores=state_tensor(state, "scores").to(dev, torch.float64, copy=True),  # observe adds in place
        )
        self._nn_sim = state_tensor(state, "nn_sim").cpu().numpy().copy()
        self._nn_idx = state_tensor(state, "nn_idx").cpu().numpy().copy()
        set_generator_state(self._generator, state_tensor(state, "generator"))

    def nbytes(self) -> int:
        # Everything state_dict holds, the greedy's generator state included (fixed size).
        k = self._kept
        held = tensor_bytes(k.keys, k.values, k.positions, k.log_weights, k.scores)
        return held + self._nn_sim.nbytes + self._nn_idx.nbytes + self._generator_bytes

    def reposition(self, fn: Repositioner) -> None:
        k = self._kept
        keys, positions = fn(k.keys, k.positions)
        # Re-rotation changes the angles between keys: the neighbour cache is rebuilt.
        unit = _unit(keys)
        everything = np.broadcast_to(np.arange(k.length), (k.positions.shape[0], k.length))
        tokens = _Tokens(keys, k.values, positions, k.log_weights, k.scores)
        self._keep(tokens, positions.cpu().numpy(), everything, *_nearest(unit, unit, 0))
