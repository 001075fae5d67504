"""The recall tier's 4-bit key index (kvchat/recall/key_index.py): the CPU int4 kernel's layout and
kvchat's own kernel's score as the portable one does, however the rows arrive, and rank
the same rows."""

from __future__ import annotations

import pytest
import torch

from kvchat import native
from kvchat.recall.key_index import (
    PACK_BLOCK,
    KeyIndex,
    NativeKeyIndex,
    PackedKeyIndex,
    key_index,
    native_scoring_available,
    packed_scoring_available,
    top_rows,
)

H, D = 3, 64
CHANNELS = torch.cat([torch.arange(16), torch.arange(16) + 32])  # the slow half of 32 RoPE pairs
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not packed_scoring_available(32), reason="no CPU int4 kernel in this PyTorch")
needs_native = pytest.mark.skipif(
    not native_scoring_available(32),
    reason="kvchat.native._coldrank not built (no C compiler), or neither AVX512-VNNI nor AVX2",
)
# Each fast layout, skipped where it does not run.
FAST = [pytest.param(PackedKeyIndex, marks=needs_kernel), pytest.param(NativeKeyIndex, marks=needs_native)]
# Sizes of appends: one batch; many small ones across block ends; around a block.
SIZES = [[1000], [1, 3, 60, 64, 200, 1, 1, 1, 5, 128, 536], [PACK_BLOCK - 1, 2, PACK_BLOCK], [1], [15], [17]]


def filled(index: KeyIndex, keys: torch.Tensor, sizes: list[int]) -> KeyIndex:
    at = 0
    for size in sizes:
        index.append(keys[:, at : at + size], torch.arange(at, at + size))
        at += size
    return index


@needs_native
def test_a_cpu_the_kernel_runs_on_gets_kvchats_own_layout():
    assert isinstance(key_index(H, D, CPU, CHANNELS), NativeKeyIndex)


@needs_kernel
def test_without_kvchats_kernel_a_cpu_gets_the_packed_layout():
    with native.kernels(coldrank=False):
        assert isinstance(key_index(H, D, CPU, CHANNELS), PackedKeyIndex)


@pytest.mark.parametrize("layout", FAST)
@pytest.mark.parametrize("sizes", SIZES)
def test_fast_scores_match_the_portable_ones_however_the_rows_arrive(layout, sizes):
    torch.manual_seed(0)
    keys = torch.randn(H, sum(sizes), D)
    portable = filled(KeyIndex(H, D, CPU, CHANNELS), keys, sizes)
    fast = filled(layout(H, D, CPU, CHANNELS), keys, sizes)
    query = torch.randn(H, 3 if layout is PackedKeyIndex else 100, D)  # (any number of query rows)
    expected = portable.scores(query)
    # bfloat16 scale and offset (packed) or an int8 query (native) against float32: a
    # tenth or two on scores of about ±25.
    torch.testing.assert_close(fast.scores(query), expected, atol=0.5, rtol=0.01)
    assert fast.rows == portable.rows == sum(sizes)


@needs_native
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize(("dtype", "queries"), [(torch.float32, 12), (torch.bfloat16, 3), (torch.bfloat16, 200)])
def test_the_native_top_rows_are_the_top_of_its_own_scores(sizes, dtype, queries):
    torch.manual_seed(3)
    index = filled(NativeKeyIndex(H, D, CPU, CHANNELS), torch.randn(H, sum(sizes), D), sizes)
    query = torch.randn(H, queries, D, dtype=dtype)
    k = min(32, index.rows)
    expected = top_rows(index.rank_scores(query), k)
    assert torch.equal(index.top(query, k).sort(1).values, expected.sort(1).values)


@needs_native
@pytest.mark.parametrize("rows", [777, 771])  # a last block of 9 rows (both halves), of 3 (one)
def test_every_path_of_the_native_kernel_scores_and_chooses_the_same(rows):
    """The plain loop, AVX2 and AVX512-VNNI compute the same integer sums and the same float
    operations: the same scores to the bit, so the same rows (those this CPU runs)."""
    torch.manual_seed(4)
    index = filled(NativeKeyIndex(H, D, CPU, CHANNELS), torch.randn(H, rows, D), [700, rows - 700])
    bias = torch.zeros(H, index.capacity)
    bias[:, ::7] = -float("inf")
    query = torch.randn(H, 6, D, dtype=torch.bfloat16)
    scores, chosen = [], []
    for path in native.ranking_paths():  # (the plain loop runs on every CPU)
        with native.kernels(ranking_path=path):
            scores.append(index.rank_scores(query))
            chosen.append(index.top(query, 40, bias).sort(1).values)
    assert len(scores) >= 2  # the plain loop and the path `native_scoring_available` found
    for other_scores, other_rows in zip(scores[1:], chosen[1:]):
        assert torch.equal(other_scores, scores[0])
        assert torch.equal(other_rows, chosen[0])
    assert not bool((chosen[0] % 7 == 0).any())  # no blocked row while candidates are left


@pytest.mark.parametrize("layout", [KeyIndex, *FAST])
def test_a_blocked_row_is_chosen_only_when_too_few_others_are_left(layout):
    torch.manual_seed(5)
    index = filled(layout(H, D, CPU, CHANNELS), torch.randn(H, 100, D), [100])
    bias = torch.full((H, index.capacity), -float("inf"))
    bias[:, 40:50] = 0.0  # ten candidates
    rows = index.top(torch.randn(H, 3, D), 16, bias)
    for head in rows.tolist():
        assert set(range(40, 50)) <= set(head) and len(set(head)) == 16


@pytest.mark.parametrize("layout", FAST)
def test_a_planted_key_ranks_first(layout):
    torch.manual_seed(1)
    keys = 0.1 * torch.randn(H, 700, D)
    direction = torch.nn.functional.normalize(torch.randn(H, D), dim=-1)
    keys[:, 333] = 6.0 * direction
    index = filled(layout(H, D, CPU, CHANNELS), keys, [300, 1, 399])
    query = 2.0 * direction[:, None, :]
    assert index.scores(query).argmax(-1).tolist() == [333] * H
    assert index.top(query, 1).tolist() == [[333]] * H


@pytest.mark.parametrize("layout", FAST)
def test_a_copy_scores_the_same_and_grows_on_its_own(layout):
    torch.manual_seed(2)
    keys = torch.randn(H, 200, D)
    index = filled(layout(H, D, CPU, CHANNELS), keys, [130])
    twin = index.copy()
    query = torch.randn(H, 2, D)
    assert torch.equal(twin.scores(query), index.scores(query))
    twin.append(keys[:, 130:], torch.arange(130, 200))
    assert (twin.rows, index.rows) == (200, 130)
    assert torch.equal(twin.scores(query)[:, :130], index.scores(query))


@pytest.mark.parametrize(
    ("layout", "row_bytes"), [(KeyIndex, 16 + 8), *[pytest.param(p.values[0], 16 + 4, marks=p.marks) for p in FAST]]
)
def test_bytes_are_the_live_rows_at_the_layouts_cost(layout, row_bytes):
    index = filled(layout(H, D, CPU, CHANNELS), torch.randn(H, 100, D), [100])
    assert index.nbytes() == 100 * H * index.bytes_per_row()
    assert index.bytes_per_row() == row_bytes
