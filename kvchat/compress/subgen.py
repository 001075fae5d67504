"""`subgen`: SubGen and ClusterGen ("SubGen: Token Generation in Sublinear Time and Memory",
arXiv 2402.06082, and "ClusterGen: Token Generation in Sublinear Time and Memory with
Clustering KV Cache"; docs/methods.md has both and kvchat's departures).

Two modes of one method:

- "stream", the papers' provable Algorithm 1. The softmax denominator comes from
  an online δ-clustering of keys: each cluster keeps its first key as representative, its
  size n (tokens absorbed) and t uniform samples of its members' keys, giving entries with
  a = -inf, b = log(c·n/t). The numerator comes from s samples of tokens drawn with
  probability ∝ ||v||², giving entries with a = log(c·μ/(s·||v||²)), b = -inf, where
  μ = Σ||v||². Samples are drawn with replacement, so a token drawn c times is one entry
  with count c.
- "kcenter" (default), what the papers' experiments ran: greedy farthest-first k-center
  selection on keys (first centre = oldest token); the selected tokens are kept verbatim.
  It is the default because stream mode is not fluent at ordinary budgets on this model:
  at 25% of a 2k-token document its answers are broken text, since real keys do not
  cluster within the budget and the split numerator/denominator samples are noisy.
  Its farthest-first selection and streaming eviction live in `_kcenter.py`.

Both modes keep the middle exactly while everything ingested fits in the budget. Compression
starts at the first ingest that overflows it: in stream mode, every token held so far plus
that batch becomes the first batch of the streaming structures, which by the batch form of
the papers' updates (`_update_numerator`, `_absorb`) is distributed exactly as if they had
been streamed from the start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvchat.compress import register
from kvchat.compress._kcenter import GRAM_LIMIT, evict_closest, farthest_first, neighbours
from kvchat.compress.base import (
    Compressor,
    LayerSpec,
    Param,
    generator_state,
    incoming_log_weights,
    set_generator_state,
)
from kvchat.kv_types import Entries, Repositioner, StateDict, state_tensor, tensor_bytes

MODES = ("stream", "kcenter")
KCENTER_WEIGHTS = ("none", "size", "mean")
# Stream mode gives s at most half the budget and caps t so that this many clusters fit in
# the rest: with fewer, the denominator would degenerate into one uniform sample.
MIN_CLUSTERS = 4
# Automatic δ starts at this fraction of the median pairwise key distance (kvchat's choice:
# the papers give no δ).
DELTA_FROM_MEDIAN = 0.5
# That median is estimated on at most this many evenly spaced keys (no n × n matrix).
DELTA_PROBE = 512
# Floor on ||v||²: a zero value has no numerator weight (a guard of kvchat's).
MIN_SQ_NORM = 1e-12
# Exact distances: the matmul shortcut of cdist can misplace a key at a distance of ≈ δ.
EXACT_CDIST = "donot_use_mm_for_euclid_dist"

# Every tensor of the state, by attribute name (the state dict drops the leading "_").
_TENSORS = (
    # exact tokens: the whole middle in kcenter mode, and in stream mode until it overflows
    "_tok_keys",
    "_tok_values",
    "_tok_positions",
    "_tok_log_weights",
    # stream: numerator samples, unique tokens with counts summing to s per head
    "_num_keys",
    "_num_values",
    "_num_positions",
    "_num_counts",
    # stream: clusters (representative, its position, size; padding has size 0)
    "_rep_keys",
    "_rep_positions",
    "_sizes",
    # stream: denominator samples, unique keys with counts summing to t per cluster
    "_den_keys",
    "_den_positions",
    "_den_counts",
    "_den_owners",
    # stream: running Σ w·||v||² and cluster radius, per head (float64)
    "_mu",
    "_delta",
    # kcenter: each held token's squared distance to its nearest other held token
    # (float64) and that token's index; index -1: the distance is only a lower bound.
    # Empty when not tracked (then rebuilt from the keys at the next eviction).
    "_nn_dist",
    "_nn_partner",
)
# Optional in a snapshot: one without the neighbour state rebuilds it.
_OPTIONAL = ("_nn_dist", "_nn_partner")


@dataclass
class _Clusters:
    """One head's denominator structure while it absorbs a batch (the papers' key clusters)."""

    delta: float
    rep_keys: Tensor  # [m, d]: the key that opened each cluster, never moved
    rep_positions: Tensor  # [m]
    sizes: Tensor  # [m] float64: weight absorbed before this batch (0 for clusters it opens)
    keys: Tensor  # [L, d]: unique sampled member keys
    positions: Tensor  # [L]
    counts: Tensor  # [L] int64: multiplicities, t per cluster in all
    owners: Tensor  # [L] int64: cluster of each sample


def _binomial(counts: Tensor, probs: Tensor, gen: torch.Generator) -> Tensor:
    """Binomial(counts, probs) draws (int64), on the CPU of the layer's generator."""
    draws = torch.binomial(counts.float().cpu(), probs.float().cpu().expand(counts.shape).contiguous(), generator=gen)
    return draws.long().to(counts.device)


