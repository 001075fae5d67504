"""A layer's window buffer (kvchat/cache/window_buffer.py): appends and drops without a copy per step,
and the sinks joined after the live tokens for a decode step's one kernel call."""

from __future__ import annotations

import torch

from kvchat.cache.window_buffer import WINDOW_SLACK, WindowBuffer

H, D = 2, 4


def tokens(first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values whose every number is the token's index (values negated)."""
    ids = torch.arange(first, first + count, dtype=torch.float32)
    keys = ids[None, :, None].expand(H, count, D).clone()
    return keys, -keys, torch.arange(first, first + count)


def test_the_sinks_follow_the_live_tokens_in_one_view():
    window = WindowBuffer(*tokens(10, 5))
    sinks_k, sinks_v, _ = tokens(0, 3)
    keys, values = window.with_tail([sinks_k], [sinks_v])
    assert keys.shape == (H, 8, D)
    assert keys[0, :, 0].tolist() == [10, 11, 12, 13, 14, 0, 1, 2]
    assert values[0, :, 0].tolist() == [-10, -11, -12, -13, -14, -0.0, -1, -2]
    assert keys.untyped_storage().data_ptr() == window.keys.untyped_storage().data_ptr()  # no copy of the window


def test_decode_steps_with_the_sinks_joined_keep_every_live_token():
    """A decode step appends a token, drops the oldest and attends window + sinks; over
    more steps than the buffer's slack (so its storage moves) the live tokens stay the
    last ones, in order, and the joined view always ends with the sinks."""
    window = WindowBuffer(*tokens(4, 8))
    sinks_k, sinks_v, _ = tokens(0, 4)
    for step in range(3 * WINDOW_SLACK):
        window.append(*tokens(12 + step, 1))
        window.drop(1)
        keys, values = window.with_tail([sinks_k], [sinks_v])
        live = list(range(5 + step, 13 + step))
        assert window.keys[1, :, 3].tolist() == live
        assert window.pos.tolist() == live
        assert keys[1, :, 3].tolist() == live + [0, 1, 2, 3]
        assert values[1, :, 3].tolist() == [-x for x in live] + [-0.0, -1, -2, -3]
