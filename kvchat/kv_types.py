"""Shared tensor types: what the cache, the compressors, the recall tier and the engine
hand each other. A leaf: it imports torch and nothing of kvchat."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

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


@dataclass(eq=False)
class LayerGeometry:
    """What one layer's attention does besides softmax(scale * q·k) over the cache, as the
    model family's adapter (`kvchat.model.families`) reads it from the model: the cache,
    the compaction and the recall tier ask this, never the model.

    - `inv_freq`: the RoPE frequency of each rotated channel pair, as the model computed
      it (scaling included); the pairs are channels i and i + r/2 of the first r = 2 *
      len(inv_freq) channels (partial rotary turns fewer than all), None: no RoPE.
    - `sliding_window`: a query at position p sees keys at p - w < k <= p only (None:
      every earlier key).
    - `softcap`: attention logits pass through softcap * tanh(s / softcap) (None: not)."""

    inv_freq: Tensor | None = None
    sliding_window: int | None = None
    softcap: float | None = None

    @property
    def rotary_dim(self) -> int:
        """Channels RoPE turns (0: none)."""
        return 0 if self.inv_freq is None else 2 * self.inv_freq.numel()


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(keys: Tensor, delta: Tensor, inv_freq: Tensor | None) -> Tensor:
    """Rotate post-RoPE keys by `delta` more positions (RoPE rotations compose). The pairs
    are channels i and i + r/2 of the first r = 2 * len(inv_freq) channels, as transformers'
    `rotate_half` pairs them; channels past r (partial rotary) and every channel of a layer
    without RoPE (`inv_freq` None) do not turn. An attention scaling the model folds into
    cos and sin (yarn, longrope) multiplies every rotated key alike, and a rotation keeps it.

    The angles and their cosines and sines are taken in float64 and rounded to float32, so
    that a key turned by a delta gives the same numbers whatever the shape of the tensor it
    is turned in: float32 sines can differ in the last bit between a vectorised loop and
    its tail, and a recall index rebuilt on resume must equal the one built as the rows
    went cold (kvchat/recall/tier.py)."""
    if inv_freq is None:
        return keys
    rotary = 2 * inv_freq.numel()
    angle = delta.to(torch.float64)[..., None] * inv_freq.to(keys.device, torch.float64)
    angle = torch.cat((angle, angle), dim=-1)
    k = keys[..., :rotary].float()
    turned = (k * angle.cos().float() + rotate_half(k) * angle.sin().float()).to(keys.dtype)
    if rotary == keys.shape[-1]:
        return turned
    return torch.cat((turned, keys[..., rotary:]), dim=-1)


def tensor_bytes(*tensors: Tensor | None) -> int:
    """Bytes held by tensors (None ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def state_tensor(state: StateDict, key: str) -> Tensor:
    """`state[key]` as the tensor its writer put there (a cast for the type checker; it checks
    nothing)."""
    return cast(Tensor, state[key])
