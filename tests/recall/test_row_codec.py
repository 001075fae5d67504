"""How a cold token is kept on disk (kvchat/recall/row_codec.py): keys in 8 bits and values in 4,
per token and KV head, each within half a step of what went cold, in 102 bytes a head of 64
channels."""

from __future__ import annotations

import pytest
import torch

from kvchat.recall import row_codec

H, N = 3, 40


def round_trip(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    units = row_codec.encode(keys, values)  # [n, H, unit]
    return row_codec.decode(units.transpose(0, 1), keys.shape[-1], keys.dtype)


@pytest.mark.parametrize("d", [64, 128, 80, 6])
def test_a_head_of_d_channels_takes_a_scale_a_minimum_a_step_and_one_and_a_half_bytes_a_channel(d):
    units = row_codec.encode(torch.randn(H, N, d), torch.randn(H, N, d))
    assert units.dtype == torch.uint8 and tuple(units.shape) == (N, H, row_codec.unit_bytes(d))
    assert row_codec.unit_bytes(64) == 102  # against 256 bytes in float16
    assert row_codec.unit_bytes(d) in (6 + d + d // 2, 6 + d + d // 2 + 1)


def test_each_key_channel_comes_back_within_half_a_step_of_its_tokens_scale():
    torch.manual_seed(0)
    keys = torch.randn(H, N, 64) * torch.linspace(0.1, 20, 64)  # channels of very different sizes
    got, _ = round_trip(keys, torch.randn(H, N, 64))
    step = keys.abs().amax(-1, keepdim=True) / row_codec.KEY_LEVELS
    assert bool(((got - keys).abs() <= step * 0.501).all())


def test_each_value_channel_comes_back_within_half_a_step_of_its_tokens_range():
    torch.manual_seed(1)
    values = torch.randn(H, N, 64) * 3 + 1
    _, got = round_trip(torch.randn(H, N, 64), values)
    spread = values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)
    assert bool(((got - values).abs() <= spread / row_codec.VALUE_LEVELS * 0.51).all())


def test_a_zero_key_and_a_constant_value_come_back_as_they_went():
    keys = torch.zeros(H, N, 64)
    values = torch.full((H, N, 64), 0.75)
    got_keys, got_values = round_trip(keys, values)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_rows_decode_to_the_dtype_asked_for():
    got_keys, got_values = round_trip(torch.randn(H, N, 64, dtype=torch.bfloat16), torch.randn(H, N, 64))
    assert got_keys.dtype == got_values.dtype == torch.bfloat16
