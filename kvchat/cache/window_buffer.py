"""The window of one layer: the most recent tokens, kept exact, in one growable buffer.

Apart from `kvchat.cache.compressed_cache` because it is a data structure with no policy in it: the layer
(`kvchat.cache.layer`) decides when tokens join and leave; this module only makes appends and
drops cheap (no copy on every decode step).
"""

from __future__ import annotations

from typing import ClassVar, cast

from torch import Tensor

# Spare slots a window buffer gets when it must grow: its live part is copied about once
# per this many appended tokens instead of on every decode step.
WINDOW_SLACK = 128


class WindowBuffer:
    """The window of one layer: its exact keys [H, w, d], values [H, w, d], positions [w]
    and, for score-based methods, attention mass [H, G, w], all w tokens long.

    The four tensors grow and shrink together, so they share one live range
    [start, stop) of their storage: appends fill spare room at the end, drops move
    `start`, and the live parts are copied only when the room runs out (or, after a
    large drop, to give memory back). `keys`, `values`, `pos` and `scores` are views of
    the live part; the layer never holds the storage itself."""

    # Each part's token axis in its storage tensor.
    # Of the four, only `scores` may be None.
    _AXES: ClassVar[dict[str, int]] = {"keys": 1, "values": 1, "pos": 0, "scores": 2}

    def __init__(self, keys: Tensor, values: Tensor, pos: Tensor, scores: Tensor | None = None) -> None:
        self._storage: dict[str, Tensor | None] = {"keys": keys, "values": values, "pos": pos, "scores": scores}
        self.start, self.stop = 0, pos.shape[0]

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def capacity(self) -> int:
        """Tokens the storage holds before it must grow."""
        return cast(Tensor, self._storage["pos"]).shape[0]

    def _live(self, part: str) -> Tensor | None:
        tensor = self._storage[part]
        return None if tensor is None else tensor.narrow(self._AXES[part], self.start, len(self))

    @property
    def keys(self) -> Tensor:
        return cast(Tensor, self._live("keys"))

    @property
    def values(self) -> Tensor:
        return cast(Tensor, self._live("values"))

    @property
    def pos(self) -> Tensor:
        return cast(Tensor, self._live("pos"))

    @property
    def scores(self) -> Tensor | None:
        return self._live("scores")

    def set_scores(self, scores: Tensor | None) -> None:
        """Start (or stop) keeping attention mass: `scores` [H, G, w] covers the live tokens."""
        if scores is None:
            self._storage["scores"] = None
            return
        shape = list(scores.shape)
        shape[2] = self.capacity
        storage = scores.new_zeros(shape)
        storage.narrow(2, self.start, len(self)).copy_(scores)
        self._storage["scores"] = storage

    def append(self, keys: Tensor, values: Tensor, pos: Tensor) -> None:
        """New tokens at the end (their attention mass starts at zero)."""
        n = pos.shape[0]
        if self.stop + n > self.capacity:
            self._move_to(len(self) + n + WINDOW_SLACK)
        for part, new in (("keys", keys), ("values", values), ("pos", pos)):
            self._storage[part].narrow(self._AXES[part], self.stop, n).copy_(new)  # type: ignore[union-attr]
        scores = self._storage["scores"]
        if scores is not None:
            scores.narrow(2, self.stop, n).zero_()
        self.stop += n

    def with_tail(self, keys: list[Tensor], values: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The live keys and values followed by the pieces `keys`/`values` ([H, t_i, d]
        each: a layer's recalled rows and sinks), each side as one view of this buffer's
        storage: a decode step attends all of them in one kernel call (their order does
        not matter to a query that sees every cached entry). The pieces are copied into
        the free room after the live part, which only the next append writes over."""
        t = sum(piece.shape[1] for piece in keys)
        if self.stop + t > self.capacity:
            self._move_to(len(self) + t + WINDOW_SLACK)
        joined = []
        for part, pieces in (("keys", keys), ("values", values)):
            storage = self._storage[part]
            at = self.stop
            for piece in pieces:
                storage.narrow(1, at, piece.shape[1]).copy_(piece)  # type: ignore[union-attr]
                at += piece.shape[1]
            joined.append(storage.narrow(1, self.start, len(self) + t))  # type: ignore[union-attr]
        return joined[0], joined[1]

    def drop(self, count: int) -> None:
        """Forget the `count` oldest tokens."""
        self.start += count
        # After a large eviction (the end of an exact prefill) give the memory back now
        # instead of when the room next runs out.
        if self.capacity > 2 * (len(self) + WINDOW_SLACK):
            self._move_to(len(self) + WINDOW_SLACK)

    def _move_to(self, capacity: int) -> None:
        """Copy the live parts to the front of new storage of `capacity` tokens."""
        kept = len(self)
        for part, tensor in self._storage.items():
            if tensor is None:
                continue
            axis = self._AXES[part]
            shape = list(tensor.shape)
            shape[axis] = capacity
            moved = tensor.new_empty(shape)
            moved.narrow(axis, 0, kept).copy_(tensor.narrow(axis, self.start, kept))
            self._storage[part] = moved
        self.start, self.stop = 0, kept