def _multinomial(weights: Tensor, num: int, gen: torch.Generator) -> Tensor:
    """num draws with replacement per row of weights [r, n] (or [n])."""
    return torch.multinomial(weights.float().cpu(), num, replacement=True, generator=gen).to(weights.device)


def _compact(keep: Tensor, *tensors: Tensor) -> list[Tensor]:
    """Per head (row of keep [H, n]) move the kept items to the front in their order, cut to
    the largest head's count, and zero the padding of the shorter heads."""
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
    size = int(keep.sum(1).max()) if keep.numel() else 0
    index = order[:, :size]
    valid = torch.gather(keep, 1, index)
    out = []
    for tensor in tensors:
        trailing = (1,) * (tensor.dim() - 2)
        gathered = torch.gather(tensor, 1, index.view(*index.shape, *trailing).expand(*index.shape, *tensor.shape[2:]))
        out.append(gathered.masked_fill(~valid.view(*valid.shape, *trailing), 0))
    return out


def _pad_stack(rows: list[Tensor]) -> Tensor:
    """Stack per-head tensors of different lengths into [H, longest, ...], zero-padded."""
    longest = max(row.shape[0] for row in rows)
    out = rows[0].new_zeros(len(rows), longest, *rows[0].shape[1:])
    for head, row in enumerate(rows):
        out[head, : row.shape[0]] = row
    return out


def _thin(counts: Tensor, groups: Tensor, keep: Tensor, gen: torch.Generator) -> Tensor:
    """Keep a uniformly random subset of each group's sample slots.

    counts [n] int64: multiplicities of n stored items; groups [n]: each item's group;
    keep [num_groups]: slots each group keeps (at most its current total). Slots holding
    i.i.d. draws stay i.i.d. draws when a subset is chosen independently of their values.
    Returns the new counts [n].
    """
    device = counts.device
    counts, groups, keep = counts.cpu(), groups.cpu(), keep.cpu()
    slot_items = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    shuffled = slot_items[torch.randperm(slot_items.numel(), generator=gen)]
    by_group = torch.sort(groups[shuffled], stable=True)
    rank = torch.arange(shuffled.numel()) - torch.searchsorted(by_group.values, by_group.values)
    kept = shuffled[by_group.indices][rank < keep[by_group.values]]
    return torch.bincount(kept, minlength=counts.numel()).to(device)


