"""`chelsea`: chunked soft matching (docs/methods.md, "chelsea")."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat import compress
from kvchat.cache.attention import weighted_attention
from kvchat.compress.base import LayerSpec
from kvchat.compress.chelsea import compression_ratio, outlier_fraction, select_outlier_heads

SINKS = RECENT = 256
HEAD_DIM = 64


def make(budget: int, heads: int = 3, **params):
    spec = LayerSpec(
        layer=0, num_kv_heads=heads, group_size=1, head_dim=HEAD_DIM, device=torch.device("cpu"), dtype=torch.float32
    )
    return compress.make("chelsea", spec, budget, **params)


def random_tokens(n: int, heads: int = 3, seed: int = 0, start: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, HEAD_DIM, generator=gen)
    values = torch.randn(heads, n, HEAD_DIM, generator=gen)
    positions = torch.arange(start, start + n).expand(heads, -1).contiguous()
    return keys, values, positions


def valid(entries) -> torch.Tensor:
    return torch.isfinite(entries.log_num)


def real_middle(real_qkv, layer: int):
    q, k, v = real_qkv[layer]
    n = k.shape[1]
    middle = slice(SINKS, n - RECENT)
    positions = torch.arange(n)[middle].expand(k.shape[0], -1).contiguous()
    return q[:, n - RECENT :], k[:, middle].contiguous(), v[:, middle].contiguous(), positions


def test_every_parameter_is_documented():
    cls = compress.get("chelsea")
    assert set(cls.param_help) == set(cls.defaults)
    assert cls.defaults["chunk"] == 256 and cls.defaults["g"] == 64


@pytest.mark.parametrize("batch", [None, 64])
def test_budget_above_tokens_gives_exact_attention(real_qkv, batch):
    queries, keys, values, positions = real_middle(real_qkv, 8)
    comp = make(budget=keys.shape[1])
    step = batch or keys.shape[1]
    for start in range(0, keys.shape[1], step):
        part = slice(start, start + step)
        comp.ingest(keys[:, part], values[:, part], positions[:, part])
    e = comp.entries()
    scale = HEAD_DIM**-0.5
    approx, _ = weighted_attention(queries, e.keys, e.values, e.log_num, e.log_den, scale)
    zeros = torch.zeros(positions.shape)
    exact, _ = weighted_attention(queries, keys, values, zeros, zeros, scale)
    assert torch.allclose(approx, exact, atol=1e-6)


def test_weighted_entries_with_room_are_kept_as_given():
    keys, values, positions = random_tokens(50)
    weights = torch.log(torch.randint(1, 6, (3, 50)).float())
    comp = make(budget=50)
    comp.ingest(keys, values, positions, log_weights=weights)
    e = comp.entries()
    assert torch.equal(e.keys, keys) and torch.equal(e.values, values)
    assert torch.equal(e.log_num, weights) and torch.equal(e.log_den, weights)


def test_streaming_respects_a_changing_hard_budget():
    comp = make(budget=200)
    gen = torch.Generator().manual_seed(1)
    seen = 0
    for step in range(60):
        if step == 20:
            comp.budget = 120  # the cache may lower the budget between calls ...
        if step == 40:
            comp.budget = 300  # ... or raise it
        size = int(torch.randint(1, 100, (1,), generator=gen))
        comp.ingest(*random_tokens(size, seed=step, start=seen))
        seen += size
        assert valid(comp.entries()).sum(1).max() <= comp.budget
    assert len(comp) > 0


def test_degrees_sum_to_the_tokens_absorbed():
    comp = make(budget=40)
    total = torch.zeros(3)
    for step in range(10):
        counts = torch.randint(1, 6, (3, 30), generator=torch.Generator().manual_seed(step)).float()
        comp.ingest(*random_tokens(30, seed=step, start=30 * step), log_weights=torch.log(counts))
        total += counts.sum(1)
    e = comp.entries()
    degrees = torch.exp(e.log_num).sum(1)  # padding: exp(-inf) = 0
    assert valid(e).sum(1).max() <= 40
    assert torch.allclose(degrees, total, rtol=1e-5)


def test_duplicated_token_merges_into_one_entry_with_the_same_attention():
    copies = 6
    key, value, _ = random_tokens(1, heads=1, seed=3)
    context_keys, context_values, _ = random_tokens(8, heads=1, seed=4)
    comp = make(budget=1, heads=1)
    comp.ingest(key.expand(1, copies, -1), value.expand(1, copies, -1), torch.arange(copies)[None])
    e = comp.entries()
    assert e.length == 1
    assert torch.allclose(e.log_num, torch.tensor([[math.log(copies)]]))
    assert torch.allclose(e.keys, key) and torch.allclose(e.values, value)

    query = torch.randn(1, 4, HEAD_DIM, generator=torch.Generator().manual_seed(5)) * 3
    scale = HEAD_DIM**-0.5
    merged_weights = torch.cat([torch.zeros(1, 8), e.log_num], 1)
    merged, _ = weighted_attention(
        query,
        torch.cat([context_keys, e.keys], 1),
        torch.cat([context_values, e.values], 1),
        merged_weights,
        merged_weights,
        scale,
    )
    zeros = torch.zeros(1, 8 + copies)
    expanded, _ = weighted_attention(
        query,
        torch.cat([context_keys, key.expand(1, copies, -1)], 1),
        torch.cat([context_values, value.expand(1, copies, -1)], 1),
        zeros,
        zeros,
        scale,
    )
    assert torch.allclose(merged, expanded, atol=1e-6)


def test_clusters_keep_token_order_and_their_b_token_position(real_qkv):
    _, keys, values, positions = real_middle(real_qkv, 15)
    comp = make(budget=keys.shape[1] // 4)
    comp.ingest(keys, values, positions)
    e = comp.entries()
    assert e.length == keys.shape[1] // 4
    assert (e.positions[:, 1:] > e.positions[:, :-1]).all()
    assert torch.isin(e.positions, positions[0]).all()  # a cluster sits at one of its tokens' positions


def test_a_big_batch_lands_on_budget_and_small_batches_cluster_once_per_g_tokens():
    comp = make(budget=300, g=64)
    comp.ingest(*random_tokens(1000))
    assert len(comp) == 300  # a batch of >= g tokens is itself the overshoot
    clustered_at = []
    for token in range(200):
        before = len(comp)
        comp.ingest(*random_tokens(1, seed=token, start=1000 + token))
        assert len(comp) <= 300
        if len(comp) < before + 1:
            clustered_at.append(token)
    assert clustered_at == [0, 64, 128, 192]


def test_compression_ratio_follows_the_paper_schedules():
    def schedule(r_init, r_step, r_steps, steps=5):
        return [round(compression_ratio(i, r_init, r_step, r_steps, r_min=0.05), 6) for i in range(steps)]

    assert schedule(0.45, 0.05, 3) == [0.45, 0.40, 0.35, 0.30, 0.30]  # Llama-2-7B-32K
    assert schedule(0.35, 0.1, 2) == [0.35, 0.25, 0.15, 0.15, 0.15]  # Llama-3.1-8B
    assert schedule(0.2, 0.1, 2) == [0.2, 0.1, 0.05, 0.05, 0.05]  # Qwen2-7B, clamped above 0


def test_outlier_heads_keep_their_newest_tokens_exactly(real_qkv):
    _, keys, values, positions = real_middle(real_qkv, 8)
    budget = 100
    comp = make(budget=budget, outlier_heads="1")
    for start in range(0, keys.shape[1], 64):
        part = slice(start, start + 64)
        comp.ingest(keys[:, part], values[:, part], positions[:, part])
    e = comp.entries()
    assert torch.equal(e.keys[1], keys[1, -budget:])
    assert torch.equal(e.values[1], values[1, -budget:])
    assert torch.equal(e.positions[1], positions[1, -budget:])
    assert (e.log_num[1] == 0).all()
    assert (e.log_num[0][valid(e)[0]] > 0).any()  # the other heads cluster


def test_full_outlier_cache_keeps_every_token_of_an_outlier_head(real_qkv):
    _, keys, values, positions = real_middle(real_qkv, 8)
    comp = make(budget=100, outlier_heads="1", outlier_cache="full")
    for start in range(0, keys.shape[1], 64):
        part = slice(start, start + 64)
        comp.ingest(keys[:, part], values[:, part], positions[:, part])
    e = comp.entries()
    assert torch.equal(e.keys[1], keys[1]) and torch.equal(e.positions[1], positions[1])
    assert valid(e)[0].sum() <= 100 and valid(e)[2].sum() <= 100  # the other heads keep the budget


def direction(cosine: float, along: torch.Tensor, across: int) -> torch.Tensor:
    """A unit key at `cosine` to the unit key `along`, turned towards basis vector `across`."""
    return cosine * along + math.sqrt(1 - cosine**2) * torch.eye(HEAD_DIM)[across]


def test_one_step_merges_the_global_top_e_of_the_chunk_local_best_cosine_pairs():
    # Two chunks of 4 entries; A = even slots, B = odd slots of each chunk. The chunk-local
    # best edges are 0->1 (cos .9), 2->3 (.6), 4->5 (.95), 6->7 (.7). Entry 4 is a copy of
    # entry 1, so a global (unchunked) matching would pair 4 with 1 at cos 1.
    e = torch.eye(HEAD_DIM)
    k1 = direction(0.9, e[0], 1)
    keys = torch.stack(
        [e[0], k1, e[2], direction(0.6, e[2], 3), k1, direction(0.95, k1, 4), e[5], direction(0.7, e[5], 6)]
    )[None]
    values = torch.randn(1, 8, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    comp = make(budget=6, heads=1, chunk=4, g=1)  # g=1: cluster straight down to the budget
    comp.ingest(keys, values, torch.arange(8)[None])
    # E = min(floor(0.35 * 8), 8 - 6) = 2: the two best edges overall, 4->5 and 0->1.
    got = comp.entries()
    assert got.positions.tolist() == [[1, 2, 3, 5, 6, 7]]
    assert torch.allclose(got.log_num, torch.log(torch.tensor([[2.0, 1, 1, 2, 1, 1]])))
    assert torch.allclose(got.keys[0, 0], (keys[0, 0] + keys[0, 1]) / 2)
    assert torch.allclose(got.keys[0, 3], (keys[0, 4] + keys[0, 5]) / 2)
    assert torch.allclose(got.values[0, 3], (values[0, 4] + values[0, 5]) / 2)
    assert torch.equal(got.keys[0, [1, 2, 4, 5]], keys[0, [2, 3, 6, 7]])  # untouched entries stay exact


def test_calibrate_names_the_heads_whose_keys_cluster_worst():
    gen = torch.Generator().manual_seed(0)
    centre = torch.randn(1, 1, HEAD_DIM, generator=gen)
    clusterable = centre + 0.05 * torch.randn(2, 512, HEAD_DIM, generator=gen)  # near-duplicates
    scattered = torch.randn(1, 512, HEAD_DIM, generator=gen)  # no partner at cosine > 0.8
    keys = {
        layer: [torch.cat([clusterable, scattered]) if layer == 7 else torch.cat([clusterable, clusterable[:1]])]
        for layer in range(9)
    }  # 27 (layer, head) pairs: the top 4% is one head
    params = compress.get("chelsea").calibrate(keys)
    assert params[7] == {"outlier_heads": "2"}
    assert all(params[layer] == {"outlier_heads": ""} for layer in range(9) if layer != 7)


def test_zero_weight_entries_are_not_stored_and_heads_become_ragged():
    keys, values, positions = random_tokens(10)
    weights = torch.zeros(3, 10)
    weights[0, :4] = float("-inf")  # padding re-streamed from a ragged method
    comp = make(budget=100)
    comp.ingest(keys, values, positions, log_weights=weights)
    e = comp.entries()
    assert valid(e).sum(1).tolist() == [6, 10, 10]
    assert torch.equal(e.keys[0, :6], keys[0, 4:])
    assert (e.log_num[0, 6:] == float("-inf")).all() and (e.keys[0, 6:] == 0).all()


def ragged_stream(comp, steps: range) -> None:
    for step in steps:
        weights = torch.log(torch.randint(1, 4, (3, 48), generator=torch.Generator().manual_seed(step)).float())
        weights[2, ::5] = float("-inf")
        comp.ingest(*random_tokens(48, seed=step, start=48 * step), log_weights=weights)


def test_reposition_applies_fn_to_every_stored_key():
    comp = make(budget=90)
    ragged_stream(comp, range(6))
    before = comp.entries()
    comp.reposition(lambda keys, positions: (keys * 2, positions - 7))
    after = comp.entries()
    mask = valid(before)
    assert torch.equal(after.keys[mask], before.keys[mask] * 2)
    assert torch.equal(after.positions[mask], before.positions[mask] - 7)
    assert torch.equal(after.values, before.values)


def test_outlier_fraction_separates_clusterable_from_scattered_heads():
    gen = torch.Generator().manual_seed(6)
    shared = torch.randn(1, 1, HEAD_DIM, generator=gen)
    clusterable = shared + 0.1 * torch.randn(1, 512, HEAD_DIM, generator=gen)
    scattered = torch.randn(1, 512, HEAD_DIM, generator=gen)
    fractions = outlier_fraction(torch.cat([clusterable, scattered]))
    assert fractions.tolist() == [0.0, 1.0]


def test_select_outlier_heads_takes_the_top_share_of_all_heads():
    fractions = {0: torch.tensor([0.1, 0.9]), 1: torch.tensor([0.5, 0.2]), 2: torch.tensor([0.95, 0.0])}
    assert select_outlier_heads(fractions, share=2 / 6) == {0: [1], 1: [], 2: [0]}


def test_calibration_runs_on_standard_library_text_and_is_cached_per_model(embedded_fast, tmp_path, monkeypatch):
    import json

    from kvchat.calibration import calibrate

    shipped_dir = calibrate.SHIPPED
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))  # not the repository's models folder
    monkeypatch.setattr(calibrate, "SHIPPED", None)  # measured here, not read from kvchat/calibration/measured
    chelsea = compress.get("chelsea")
    params = calibrate.calibrated_layer_params(embedded_fast, chelsea)
    chosen = [head for layer in params.values() for head in layer["outlier_heads"].split(",") if head]
    assert len(chosen) == round(0.04 * embedded_fast.num_layers * embedded_fast.num_kv_heads)
    path = calibrate.calibration_path("chelsea", embedded_fast.fingerprint)
    saved = json.loads(path.read_text())
    assert saved["source"] == "pydoc_data.topics"
    assert calibrate.calibrated_layer_params(embedded_fast, chelsea) == params  # read back from the file
    # What kvchat ships for the embedded_fast model is this measurement.
    assert json.loads((shipped_dir / path.name).read_text())["layers"] == saved["layers"]
