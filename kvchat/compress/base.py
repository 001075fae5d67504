"""The compressor interface: what every method in `kvchat/compress/` implements.

A compressor owns the *middle* of one layer's cache, for all KV heads of that layer at
once (tensors carry the KV-head axis first). It sees tensors only: keys, values,
positions, log-weights and, for score-based methods, attention mass. It knows nothing of
the model, the UI or SQLite.

Life cycle, driven by `kvchat.cache.compressed_cache`:

1. Tokens leave the exact window in batches and are handed to `ingest`. A batch may also
   carry log-weights (an entry that already stands for several tokens, e.g. when the
   user switches method and the old entries are re-streamed) and the attention mass the
   tokens collected while they sat in the window.
2. After every forward pass, methods with `needs_attention = True` get `observe(mass)`:
   the attention mass of that pass on each current middle entry, in `entries()` order.
3. `entries()` returns what attention reads. The cache calls it after `ingest`,
   `load_state_dict` and `reposition` only, and keeps the result, so it may allocate.

Attention over the entries (see docs/design.md, "The cache formula"):
    out = sum_j exp(s_j + a_j) v_j / sum_j exp(s_j + b_j),   s_j = scale * <q, k_j>
Exact tokens have a = b = 0; a merged entry standing for n tokens has a = b = log n;
numerator-only entries have b = -inf, denominator-only entries a = -inf. Heads whose
middles differ in size are padded with a = b = -inf (values and keys of padding: 0).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvchat.kv_types import Entries, Repositioner, StateDict

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Param:
    """One method hyperparameter, declared once on its compressor class. The CLI flag
    (`--<method>-<name>`), its help, the value check and the README table all come from
    this declaration."""

    name: str
    type: type  # int, float, str or bool
    default: Any
    help: str  # what it does
    source: str  # where the default comes from (paper, authors' code, kvchat's choice)
    choices: tuple[Any, ...] | None = None
    low: float | None = None  # inclusive unless open_low
    high: float | None = None  # inclusive unless open_high
    open_low: bool = False
    open_high: bool = False
    optional: bool = False  # None is allowed (e.g. "automatic")
    default_text: str | None = None  # how the default reads when it is not a literal value

    def flag(self, method: str) -> str:
        return f"--{method}-{self.name.replace('_', '-')}"

    @property
    def shown_default(self) -> str:
        return self.default_text or f"`{self.default}`"

    def parse(self, text: str) -> Any:
        """A command-line (or config) string as this parameter's value; ValueError when
        it is not one."""
        raw = text.strip()
        if self.optional and raw.lower() in ("", "none", "auto", "automatic"):
            return None
        if self.type is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true or false, got {text!r}")
        try:
            return self.check(self.type(raw))
        except ValueError as err:
            if self.type in (int, float) and "must" not in str(err):
                raise ValueError(f"expected {'an integer' if self.type is int else 'a number'}, got {text!r}") from None
            raise

    def check(self, value: Any, method: str = "") -> Any:
        """The value, converted to this parameter's type, or ValueError naming the rule."""
        where = f"{method}: " if method else ""
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{where}{self.name} needs a value")
        if isinstance(value, str) and self.type is not str:
            return self.check(self.parse(value), method)
        if self.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        elif self.type is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, self.type) or (self.type is not bool and isinstance(value, bool)):
            raise ValueError(f"{where}{self.name} must be {self.type.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{where}{self.name} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        # a parameter with bounds is a number (`isinstance` above narrows to object only)
        low_bad = self.low is not None and (value <= self.low if self.open_low else value < self.low)  # type: ignore[operator]
        high_bad = self.high is not None and (value >= self.high if self.open_high else value > self.high)  # type: ignore[operator]
        if low_bad or high_bad:
            raise ValueError(f"{where}{self.name} must be {self.range_text()}, got {value!r}")
        return value

    def range_text(self) -> str:
        """The allowed range in words: "at least 1", "above 0", "in (0, 0.5]"."""
        if self.high is None:
            return f"{'above' if self.open_low else 'at least'} {self.low:g}"
        if self.low is None:
            return f"{'below' if self.open_high else 'at most'} {self.high:g}"
        left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"

    def help_line(self) -> str:
        """The --help text: what it does, its default and where the default comes from."""
        extra = ""
        if self.choices is not None:
            extra = f"; one of {', '.join(map(str, self.choices))}"
        elif self.low is not None or self.high is not None:
            extra = f"; {self.range_text()}"
        shown = self.shown_default.replace("`", "")
        return f"{self.help}{extra} (default {shown}: {self.source})"


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
    # Method hyperparameters, one `Param` each (the paper's default where it gives one).
    # `defaults` and `param_help` are derived from them (read-only views kept for callers).
    hyperparameters: ClassVar[tuple[Param, ...]] = ()
    defaults: ClassVar[dict[str, Any]] = {}
    param_help: ClassVar[dict[str, str]] = {}
    # True for score-based methods (h2o, bumblebee): the cache then computes attention
    # probabilities explicitly and calls `observe`, and passes window scores to `ingest`.
    needs_attention: ClassVar[bool] = False
    # True when entries may have a != b (split numerator/denominator sets). A method
    # whose modes differ sets it per instance (subgen: only its stream mode splits).
    split_weights: bool = False
    # False for methods that keep no middle (window): a percentage budget then goes whole
    # to the recent window, so every method is compared at the same memory, and window
    # overflow is dropped exactly (there is no compressor work to batch).
    keeps_middle: ClassVar[bool] = True
    # False for a method that keeps every token (full): its cache grows with the
    # conversation, so a turn is refused up front when it cannot fit the positions.
    bounded: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "hyperparameters" in cls.__dict__:
            cls.defaults = {p.name: p.default for p in cls.hyperparameters}
            cls.param_help = {p.name: p.help_line() for p in cls.hyperparameters}

    def __init__(self, spec: LayerSpec, budget: int, **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.name}: unknown parameter(s) {sorted(unknown)}")
        for declared in self.hyperparameters:
            if declared.name in params:
                params[declared.name] = declared.check(params[declared.name], self.name)
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

    def observe(self, mass: Tensor) -> None:  # noqa: B027 (a hook: score-free methods ignore it)
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


def generator_state(gen: torch.Generator) -> Tensor:
    return gen.get_state().clone()


def set_generator_state(gen: torch.Generator, state: Tensor) -> None:
    gen.set_state(state.clone().cpu())