@register
class SubGen(Compressor):
    name = "subgen"
    description = (
        "SubGen/ClusterGen: clusters keys for the softmax sum and samples tokens by value norm"
        " (or keeps k-center tokens)."
    )
    # The class may hold split entries (stream mode); each instance says whether it does.
    split_weights = True
    hyperparameters = (
        Param(
            "mode",
            str,
            "kcenter",
            "kcenter: greedy k-center tokens, what the papers' experiments ran; "
            "stream: the papers' provable streaming algorithm (key clusters + value-norm samples), not fluent "
            "at ordinary budgets on the embedded model",
            "what the papers' experiments ran; docs/methods.md",
            choices=("kcenter", "stream"),
        ),
        Param(
            "delta",
            float,
            None,
            "stream: cluster radius (L2 on post-RoPE keys); automatic = 0.5 × the "
            "median key distance of the first compressed batch, doubled when clusters outgrow the budget",
            "kvchat's choice, docs/methods.md",
            low=0,
            open_low=True,
            optional=True,
            default_text="automatic",
        ),
        Param(
            "value_samples",
            int,
            256,
            "stream: s, numerator samples drawn ∝ ‖v‖², at most half the budget",
            "kvchat's choice, docs/methods.md",
            low=1,
        ),
        Param(
            "key_samples",
            int,
            16,
            "stream: t, key samples per cluster, capped so at least 4 clusters fit",
            "kvchat's choice, docs/methods.md",
            low=1,
        ),
        Param(
            "kcenter_weights",
            str,
            "none",
            "kcenter: none keeps centres as plain tokens; size weights each "
            "by the tokens nearest to it; mean also gives it their mean value",
            "none is the papers'",
            choices=("none", "size", "mean"),
        ),
    )

    # The tensors of _TENSORS, set by `_clear` and `load_state_dict` (declared for the type checker).
    _tok_keys: Tensor
    _tok_values: Tensor
    _tok_positions: Tensor
    _tok_log_weights: Tensor
    _num_keys: Tensor
    _num_values: Tensor
    _num_positions: Tensor
    _num_counts: Tensor
    _rep_keys: Tensor
    _rep_positions: Tensor
    _sizes: Tensor
    _den_keys: Tensor
    _den_positions: Tensor
    _den_counts: Tensor
    _den_owners: Tensor
    _mu: Tensor
    _delta: Tensor
    _nn_dist: Tensor
    _nn_partner: Tensor

    def __init__(self, spec: LayerSpec, budget: int, **params: Any) -> None:
        super().__init__(spec, budget, **params)
        p = self.params
        if p["mode"] not in MODES:
            raise ValueError(f"subgen: mode must be one of {MODES}, not {p['mode']!r}")
        if p["kcenter_weights"] not in KCENTER_WEIGHTS:
            raise ValueError(f"subgen: kcenter_weights must be one of {KCENTER_WEIGHTS}")
        if p["delta"] is not None and not p["delta"] > 0:
            raise ValueError("subgen: delta must be positive (or None for automatic)")
        if p["value_samples"] < 1 or p["key_samples"] < 1:
            raise ValueError("subgen: value_samples and key_samples must be at least 1")
        # Only stream mode has a != b (numerator-only and denominator-only samples). Every
        # kcenter entry is a kept token with one weight, a = b (0, or its incoming weight,
        # or log(group size) with kcenter_weights size/mean), so the cache may take its
        # one-sum fused attention path, which is exact for it (the cache reads this per
        # instance: CompressedLayer.attend).
        self.split_weights = p["mode"] == "stream"
        self._gen = spec.generator("subgen")
        self._clear()

    # ---------------------------------------------------------------- ingestion

    def ingest(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        log_weights: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> None:
        log_weights = incoming_log_weights(log_weights, positions)
        if not bool(torch.isfinite(keys).all()):
            # Distances to a NaN key are NaN: no radius would ever take it in, and the
            # δ-doubling would never end.
            raise ValueError(
                f"subgen: the model produced non-finite keys (layer {self.spec.layer}); they cannot be clustered"
            )
        if self.params["mode"] == "kcenter":
            self._ingest_kcenter(keys, values, positions, log_weights)
        else:
            self._ingest_stream(keys, values, positions, log_weights)

    def _append_tokens(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights: Tensor) -> None:
        self._tok_keys = torch.cat([self._tok_keys, keys], 1)
        self._tok_values = torch.cat([self._tok_values, values], 1)
        self._tok_positions = torch.cat([self._tok_positions, positions], 1)
        self._tok_log_weights = torch.cat([self._tok_log_weights, log_weights], 1)

    def _ingest_kcenter(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights: Tensor) -> None:
        # The papers compress once with farthest-first. Streaming keeps the centres
        # and, when a batch overflows the budget, evicts the surplus one entry at a time: the
        # younger of the closest kept pair (the removal dual of farthest-first, which keeps
        # the set as spread out as possible). Each kept entry's nearest neighbour is carried
        # from batch to batch, so a batch costs its own distances to the held entries and
        # `surplus` heap steps instead of rerunning `budget` farthest-first steps from
        # scratch. A large surplus (the first compression after a prefill) still runs
        # farthest-first.
        known = self._tok_keys.shape[1] if self._nn_partner.shape[1] == self._tok_keys.shape[1] else 0
        self._append_tokens(keys, values, positions, log_weights)
        held = self._tok_keys.shape[1]
        if held <= self.budget:
            self._forget_neighbours()
            return
        if self.budget == 0:
            self._clear()
            return
        surplus = held - self.budget
        heads = self._tok_keys.shape[0]
        weighting = self.params["kcenter_weights"]
        from_scratch = surplus >= self.budget or heads * held * held > GRAM_LIMIT
        if from_scratch:
            chosen, owner = farthest_first(self._tok_keys, self.budget, track_owner=weighting != "none")
            self._forget_neighbours()
        else:
            chosen, owner, self._nn_dist, self._nn_partner = evict_closest(
                self._tok_keys, surplus, weighting != "none", known, self._nn_dist, self._nn_partner
            )
        held_log_weights, held_values = self._tok_log_weights, self._tok_values
        # One index_select over the flattened heads: a gather with an index expanded over
        # the head dimension costs about 20x more on the CPU.
        flat = (chosen + torch.arange(heads, device=chosen.device).unsqueeze(1) * held).flatten()

        def take(tensor: Tensor) -> Tensor:
            return (
                tensor.reshape(heads * held, *tensor.shape[2:]).index_select(0, flat).view(heads, -1, *tensor.shape[2:])
            )

        self._tok_keys, self._tok_values = take(self._tok_keys), take(held_values)
        self._tok_positions, self._tok_log_weights = take(self._tok_positions), take(held_log_weights)
        if from_scratch and self.budget * self.budget * heads <= GRAM_LIMIT:
            # The centres' neighbours now, while compressing the document (time to first
            # token), rather than at the first decode step's batch.
            points = self._tok_keys.detach().to("cpu", torch.float64)
            none = points[:, :0, 0]  # no carried state: every entry is compared with all
            near, partner, _ = neighbours(points, (points * points).sum(-1), 0, none, none.long())
            self._nn_dist = torch.from_numpy(near).to(self.spec.device)
            self._nn_partner = torch.from_numpy(partner).to(self.spec.device)
        if owner is None:
            return
        # Every held token joins its nearest centre: a = b = log(total weight of the group),
        # summed with a max-shift since weights are logs.
        peak = torch.full(chosen.shape, -math.inf, device=chosen.device)
        peak = peak.scatter_reduce(1, owner, held_log_weights, "amax")
        scaled = torch.exp(held_log_weights - torch.gather(peak, 1, owner))
        mass = torch.zeros(chosen.shape, device=chosen.device).scatter_add(1, owner, scaled)
        self._tok_log_weights = peak + mass.log()
        if weighting == "mean":
            members = owner.unsqueeze(2).expand_as(held_values)
            summed = torch.zeros(self._tok_values.shape, device=chosen.device).scatter_add(
                1, members, scaled.unsqueeze(2) * held_values.float()
            )
            self._tok_values = (summed / mass.unsqueeze(2)).to(held_values.dtype)

    def _ingest_stream(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights: Tensor) -> None:
        if self.budget < 2:
            # No room for one numerator and one denominator sample: the middle is dropped
            # and later tokens start afresh.
            self._clear()
            return
        if not self._sampling:
            self._append_tokens(keys, values, positions, log_weights)
            if self._tok_keys.shape[1] <= self.budget:
                return
            keys, values = self._tok_keys, self._tok_values
            positions, log_weights = self._tok_positions, self._tok_log_weights
            self._start_sampling(keys)
        else:
            self._fit_slots_to_budget()
        weights = log_weights.double().exp()  # an entry with log-weight w stands for e^w tokens
        self._update_numerator(keys, values, positions, weights)
        self._update_clusters(keys, positions, weights)

    def _slot_caps(self) -> tuple[int, int]:
        """s and t for the current budget (s + m·t ≤ budget with m ≥ MIN_CLUSTERS where
        possible); the parameters are upper bounds."""
        s = min(self.params["value_samples"], self.budget // 2)
        t = min(self.params["key_samples"], max(1, (self.budget - s) // MIN_CLUSTERS))
        return s, t

    def _start_sampling(self, first_keys: Tensor) -> None:
        heads, device = self.spec.num_kv_heads, first_keys.device
        self._sampling = True
        self._slots, self._cluster_slots = self._slot_caps()
        self._tok_keys, self._tok_values, self._tok_positions, self._tok_log_weights = self._empty_tokens()
        if self.params["delta"] is not None:
            self._delta = torch.full((heads,), float(self.params["delta"]), dtype=torch.float64, device=device)
            return
        count = first_keys.shape[1]
        probe = torch.linspace(0, count - 1, min(count, DELTA_PROBE), device=device).round().long().unique()
        medians = [torch.pdist(first_keys[h, probe].float()).median().double() for h in range(heads)]
        # Never 0 (identical keys), so that doubling can always grow it.
        self._delta = (DELTA_FROM_MEDIAN * torch.stack(medians)).clamp_min(1e-6)

    def _fit_slots_to_budget(self) -> None:
        """Follow a changed budget. A lower one keeps a random subset of the slots (still
        i.i.d. draws). A higher one adds copies of randomly chosen slots: fresh draws would
        need the tokens that are gone, and a copy of a random slot has the same marginal
        distribution, so the estimators stay unbiased; the copies are merely correlated
        until the reservoir replaces them."""
        s, t = self._slot_caps()
        heads, device = self.spec.num_kv_heads, self._num_counts.device
        if s != self._slots:
            if s < self._slots:
                groups = torch.arange(heads, device=device).unsqueeze(1).expand_as(self._num_counts).reshape(-1)
                counts = _thin(self._num_counts.reshape(-1), groups, torch.full((heads,), s, device=device), self._gen)
                counts = counts.view(heads, -1)
            else:
                copies = _multinomial(self._num_counts, s - self._slots, self._gen)
                counts = self._num_counts.scatter_add(1, copies, torch.ones_like(copies))
            self._num_keys, self._num_values, self._num_positions, self._num_counts = _compact(
                counts > 0, self._num_keys, self._num_values, self._num_positions, counts
            )
            self._slots = s
        if t != self._cluster_slots:
            clusters = self._sizes.shape[1]
            if t < self._cluster_slots:
                groups = (self._den_owners + clusters * torch.arange(heads, device=device).unsqueeze(1)).reshape(-1)
                keep = torch.full((heads * clusters,), t, device=device)
                counts = _thin(self._den_counts.reshape(-1), groups, keep, self._gen).view(heads, -1)
            else:
                # One row per (head, cluster) over that head's samples, weighted by count.
                owned = self._den_owners.unsqueeze(1) == torch.arange(clusters, device=device).view(1, -1, 1)
                rows = (owned * self._den_counts.unsqueeze(1)).flatten(0, 1)[self._sizes.flatten() > 0]
                row_heads = torch.arange(heads, device=device).repeat_interleave(clusters)[self._sizes.flatten() > 0]
                copies = _multinomial(rows, t - self._cluster_slots, self._gen)
                counts = self._den_counts.index_put(
                    (row_heads.unsqueeze(1).expand_as(copies), copies), torch.ones_like(copies), accumulate=True
                )
            self._den_keys, self._den_positions, self._den_counts, self._den_owners = _compact(
                counts > 0, self._den_keys, self._den_positions, counts, self._den_owners
            )
            self._cluster_slots = t

    def _update_numerator(self, keys: Tensor, values: Tensor, positions: Tensor, weights: Tensor) -> None:
        """Batch reservoir step of the numerator samples on the s slots, for all heads at
        once: each slot is replaced with probability W/(μ + W) (W = the batch's Σ w·||v||²,
        μ taken before the batch) by a batch token drawn ∝ w·||v||²."""
        heads, batch = weights.shape
        mass = weights * values.double().pow(2).sum(-1).clamp_min(MIN_SQ_NORM)
        batch_mass = mass.sum(1)
        replace = batch_mass / (self._mu + batch_mass)
        survived = self._num_counts - _binomial(self._num_counts, replace.unsqueeze(1), self._gen)
        redraw = self._slots - survived.sum(1)
        new_counts = torch.zeros(heads, batch, dtype=torch.long, device=keys.device)
        most = int(redraw.max())
        if most > 0:
            draws = _multinomial(mass / batch_mass.unsqueeze(1), most, self._gen)
            taken = torch.arange(most, device=keys.device) < redraw.unsqueeze(1)
            new_counts.scatter_add_(1, draws, taken.long())
        counts = torch.cat([survived, new_counts], 1)
        self._num_keys, self._num_values, self._num_positions, self._num_counts = _compact(
            counts > 0,
            torch.cat([self._num_keys, keys], 1),
            torch.cat([self._num_values, values], 1),
            torch.cat([self._num_positions, positions], 1),
            counts,
        )
        self._mu = self._mu + batch_mass

    def _update_clusters(self, keys: Tensor, positions: Tensor, weights: Tensor) -> None:
        """Denominator step of the papers' update, head by head: clustering is sequential
        and each head has its own δ and clusters."""
        max_clusters = (self.budget - self._slots) // self._cluster_slots
        heads = []
        for h in range(self.spec.num_kv_heads):
            clusters = self._head_clusters(h)
            assignment = self._assign(clusters, keys[h], positions[h], max_clusters)
            self._absorb(clusters, keys[h], positions[h], weights[h], assignment)
            heads.append(clusters)
        self._delta = torch.tensor([c.delta for c in heads], dtype=torch.float64, device=keys.device)
        self._rep_keys = _pad_stack([c.rep_keys for c in heads])
        self._rep_positions = _pad_stack([c.rep_positions for c in heads])
        self._sizes = _pad_stack([c.sizes for c in heads])
        self._den_keys = _pad_stack([c.keys for c in heads])
        self._den_positions = _pad_stack([c.positions for c in heads])
        self._den_counts = _pad_stack([c.counts for c in heads])
        self._den_owners = _pad_stack([c.owners for c in heads])

    def _head_clusters(self, h: int) -> _Clusters:
        clusters = int((self._sizes[h] > 0).sum())  # valid clusters and samples are prefixes
        samples = int((self._den_counts[h] > 0).sum())
        return _Clusters(
            delta=float(self._delta[h]),
            rep_keys=self._rep_keys[h, :clusters],
            rep_positions=self._rep_positions[h, :clusters],
            sizes=self._sizes[h, :clusters],
            keys=self._den_keys[h, :samples],
            positions=self._den_positions[h, :samples],
            counts=self._den_counts[h, :samples],
            owners=self._den_owners[h, :samples],
        )

    def _assign(self, clusters: _Clusters, keys: Tensor, positions: Tensor, max_clusters: int) -> Tensor:
        """Cluster index of every key of the batch [b], opening clusters as needed.

        A parallel nearest-representative pass, then leader clustering of the keys left
        farther than δ from every representative: the first such key opens a cluster that
        takes every remaining key within δ of it, until none is left. Joining any
        representative within δ keeps Lemma 2's invariants. When the clusters would exceed
        `max_clusters`, δ grows and close clusters merge.
        """
        points = keys.float()
        assignment = torch.full((keys.shape[0],), -1, dtype=torch.long, device=keys.device)
        pending = torch.arange(keys.shape[0], device=keys.device)
        while clusters.rep_keys.shape[0] > max_clusters:  # the budget was lowered
            self._grow_delta(clusters)
        while True:
            if pending.numel() and clusters.rep_keys.shape[0]:
                dist = torch.cdist(points[pending], clusters.rep_keys.float(), compute_mode=EXACT_CDIST)
                nearest, index = dist.min(1)
                near = nearest <= clusters.delta
                assignment[pending[near]] = index[near]
                pending = pending[~near]
            while pending.numel() and clusters.rep_keys.shape[0] < max_clusters:
                leader = pending[0]
                new_index = clusters.rep_keys.shape[0]
                clusters.rep_keys = torch.cat([clusters.rep_keys, keys[leader, None]])
                clusters.rep_positions = torch.cat([clusters.rep_positions, positions[leader, None]])
                clusters.sizes = torch.cat([clusters.sizes, clusters.sizes.new_zeros(1)])
                joins = (points[pending] - points[leader]).norm(dim=1) <= clusters.delta
                assignment[pending[joins]] = new_index
                pending = pending[~joins]
            if not pending.numel():
                return assignment
            mapping = self._grow_delta(clusters)
            assignment = torch.where(assignment >= 0, mapping[assignment.clamp_min(0)], assignment)

    def _grow_delta(self, clusters: _Clusters) -> Tensor:
        """Double δ (at least up to the closest pair of representatives, so that something
        merges) and merge clusters whose representatives are within the new δ: each
        surviving (older) representative absorbs the younger ones near it, so survivors
        stay pairwise farther than δ apart. Members then lie within 2·δ of their
        representative rather than δ (a geometric sum over the doublings), the usual price
        of doubling. A merged cluster's t
        slots come from each part with probability proportional to its size, which keeps
        them i.i.d. uniform samples of the union. Returns old -> new cluster index."""
        count = clusters.rep_keys.shape[0]
        device = clusters.rep_keys.device
        reps = clusters.rep_keys.float()
        gaps = torch.cdist(reps, reps, compute_mode=EXACT_CDIST)
        if count > 1:
            closest = float(gaps.masked_fill(torch.eye(count, dtype=torch.bool, device=device), math.inf).min())
            clusters.delta = max(2 * clusters.delta, closest)
        else:
            clusters.delta *= 2
        index = torch.arange(count, device=device)
        parent = index.clone()
        for i in range(count):
            if parent[i] != i:
                continue
            absorbed = (gaps[i] <= clusters.delta) & (parent == index) & (index > i)
            parent[absorbed] = i
        survivors = parent == index
        mapping = (survivors.cumsum(0) - 1)[parent]
        slots = self._cluster_slots
        keep = torch.full((count,), slots, device=device)
        mixed = False
        for root in survivors.nonzero().flatten():
            sources = ((parent == root) & (clusters.sizes > 0)).nonzero().flatten()
            if sources.numel() > 1:
                picks = _multinomial(clusters.sizes[sources], slots, self._gen)
                keep[sources] = torch.bincount(picks, minlength=sources.numel())
                mixed = True
        if mixed:
            clusters.counts = _thin(clusters.counts, clusters.owners, keep, self._gen)
            kept = clusters.counts > 0
            clusters.keys, clusters.positions = clusters.keys[kept], clusters.positions[kept]
            clusters.counts, clusters.owners = clusters.counts[kept], clusters.owners[kept]
        clusters.owners = mapping[clusters.owners]
        clusters.sizes = clusters.sizes.new_zeros(int(survivors.sum())).index_add_(0, mapping, clusters.sizes)
        clusters.rep_keys = clusters.rep_keys[survivors]
        clusters.rep_positions = clusters.rep_positions[survivors]
        return mapping

    def _absorb(
        self, clusters: _Clusters, keys: Tensor, positions: Tensor, weights: Tensor, assignment: Tensor
    ) -> None:
        """Batch reservoir step of the key samples on every cluster: a cluster gaining
        weight W (size n before the batch) replaces each slot with probability W/(n + W) by
        one of its new members drawn ∝ weight. A cluster opened by this batch (n = 0) draws
        all t slots."""
        slots = self._cluster_slots
        count = clusters.rep_keys.shape[0]
        device = keys.device
        incoming = weights.new_zeros(count).index_add_(0, assignment, weights)
        replace = incoming / (clusters.sizes + incoming)
        survived = clusters.counts - _binomial(clusters.counts, replace[clusters.owners], self._gen)
        redraw = slots - survived.new_zeros(count).index_add_(0, clusters.owners, survived)
        active = (redraw > 0).nonzero().flatten()
        new_counts = torch.zeros(keys.shape[0], dtype=torch.long, device=device)
        if active.numel():
            # Row per cluster with slots to fill, over the batch: only its own members weigh.
            member_weights = (assignment.unsqueeze(0) == active.unsqueeze(1)) * weights.unsqueeze(0)
            most = int(redraw.max())
            draws = _multinomial(member_weights, most, self._gen)
            taken = torch.arange(most, device=device) < redraw[active].unsqueeze(1)
            new_counts.index_add_(0, draws[taken], torch.ones_like(draws[taken]))
        counts = torch.cat([survived, new_counts])
        kept = counts > 0
        clusters.keys = torch.cat([clusters.keys, keys])[kept]
        clusters.positions = torch.cat([clusters.positions, positions])[kept]
        clusters.owners = torch.cat([clusters.owners, assignment])[kept]
        clusters.counts = counts[kept]
        clusters.sizes = clusters.sizes + incoming

    # ---------------------------------------------------------------- reading

    def entries(self) -> Entries:
        if not self._sampling:
            w = self._tok_log_weights
            return Entries(self._tok_keys, self._tok_values, self._tok_positions, w, w.clone())
        # Numerator samples (the papers' estimator): a = log c + log(μ/s) - log||v||², b = -inf.
        sq_norms = self._num_values.double().pow(2).sum(-1).clamp_min(MIN_SQ_NORM)
        log_num = self._num_counts.double().log() + (self._mu / self._slots).log().unsqueeze(1) - sq_norms.log()
        # Denominator samples: a = -inf, b = log c + log n_cluster - log t; value unused.
        sizes = torch.gather(self._sizes, 1, self._den_owners)
        log_den = self._den_counts.double().log() + sizes.log() - math.log(self._cluster_slots)
        num_inf = torch.full(log_num.shape, -math.inf, device=log_num.device)
        den_inf = torch.full(log_den.shape, -math.inf, device=log_den.device)
        return Entries(
            keys=torch.cat([self._num_keys, self._den_keys], 1),
            values=torch.cat([self._num_values, torch.zeros_like(self._den_keys)], 1),
            positions=torch.cat([self._num_positions, self._den_positions], 1),
            log_num=torch.cat([log_num.float(), den_inf], 1),
            log_den=torch.cat([num_inf, log_den.float()], 1),
        )

    def tokens(self) -> Entries | None:
        """Held tokens are real (exact, or k-center tokens with their weights); the stream
        mode's samples are not: numerator samples carry numerator weights only and the
        denominator samples keep no values (they would enter another method as
        zero-value tokens at full count). Once sampling, a switch must rebuild."""
        if self._sampling:
            return None
        return super().tokens()

    # ---------------------------------------------------------------- state

    def _empty_tokens(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        spec = self.spec
        empty = Entries.empty(spec.num_kv_heads, spec.head_dim, spec.device, spec.dtype)
        return empty.keys, empty.values, empty.positions, empty.log_num

    def _clear(self) -> None:
        heads, device = self.spec.num_kv_heads, self.spec.device
        self._sampling = False
        self._slots = 0  # s in use, once sampling
        self._cluster_slots = 0  # t in use, once sampling
        self._tok_keys, self._tok_values, self._tok_positions, self._tok_log_weights = self._empty_tokens()
        self._num_keys, self._num_values, self._num_positions, _ = self._empty_tokens()
        self._rep_keys, _, self._rep_positions, _ = self._empty_tokens()
        self._den_keys, _, self._den_positions, _ = self._empty_tokens()
        self._num_counts = torch.zeros(heads, 0, dtype=torch.long, device=device)
        self._den_counts = torch.zeros(heads, 0, dtype=torch.long, device=device)
        self._den_owners = torch.zeros(heads, 0, dtype=torch.long, device=device)
        self._sizes = torch.zeros(heads, 0, dtype=torch.float64, device=device)
        self._mu = torch.zeros(heads, dtype=torch.float64, device=device)
        self._delta = torch.zeros(heads, dtype=torch.float64, device=device)
        self._forget_neighbours()

    def _forget_neighbours(self) -> None:
        """Drop the kcenter neighbour state (keys changed, or no eviction needs it yet)."""
        heads, device = self.spec.num_kv_heads, self.spec.device
        self._nn_dist = torch.zeros(heads, 0, dtype=torch.float64, device=device)
        self._nn_partner = torch.zeros(heads, 0, dtype=torch.long, device=device)

    def state_dict(self) -> StateDict:
        state: StateDict = {name[1:]: getattr(self, name) for name in _TENSORS}
        state.update(
            sampling=self._sampling,
            slots=self._slots,
            cluster_slots=self._cluster_slots,
            rng=generator_state(self._gen),
        )
        return state

    def load_state_dict(self, state: StateDict) -> None:
        self._forget_neighbours()
        for name in _TENSORS:
            if name in _OPTIONAL and name[1:] not in state:
                continue
            setattr(self, name, state_tensor(state, name[1:]).to(self.spec.device))
        self._sampling = bool(state["sampling"])
        self._slots = int(state["slots"])
        self._cluster_slots = int(state["cluster_slots"])
        set_generator_state(self._gen, state_tensor(state, "rng"))

    def nbytes(self) -> int:
        """Bytes of the cache state (the generator's state is not cache memory)."""
        return tensor_bytes(*(getattr(self, name) for name in _TENSORS))

    def reposition(self, fn: Repositioner) -> None:
        self._tok_keys, self._tok_positions = fn(self._tok_keys, self._tok_positions)
        self._num_keys, self._num_positions = fn(self._num_keys, self._num_positions)
        self._rep_keys, self._rep_positions = fn(self._rep_keys, self._rep_positions)
        self._den_keys, self._den_positions = fn(self._den_keys, self._den_positions)
        self._forget_neighbours()  # re-rotation changes the distances between keys
