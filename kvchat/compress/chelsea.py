"""`chelsea`: online KV clustering by Chunked Soft Matching (Chelsea: "Efficient Long-Context
LLM Inference via KV Cache Clustering", Hu et al., arXiv 2506.11418; docs/methods.md).

Each KV head keeps an ordered list of entries (key, value, position, degree N = number
of tokens the entry stands for). When the middle outgrows the budget, CSM steps run
until it is back on target: the middle is cut into chunks of `chunk` entries, each chunk
alternates its entries into sets A and B, every A entry points at its most cosine-similar
B entry of the same chunk, and the E best edges over all chunks are merged into their B
entry with degree-weighted means of key and value. Attention reads a = b = log N (the
proportional attention of "Token Merging: Your ViT But Faster", arXiv 2210.09461: a
centroid of degree N counts as N identical tokens).

Outlier heads (the paper's Appendix B; found offline by `outlier_fraction` and
`select_outlier_heads`, see `Chelsea.calibrate`) are not clustered. The paper keeps them
at full cache and lowers the other heads' budgets so that the total matches; kvchat's
budget is a hard per-head cap in an unbounded chat, so by default
(`outlier_cache=recent`) an outlier head keeps its most recent `budget` entries exactly,
and `outlier_cache=full` keeps every token (the paper's choice, over budget: more KV
bytes than the other methods).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kvchat.compress import register
from kvchat.compress.base import NEG_INF, Compressor, LayerSpec, Param, incoming_log_weights
from kvchat.kv_types import Entries, Repositioner, StateDict, state_tensor, tensor_bytes


def compression_ratio(step: int, r_init: float, r_step: float, r_steps: int, r_min: float) -> float:
    """Share of the middle one CSM step removes (Appendix C.2): r_init - r_step*min(r_steps, step),
    clamped to r_min because the paper forces r > 0."""
    return max(r_init - r_step * min(r_steps, step), r_min)


def _best_partners(keys: Tensor, lengths: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """The A -> B edges of Chunked Soft Matching, for all heads and chunks at once.

    keys: [H, n, d] left-aligned entries, n a multiple of `chunk`; lengths: [H] valid
    entries per head. Inside each chunk, even local indices form A and odd ones B.
    Returns, per A slot (chunk-major): score [H, m] (best cosine to a B of the same chunk;
    -inf where the A slot is padding or its chunk has no valid B), source [m] (global
    index of the A slot, shared by all heads) and partner [H, m] (global index of its B).
    """
    h, n, d = keys.shape
    chunks = n // chunk
    unit = keys.float()
    unit = unit / unit.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    unit = unit.view(h, chunks, chunk, d)
    starts = torch.arange(chunks, device=keys.device)[:, None] * chunk
    a_index = starts + torch.arange(0, chunk, 2, device=keys.device)  # [chunks, |A|]
    b_index = starts + torch.arange(1, chunk, 2, device=keys.device)  # [chunks, |B|]
    cosine = torch.matmul(unit[:, :, 0::2], unit[:, :, 1::2].transpose(-1, -2))  # [H, chunks, |A|, |B|]
    b_valid = b_index[None] < lengths[:, None, None]  # [H, chunks, |B|]
    cosine = cosine.masked_fill(~b_valid[:, :, None, :], NEG_INF)
    score, best = cosine.max(dim=-1)  # [H, chunks, |A|]
    a_valid = a_index[None] < lengths[:, None, None]
    score = score.masked_fill(~a_valid, NEG_INF)
    partner = starts + 1 + 2 * best  # local B slot j sits at local index 2j + 1
    return score.reshape(h, -1), a_index.reshape(-1), partner.reshape(h, -1)


def outlier_fraction(keys: Tensor, chunk: int = 256, threshold: float = 0.8) -> Tensor:
    """Per head, the share of A tokens whose best cosine to a B token of their chunk is
    below `threshold` (Appendix B's calibration statistic): high means the head's keys do
    not cluster. keys: [H, n, d] exact tokens; returns [H] float32. A tokens of a trailing
    chunk without any B token have no edge to judge and are left out."""
    h, n, _ = keys.shape
    padded_n = math.ceil(n / chunk) * chunk
    padded = torch.nn.functional.pad(keys, (0, 0, 0, padded_n - n))
    lengths = torch.full((h,), n, device=keys.device)
    score, _, _ = _best_partners(padded, lengths, chunk)
    has_edge = torch.isfinite(score)
    weak = has_edge & (score < threshold)
    return (weak.sum(1) / has_edge.sum(1).clamp_min(1)).float()


def select_outlier_heads(fractions: dict[int, Tensor], share: float = 0.04) -> dict[int, list[int]]:
    """The top `share` of all (layer, KV head) pairs by `outlier_fraction` (the paper keeps
    4% of heads out of clustering). Returns every layer of `fractions`, with its outlier
    heads sorted (often none). Ties go to the earlier layer and head."""
    pairs = [(layer, head) for layer in sorted(fractions) for head in range(len(fractions[layer]))]
    values = torch.cat([fractions[layer].float().cpu() for layer in sorted(fractions)])
    count = round(share * len(pairs))
    chosen = torch.argsort(values, descending=True, stable=True)[:count].tolist()
    result: dict[int, list[int]] = {layer: [] for layer in fractions}
    for index in chosen:
        layer, head = pairs[index]
        result[layer].append(head)
    return {layer: sorted(heads) for layer, heads in result.items()}


def _parse_heads(text: str, num_heads: int) -> list[int]:
    heads = sorted({int(part) for part in str(text).split(",") if part.strip()})
    if any(not 0 <= head < num_heads for head in heads):
        raise ValueError(f"chelsea: outlier_heads {text!r} must name KV heads in 0..{num_heads - 1}")
    return heads


@register
class Chelsea(Compressor):
    name = "chelsea"
    description = "Chelsea: merges look-alike neighbouring tokens into weighted clusters (chunked soft matching)."
    hyperparameters = (
        Param(
            "g",
            int,
            64,
            "clustering runs about once per g new tokens; smaller ingest batches get that much room under the budget",
            "the paper gives none; kvchat's choice, docs/methods.md",
            low=1,
        ),
        Param(
            "chunk",
            int,
            256,
            "entries per chunk; matches are searched inside a chunk only",
            "the paper's default",
            low=2,
        ),
        Param(
            "r_init",
            float,
            0.35,
            "share of the middle the first clustering step removes",
            "the paper's Llama-3.1 value, Appendix C.2",
            low=0,
            high=0.5,
            open_low=True,
        ),
        Param("r_step", float, 0.1, "decrease of that share per clustering step", "the paper's Llama-3.1 value"),
        Param("r_steps", int, 2, "steps over which the share decreases", "the paper's Llama-3.1 value"),
        Param(
            "r_min",
            float,
            0.05,
            "floor of the share (the paper only asks for > 0)",
            "kvchat's choice, docs/methods.md",
            low=0,
            high=0.5,
            open_low=True,
        ),
        Param(
            "outlier_heads",
            str,
            "",
            "comma-separated KV heads kept out of clustering; by default the 4% "
            "most outlying heads, calibrated once per model on the standard library's documentation text and "
            "cached in the models folder (shipped with kvchat for the embedded model)",
            "the paper calibrates 4% of heads",
            default_text="calibrated",
        ),
        Param(
            "outlier_cache",
            str,
            "recent",
            "recent: an outlier head keeps its newest tokens exactly, within "
            "the budget; full: it keeps every token, as in the paper (exceeds the budget)",
            "kvchat's choice within a fixed budget; docs/methods.md",
            choices=("recent", "full"),
        ),
    )

    def __init__(self, spec: LayerSpec, budget: int, **params: Any) -> None:
        super().__init__(spec, budget, **params)
        self.g = int(self.params["g"])
        self.chunk = int(self.params["chunk"])
        self.r_init = float(self.params["r_init"])
        self.r_step = float(self.params["r_step"])
        self.r_steps = int(self.params["r_steps"])
        self.r_min = float(self.params["r_min"])
        if self.g < 1 or self.chunk < 2:
            raise ValueError("chelsea: g must be >= 1 and chunk >= 2 (a chunk needs an A and a B entry)")
        if not 0 < self.r_min <= self.r_init <= 0.5:
            raise ValueError("chelsea: need 0 < r_min <= r_init <= 0.5 (one step merges at most half)")
        h = spec.num_kv_heads
        self.outlier_heads = _parse_heads(self.params["outlier_heads"], h)
        self.outlier_cache = str(self.params["outlier_cache"])
        if self.outlier_cache not in ("recent", "full"):
            raise ValueError(f"chelsea: outlier_cache must be recent or full, got {self.outlier_cache!r}")
        self._outlier = torch.zeros(h, dtype=torch.bool, device=spec.device)
        self._outlier[self.outlier_heads] = True
        empty = Entries.empty(h, spec.head_dim, spec.device, spec.dtype)
        self._keys = empty.keys
        self._values = empty.values
        self._positions = empty.positions
        self._log_degree = empty.log_num  # log N per entry; -inf marks padding of shorter heads
        # CSM steps run so far per head, over the session: the r schedule's step index.
        self._steps = torch.zeros(h, dtype=torch.long)

    # ------------------------------------------------------------------ calibration

    @classmethod
    def calibrate(cls, keys: dict[int, list[Tensor]]) -> dict[int, dict[str, Any]]:
        """Per-layer parameters from exact keys of calibration text ({layer: [[H, n, d]
        per sample]}): the 4% of (layer, KV head) pairs whose keys cluster worst become
        `outlier_heads` (Appendix B). The engine runs this once per model and caches it."""
        chunk = int(cls.defaults["chunk"])
        fractions = {
            layer: torch.stack([outlier_fraction(k.float(), chunk) for k in samples]).mean(0)
            for layer, samples in keys.items()
        }
        heads = select_outlier_heads(fractions)
        return {layer: {"outlier_heads": ",".join(map(str, heads[layer]))} for layer in heads}

    # ------------------------------------------------------------------ public interface

    def ingest(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        log_weights: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> None:
        weights = incoming_log_weights(log_weights, positions)
        self._keys = torch.cat([self._keys, keys.to(self.spec.dtype)], dim=1)
        self._values = torch.cat([self._values, values.to(self.spec.dtype)], dim=1)
        self._positions = torch.cat([self._positions, positions.long()], dim=1)
        self._log_degree = torch.cat([self._log_degree, weights], dim=1)
        # An entry of weight 0 (w = -inf, padding re-streamed from a ragged method) stands
        # for no token: not storing it keeps the degrees summing to the tokens absorbed.
        keep = torch.isfinite(self._log_degree)
        if self.outlier_cache == "recent":
            # Outlier heads are a StreamingLLM cache of their share: the newest `budget` entries.
            newer = keep.flip(1).cumsum(1).flip(1)  # valid entries at or after each slot
            keep &= ~self._outlier[:, None] | (newer <= self.budget)
        self._compact(keep)
        self._cluster(keys.shape[1])

    def entries(self) -> Entries:
        return Entries(self._keys, self._values, self._positions, self._log_degree, self._log_degree.clone())

    def state_dict(self) -> StateDict:
        return {
            "keys": self._keys,
            "values": self._values,
            "positions": self._positions,
            "log_degree": self._log_degree,
            "steps": self._steps,
        }

    def load_state_dict(self, state: StateDict) -> None:
        self._keys = state_tensor(state, "keys").to(self.spec.device, self.spec.dtype)
        self._values = state_tensor(state, "values").to(self.spec.device, self.spec.dtype)
        self._positions = state_tensor(state, "positions").to(self.spec.device)
        self._log_degree = state_tensor(state, "log_degree").to(self.spec.device, torch.float32)
        self._steps = state_tensor(state, "steps").cpu().long()

    def nbytes(self) -> int:
        return tensor_bytes(self._keys, self._values, self._positions, self._log_degree, self._steps)

    def reposition(self, fn: Repositioner) -> None:
        keys, positions = fn(self._keys, self._positions)
        # Padding slots stay zero whatever fn makes of them.
        valid = torch.isfinite(self._log_degree)
        self._keys = keys.masked_fill(~valid[..., None], 0)
        self._positions = positions.masked_fill(~valid, 0)

    # ------------------------------------------------------------------ clustering

    def _cluster(self, batch: int) -> None:
        """Algorithm 1's trigger, under a hard cap: a head holding more than the budget
        runs CSM steps until it is back on target (see `_target`)."""
        counts = torch.isfinite(self._log_degree).sum(1).cpu()
        active = (counts > self.budget) & ~self._outlier.cpu()
        if not active.any():
            return
        target = self._target(batch)
        if target == 0:  # a zero budget holds nothing; merging can never reach 0 entries
            self._compact(torch.isfinite(self._log_degree) & ~active.to(self.spec.device)[:, None])
            return
        while True:
            removals = self._removals(counts, active, target)
            if not removals.any():
                return
            self._csm_step(removals)
            counts = counts - removals

    def _target(self, batch: int) -> int:
        """Entries a clustering brings a head down to. The paper clusters back to B once
        the cache reaches B + g, i.e. once per g new tokens; here the budget is a hard cap,
        so the exact tokens still to come before the next clustering must fit under it.
        A batch of >= g tokens is itself that overshoot: land on the budget (clustering
        runs every ingest, i.e. every >= g tokens). Smaller batches leave room for
        g - batch more tokens, which again spaces clusterings about g tokens apart. The
        room is at most half the budget, so that small budgets still hold clusters."""
        room = min(max(self.g - batch, 0), self.budget // 2)
        return self.budget - room

    def _removals(self, counts: Tensor, active: Tensor, target: int) -> Tensor:
        """E per head for the next step: floor(r*L), capped so the step lands exactly on
        target, at least one while above target (the paper's r schedule); 0 for heads
        already there."""
        removals = torch.zeros_like(counts)
        for head in torch.nonzero(active & (counts > target)).flatten().tolist():
            length = int(counts[head])
            r = compression_ratio(int(self._steps[head]), self.r_init, self.r_step, self.r_steps, self.r_min)
            # The epsilon keeps r*L from flooring one short when r carries rounding (0.35 - 0.2).
            removals[head] = max(1, min(math.floor(r * length + 1e-9), length - target))
        return removals

    def _csm_step(self, removals: Tensor) -> None:
        """One Chunked Soft Matching step removing removals[h] entries from head h."""
        h, n, d = self._keys.shape
        device = self._keys.device
        padded_n = math.ceil(n / self.chunk) * self.chunk
        pad = padded_n - n
        keys = torch.nn.functional.pad(self._keys, (0, 0, 0, pad))
        values = torch.nn.functional.pad(self._values, (0, 0, 0, pad))
        log_degree = torch.nn.functional.pad(self._log_degree, (0, pad), value=NEG_INF)
        lengths = torch.isfinite(log_degree).sum(1)
        score, source, partner = _best_partners(keys, lengths, self.chunk)
        # Global top-E edges per head; a stable sort makes ties deterministic.
        order = torch.argsort(score, dim=1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=device).expand_as(order))
        # E never exceeds the valid edges: a head above target has L >= 2, and r <= 1/2.
        merged = rank < removals.to(device)[:, None]  # [H, m]: A slots merged into their partner

        degree = torch.exp(log_degree)  # padding: 0
        source_degree = degree[:, source] * merged
        mass = degree.scatter_add(1, partner, source_degree)
        key_sum = (degree[..., None] * keys.float()).scatter_add(
            1, partner[..., None].expand(-1, -1, d), source_degree[..., None] * keys[:, source].float()
        )
        value_sum = (degree[..., None] * values.float()).scatter_add(
            1, partner[..., None].expand(-1, -1, d), source_degree[..., None] * values[:, source].float()
        )
        # Only B entries that absorbed something change: untouched entries stay bit-exact.
        grown = torch.zeros(h, padded_n, dtype=torch.long, device=device).scatter_add(1, partner, merged.long()) > 0
        safe_mass = mass.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        self._keys = torch.where(grown[..., None], (key_sum / safe_mass).to(keys.dtype), keys)
        self._values = torch.where(grown[..., None], (value_sum / safe_mass).to(values.dtype), values)
        self._log_degree = torch.where(grown, torch.log(mass), log_degree)
        self._positions = torch.nn.functional.pad(self._positions, (0, pad))  # B keeps its own position
        removed = torch.zeros(h, padded_n, dtype=torch.bool, device=device)
        removed[:, source] = merged
        self._compact(torch.isfinite(self._log_degree) & ~removed)
        self._steps = self._steps + (removals > 0).long()  # never in place: state_dict hands it out

    def _compact(self, keep: Tensor) -> None:
        """Keep the marked entries, in order, left-aligned; shorter heads padded with
        a = b = -inf (zero key, value and position)."""
        if bool(keep.all()):  # the common ingest: nothing dropped, no ragged heads
            return
        order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)
        length = int(keep.sum(1).max().item()) if keep.numel() else 0
        order = order[:, :length]
        valid = torch.gather(keep, 1, order)
        heads, n = keep.shape
        # One index_select over the flattened heads: a gather with an index expanded over
        # the head dimension costs about 20x more on the CPU.
        flat = (order + torch.arange(heads, device=order.device).unsqueeze(1) * n).flatten()

        def take(tensor: Tensor, padding: float) -> Tensor:
            picked = tensor.reshape(heads * n, *tensor.shape[2:]).index_select(0, flat)
            picked = picked.view(heads, length, *tensor.shape[2:])
            if ragged:
                picked = picked.masked_fill(~valid.view(heads, length, *([1] * (tensor.dim() - 2))), padding)
            return picked

        ragged = not bool(valid.all())  # heads of different lengths: pad the shorter ones
        self._keys, self._values = take(self._keys, 0), take(self._values, 0)
        self._positions, self._log_degree = take(self._positions, 0), take(self._log_degree, NEG_INF)
