"""`full`: the exact cache. Keeps every entry it is given, never evicts."""

from __future__ import annotations

import torch
from torch import Tensor

from kvchat.compress import register
from kvchat.compress.base import Compressor, LayerSpec, incoming_log_weights
from kvchat.kv_types import Entries, Repositioner, StateDict, state_tensor, tensor_bytes


@register
class FullCache(Compressor):
    name = "full"
    description = "Exact attention: keeps every token (memory grows with the conversation)."
    bounded = False

    def __init__(self, spec: LayerSpec, budget: int, **params) -> None:
        super().__init__(spec, budget, **params)
        self._entries = Entries.empty(spec.num_kv_heads, spec.head_dim, spec.device, spec.dtype)

    def ingest(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        log_weights: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> None:
        weights = incoming_log_weights(log_weights, positions)
        e = self._entries
        self._entries = Entries(
            keys=torch.cat([e.keys, keys], dim=1),
            values=torch.cat([e.values, values], dim=1),
            positions=torch.cat([e.positions, positions], dim=1),
            # Exact entries have a = b: one tensor serves both (no duplicate held).
            log_num=(weights := torch.cat([e.log_num, weights], dim=1)),
            log_den=weights,
        )

    def entries(self) -> Entries:
        return self._entries

    def state_dict(self) -> StateDict:
        e = self._entries
        return {"keys": e.keys, "values": e.values, "positions": e.positions, "log_weights": e.log_num}

    def load_state_dict(self, state: StateDict) -> None:
        w = state_tensor(state, "log_weights")
        self._entries = Entries(
            state_tensor(state, "keys"), state_tensor(state, "values"), state_tensor(state, "positions"), w, w
        )

    def nbytes(self) -> int:
        e = self._entries
        return tensor_bytes(e.keys, e.values, e.positions, e.log_num)  # log_den is log_num

    def reposition(self, fn: Repositioner) -> None:
        e = self._entries
        keys, positions = fn(e.keys, e.positions)
        self._entries = Entries(keys, e.values, positions, e.log_num, e.log_den)
