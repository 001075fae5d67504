"""`window`: StreamingLLM — exact sinks + recent window; the middle is always empty.

Tokens leaving the window are dropped (Xiao et al., "Efficient Streaming Language Models
with Attention Sinks"). The cache keeps the sinks and the window; this compressor only
has to forget.
"""

from __future__ import annotations

from torch import Tensor

from kvchat.compress import register
from kvchat.compress.base import Compressor, LayerSpec
from kvchat.kv_types import Entries, Repositioner, StateDict


@register
class WindowCache(Compressor):
    name = "window"
    description = "StreamingLLM: keeps the first tokens (sinks) and the recent window, drops the rest."
    keeps_middle = False

    def __init__(self, spec: LayerSpec, budget: int, **params) -> None:
        super().__init__(spec, budget, **params)
        self._empty = Entries.empty(spec.num_kv_heads, spec.head_dim, spec.device, spec.dtype)

    def ingest(self, keys: Tensor, values: Tensor, positions: Tensor, log_weights=None, scores=None) -> None:
        """Tokens leaving the window are dropped: nothing to keep."""

    def entries(self) -> Entries:
        return self._empty

    def state_dict(self) -> StateDict:
        return {}

    def load_state_dict(self, state: StateDict) -> None:
        pass

    def nbytes(self) -> int:
        return 0

    def reposition(self, fn: Repositioner) -> None:
        pass
