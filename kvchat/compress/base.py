"""The compressor interface: what every method in `kvchat/compress/` implements.

A compressor owns the *middle* of one layer's cache, for all KV heads of that layer at
once (tensors carry the KV-head axis first). It sees tensors only: keys, values,
positions, log-weights and, for score-based methods, attention mass. It knows nothing of
the model, the UI or SQLite.

Life cycle, driven by `kvchat.cache`:

1. Tokens leave the exact window in batches and are handed to `ingest`. A batch may also
   carry log-weights (an entry that already stands for several tokens, e.g. when the
   user switches method and the old entries are re-streamed) and the attention mass the
   tokens collected while they sat in the window.
2. After every forward pass, methods with `needs_attention = True` get `observe(mass)`:
   the attention mass of that pass on each current middle entry, in `entries()` order.
3. `entries()` returns what attention reads. The cache calls it after `ingest`,
   `load_state_dict` and `reposition` only, and keeps the result, so it may allocate.

Attention over the entries (see ARCHITECTURE.md section 2):
    out = sum_j exp(s_j + a_j) v_j / sum_j exp(s_j + b_j),   s_j = scale * <q, k_j>
Exact tokens have a = b = 0; a merged entry standing for n tokens has a = b = log n;
numerator-only entries have b = -inf, denominator-only entries a = -inf. Heads whose
middles differ in size are padded with a = b = -inf (values and keys of padding: 0).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

NEG_INF = float("-inf")

# A state dict holds tensors and plain scalars only (the store persists it as-is).
StateValue = Tensor | int | float | str | bool
StateDict = dict[str, StateValue]

# reposition(keys [H, n, d], positions [H, n]) -> (keys, positions): re-rotates keys
# so that they sit at new positions (the cache's position compaction).
Repositioner = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class Entries:
    """The middle of one layer, as attention reads it. Leading axis: KV head."""

    keys: Tensor  # [H, n, d], model dtype
    values: Tensor  # [H, n, d], model dtype
    positions: Tensor  # [H, n], int64
    log_num: Tensor  # [H, n], float32: a
    log_den: Tensor  # [H, n], float32: b

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    @staticmethod
    def empty(num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> Entries:
        return Entries(
            keys=torch.zeros(num_heads, 0, head_dim, device=device, dtype=dtype),
            values=torch.zeros(num_heads, 0, head_dim, device=device, dtype=dtype),
            positions=torch.zeros(num_heads, 0, dtype=torch.long, device=device),
            log_num=torch.zeros(num_heads, 0, dtype=torch.float32, device=device),
            log_den=torch.zeros(num_heads, 0, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class LayerSpec:
    """Shape facts of the layer a compressor serves."""

    layer: int
    num_kv_heads: int
    group_size: int  # query heads per KV head (GQA); 1 for MHA
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    seed: int = 0

    def generator(self, salt: str = "") -> torch.Generator:
        """A generator seeded from (session seed, layer, salt): deterministic per layer."""
        digest = hashlib.sha256(f"{self.seed}:{self.layer}:{salt}".encode()).digest()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        return gen


class Compressor(ABC):
    """One method's middle for one layer. Subclasses live one per file, registered by name."""

    name: ClassVar[str]
    description: ClassVar[str]  # one line, shown in the method picker and --help
    # Method hyperparameters and their defaults (the paper's where it gives them).
    # Exposed on the CLI as --<name>-<param> and documented from `param_help`.
    defaults: ClassVar[dict[str, Any]] = {}
    param_help: ClassVar[dict[str, str]] = {}
    # True for score-based methods (h2o, bumblebee): the cache then computes attention
    # probabilities explicitly and calls `observe`, and passes window scores to `ingest`.
    needs_attention: ClassVar[bool] = False
    # True when entries may have a != b (split numerator/denominator sets).
    split_weights: ClassVar[bool] = False
    # False for methods that keep no middle (window): a percentage budget then goes whole
    # to the recent window, so every method is compared at the same memory, and window
    # overflow is dropped exactly (there is no compressor work to batch).
    keeps_middle: ClassVar[bool] = True

    def __init__(self, spec: LayerSpec, budget: int, **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.name}: unknown parameter(s) {sorted(unknown)}")
        self.spec = spec
        self.budget = int(budget)  # max middle entries per KV head; the cache may change it
        self.params: dict[str, Any] = {**self.defaults, **params}

    @abstractmethod
    def ingest(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        log_weights: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> None:
        """Absorb a batch of entries leaving the window, oldest first.

        keys, values: [H, b, d]; positions: [H, b] int64; log_weights: [H, b] float32 or
        None (None means exact tokens, weight 1; else the entry stands for exp(w) tokens,
        a = b = w); scores: [H, G, b] float32 attention mass collected so far, or None.
        Afterwards every head holds at most `self.budget` middle entries (pending
        entries count).
        """

    def observe(self, mass: Tensor) -> None:
        """Attention mass of the last forward pass on each middle entry: [H, G, n],
        summed over that pass's query positions, in `entries()` order."""

    @abstractmethod
    def entries(self) -> Entries:
        """The current middle. Padding entries carry a = b = -inf."""

    def tokens(self) -> Entries | None:
        """The middle as real tokens, for handing to another method (a method switch):
        true keys and values, each entry with the number of tokens it stands for as
        a = b = log(count), in `entries()` layout. None when the state holds no such set
        (e.g. sampled estimators whose entries carry only one side of the softmax): the
        caller must then rebuild from the transcript.

        Default: every entry with a finite count (denominator) weight, at that weight;
        numerator-only entries are dropped (their tokens are counted by the others)."""
        entries = self.entries()
        counted = torch.isfinite(entries.log_den)
        weight = torch.where(counted, entries.log_den, torch.full_like(entries.log_den, NEG_INF))
        return Entries(entries.keys, entries.values, entries.positions, weight, weight.clone())

    @abstractmethod
    def state_dict(self) -> StateDict:
        """Everything needed to continue exactly (random state included)."""

    @abstractmethod
    def load_state_dict(self, state: StateDict) -> None: ...

    @abstractmethod
    def nbytes(self) -> int:
        """Exact bytes of every tensor this compressor holds."""

    @abstractmethod
    def reposition(self, fn: Repositioner) -> None:
        """Apply the cache's position compaction to every key (and position) held."""

    def __len__(self) -> int:
        """Entries per head (the largest head, padding excluded)."""
        entries = self.entries()
        finite = torch.isfinite(entries.log_num) | torch.isfinite(entries.log_den)
        return int(finite.sum(dim=1).max().item()) if finite.numel() else 0


def incoming_log_weights(log_weights: Tensor | None, positions: Tensor) -> Tensor:
    """The log-weights of an ingested batch as float32 [H, b]: zeros (exact tokens)
    when none were given."""
    if log_weights is None:
        return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    return log_weights.float()


def tensor_bytes(*tensors: Tensor | None) -> int:
    """Bytes held by tensors (None ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def generator_state(gen: torch.Generator) -> Tensor:
    return gen.get_state().clone()


def set_generator_state(gen: torch.Generator, state: Tensor) -> None:
    gen.set_state(state.clone().cpu())
