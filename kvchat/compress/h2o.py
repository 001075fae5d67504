"""`h2o`: Heavy-Hitter Oracle — keep the entries with the highest accumulated attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models". Every entry accumulates the attention it receives (summed over the
queries of every forward pass and over the query heads of its GQA group). The cache's
exact window plays H2O's "recent" part; the middle keeps the top-`budget` entries by
accumulated score, evicting the lowest (the top-k rule of H2O's real-drop code). A token
arrives from the window with the score it collected there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.compress import register
from kvchat.compress.base import Compressor, LayerSpec, Param, incoming_log_weights
from kvchat.kv_types import Entries, Repositioner, StateDict, state_tensor, tensor_bytes


@register
class HeavyHitters(Compressor):
    name = "h2o"
    description = "H2O: keeps the tokens that have received the most attention (heavy hitters)."
    hyperparameters = (
        Param(
            "aggregate",
            str,
            "sum",
            "how a GQA group's query heads combine attention scores",
            "H2O sums",
            choices=("sum", "mean"),
        ),
    )
    needs_attention = True

    def __init__(self, spec: LayerSpec, budget: int, **params) -> None:
        super().__init__(spec, budget, **params)
        if self.params["aggregate"] not in ("sum", "mean"):
            raise ValueError("h2o: aggregate must be sum or mean")
        h, d = spec.num_kv_heads, spec.head_dim
        self._entries = Entries.empty(h, d, spec.device, spec.dtype)
        self.scores = torch.zeros(h, 0, device=spec.device)  # accumulated attention per entry

    def _group(self, mass: Tensor) -> Tensor:
        return mass.sum(1) if self.params["aggregate"] == "sum" else mass.mean(1)

    def ingest(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights=None, scores=None) -> None:
        h, b = positions.shape
        weights = incoming_log_weights(log_weights, positions)
        incoming = torch.zeros(h, b, device=keys.device) if scores is None else self._group(scores.float())
        e = self._entries
        keys = torch.cat([e.keys, keys], 1)
        values = torch.cat([e.values, values], 1)
        positions = torch.cat([e.positions, positions], 1)
        weights = torch.cat([e.log_num, weights], 1)
        score = torch.cat([self.scores, incoming], 1)
        if score.shape[1] > self.budget:
            # Top-k by accumulated score, then back to arrival order (H2O re-sorts kept indices).
            keep = score.topk(self.budget, dim=1, sorted=False).indices.sort(1).values
            pick = lambda t: torch.gather(t, 1, keep[..., None].expand(-1, -1, t.shape[2]))  # noqa: E731
            keys, values = pick(keys), pick(values)
            positions, weights, score = (torch.gather(t, 1, keep) for t in (positions, weights, score))
        self._entries = Entries(keys, values, positions, weights, weights)  # a = b: one tensor
        self.scores = score

    def observe(self, mass: Tensor) -> None:
        self.scores = self.scores + self._group(mass.float())

    def entries(self) -> Entries:
        return self._entries

    def state_dict(self) -> StateDict:
        e = self._entries
        return {
            "keys": e.keys,
            "values": e.values,
            "positions": e.positions,
            "log_weights": e.log_num,
            "scores": self.scores,
        }

    def load_state_dict(self, state: StateDict) -> None:
        w = state_tensor(state, "log_weights")
        self._entries = Entries(
            state_tensor(state, "keys"), state_tensor(state, "values"), state_tensor(state, "positions"), w, w
        )
        self.scores = state_tensor(state, "scores")

    def nbytes(self) -> int:
        e = self._entries
        return tensor_bytes(e.keys, e.values, e.positions, e.log_num, self.scores)  # log_den is log_num

    def reposition(self, fn: Repositioner) -> None:
        e = self._entries
        keys, positions = fn(e.keys, e.positions)
        self._entries = Entries(keys, e.values, positions, e.log_num, e.log_den)
