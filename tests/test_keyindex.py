"""The recall tier's 4-bit key index (kvchat/keyindex.py): the CPU int4 kernel's layout
scores as the portable one does, however the rows arrive."""

from __future__ import annotations

import pytest
import torch

from kvchat.keyindex import PACK_BLOCK, KeyIndex, PackedKeyIndex, key_index, packed_scoring_available

H, D = 3, 64
CHANNELS = torch.cat([torch.arange(16), torch.arange(16) + 32])  # the slow half of 32 RoPE pairs
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not packed_scoring_available(32), reason="no CPU int4 kernel in this PyTorch")


def filled(index: KeyIndex, keys: torch.Tensor, sizes: list[int]) -> KeyIndex:
    at = 0
    for size in sizes:
        index.append(keys[:, at : at + size], torch.arange(at, at + size))
        at += size
    return index


@needs_kernel
def test_a_cpu_gets_the_packed_layout():
    assert isinstance(key_index(H, D, CPU, CHANNELS), PackedKeyIndex)


@needs_kernel
@pytest.mark.parametrize("sizes", [[1000], [1, 3, 60, 64, 200, 1, 1, 1, 5, 128, 536], [PACK_BLOCK - 1, 2, PACK_BLOCK]])
def test_packed_scores_match_the_portable_ones_however_the_rows_arrive(sizes):
    torch.manual_seed(0)
    keys = torch.randn(H, sum(sizes), D)
    portable = filled(KeyIndex(H, D, CPU, CHANNELS), keys, sizes)
    packed = filled(PackedKeyIndex(H, D, CPU, CHANNELS), keys, sizes)
    query = torch.randn(H, 3, D)
    expected = portable.scores(query)
    # bfloat16 scale and offset (and query) against float32: a tenth on scores of about ±25.
    torch.testing.assert_close(packed.scores(query), expected, atol=0.25, rtol=0.01)
    assert packed.rows == portable.rows == sum(sizes)


@needs_kernel
def test_a_planted_key_ranks_first_in_the_packed_layout():
    torch.manual_seed(1)
    keys = 0.1 * torch.randn(H, 700, D)
    direction = torch.nn.functional.normalize(torch.randn(H, D), dim=-1)
    keys[:, 333] = 6.0 * direction
    index = filled(PackedKeyIndex(H, D, CPU, CHANNELS), keys, [300, 1, 399])
    scores = index.scores(2.0 * direction[:, None, :])
    assert scores.argmax(-1).tolist() == [333] * H


@needs_kernel
def test_a_copy_scores_the_same_and_grows_on_its_own():
    torch.manual_seed(2)
    keys = torch.randn(H, 200, D)
    index = filled(PackedKeyIndex(H, D, CPU, CHANNELS), keys, [130])
    twin = index.copy()
    query = torch.randn(H, 2, D)
    assert torch.equal(twin.scores(query), index.scores(query))
    twin.append(keys[:, 130:], torch.arange(130, 200))
    assert (twin.rows, index.rows) == (200, 130)
    assert torch.equal(twin.scores(query)[:, :130], index.scores(query))


@pytest.mark.parametrize("layout", [KeyIndex, PackedKeyIndex])
def test_bytes_are_the_live_rows_at_the_layouts_cost(layout):
    if layout is PackedKeyIndex and not packed_scoring_available(32):
        pytest.skip("no CPU int4 kernel in this PyTorch")
    index = filled(layout(H, D, CPU, CHANNELS), torch.randn(H, 100, D), [100])
    assert index.nbytes() == 100 * H * index.bytes_per_row()
    assert index.bytes_per_row() == (16 + 8 if layout is KeyIndex else 16 + 4)
