"""subgen: SubGen/ClusterGen, stream mode (key clusters + value-norm samples) and kcenter mode."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat import native
from kvchat.compress import _kcenter, make
from kvchat.compress.base import Compressor, LayerSpec
from kvchat.kv_types import Entries

MODES = ["stream", "kcenter"]
SINKS = RECENT = 256

# Chi-square critical values at alpha = 0.001 (fixed seeds: a correct sampler fails 1 in 1000).
CHI2_DF1_ALPHA001 = 10.828
CHI2_DF2_ALPHA001 = 13.816


def compressor(budget: int, heads: int = 3, dim: int = 64, seed: int = 0, **params) -> Compressor:
    spec = LayerSpec(0, heads, 1, dim, torch.device("cpu"), torch.float32, seed)
    return make("subgen", spec, budget, **params)


def middle_of(qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
    """Keys, values and positions [H, n] of the real middle (between sinks and recent)."""
    _, k, v = qkv
    n = k.shape[1]
    positions = torch.arange(SINKS, n - RECENT).expand(k.shape[0], -1).contiguous()
    return k[:, SINKS : n - RECENT].contiguous(), v[:, SINKS : n - RECENT].contiguous(), positions


def stream(comp: Compressor, keys, values, positions, batch: int, log_weights=None, check=None) -> None:
    """Ingest in batches of `batch` tokens, calling check() after each one."""
    for start in range(0, keys.shape[1], batch):
        part = slice(start, start + batch)
        weights = None if log_weights is None else log_weights[:, part]
        comp.ingest(keys[:, part], values[:, part], positions[:, part], weights)
        if check is not None:
            check()


def entries_per_head(entries: Entries) -> torch.Tensor:
    return (torch.isfinite(entries.log_num) | torch.isfinite(entries.log_den)).sum(1)


def synthetic(heads: int, n: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, dim, generator=gen)
    values = torch.randn(heads, n, dim, generator=gen)
    return keys, values, torch.arange(n).expand(heads, -1).contiguous()


# ------------------------------------------------------------------ common contract


@pytest.mark.parametrize("mode", MODES)
def test_reposition_applies_fn_to_every_stored_key_and_position(mode):
    keys, values, positions = synthetic(3, 400, 16)
    comp = compressor(80, dim=16, mode=mode)
    stream(comp, keys, values, positions, batch=64)
    before = comp.state_dict()
    comp.reposition(lambda k, p: (k * 2 + 1, p + 7))
    after = comp.state_dict()
    stored = [name for name in before if name.endswith("keys")]
    assert before["rep_keys" if mode == "stream" else "tok_keys"].numel() > 0
    for name in stored:
        positions_name = name.replace("keys", "positions")
        torch.testing.assert_close(after[name], before[name] * 2 + 1)
        torch.testing.assert_close(after[positions_name], before[positions_name] + 7)


# ------------------------------------------------------------------ stream mode


def test_stream_switches_to_split_numerator_and_denominator_samples_on_overflow():
    keys, values, positions = synthetic(3, 300, 16)
    comp = compressor(100, dim=16, mode="stream")
    comp.ingest(keys[:, :100], values[:, :100], positions[:, :100])
    assert torch.equal(comp.entries().keys, keys[:, :100])  # fits: exact tokens
    comp.ingest(keys[:, 100:], values[:, 100:], positions[:, 100:])
    e = comp.entries()
    finite_a, finite_b = torch.isfinite(e.log_num), torch.isfinite(e.log_den)
    assert not (finite_a & finite_b).any()  # every entry serves one side only
    assert finite_a.any(1).all() and finite_b.any(1).all()
    assert type(comp).split_weights


def test_stream_log_weights_make_sample_totals_exact():
    # Σ over numerator entries of exp(a)·||v||² is μ = Σ w·||v||² over all tokens, and
    # Σ over denominator entries of exp(b) is the total weight, for every random draw.
    keys, values, positions = synthetic(3, 500, 16)
    log_weights = torch.rand(positions.shape, generator=torch.Generator().manual_seed(2))
    comp = compressor(90, dim=16, mode="stream")
    for budget, part in [(90, slice(0, 200)), (30, slice(200, 350)), (300, slice(350, 500))]:
        comp.budget = budget  # slots thinned, then copied: the totals stay exact
        stream(comp, keys[:, part], values[:, part], positions[:, part], batch=64, log_weights=log_weights[:, part])
    e = comp.entries()
    numerator = torch.isfinite(e.log_num)
    mu = (log_weights.double().exp() * values.double().pow(2).sum(-1)).sum(1)
    estimated_mu = (e.log_num.double().exp() * e.values.double().pow(2).sum(-1) * numerator).sum(1)
    torch.testing.assert_close(estimated_mu, mu, rtol=1e-5, atol=0)
    torch.testing.assert_close(e.log_den.double().exp().sum(1), log_weights.double().exp().sum(1), rtol=1e-5, atol=0)


def test_stream_sample_slots_follow_the_budget_both_ways():
    # s is capped at half the budget (parameter 256), t so that 4 clusters fit in the rest (16).
    keys, values, positions = synthetic(3, 400, 16)
    comp = compressor(40, dim=16, mode="stream")
    for budget, start, slots, cluster_slots in [(40, 0, 20, 5), (400, 200, 200, 16), (10, 300, 5, 1)]:
        comp.budget = budget
        part = slice(start, start + 100)
        stream(comp, keys[:, part], values[:, part], positions[:, part], batch=50)
        state = comp.state_dict()
        assert (state["slots"], state["cluster_slots"]) == (slots, cluster_slots)
        assert state["num_counts"].sum(1).eq(slots).all()
        clusters = state["sizes"] > 0
        per_cluster = torch.zeros(state["sizes"].shape, dtype=torch.long)
        per_cluster.scatter_add_(1, state["den_owners"], state["den_counts"])
        assert per_cluster[clusters].eq(cluster_slots).all()


def test_stream_numerator_samples_tokens_in_proportion_to_weight_times_value_norm():
    # Three interleaved classes: norm 1 weight 1, norm 2 weight 1, norm 1 weight 4, so the
    # masses w·||v||² are 1 : 4 : 4. Every head is an independent reservoir of s slots.
    heads, n, dim, budget = 64, 60, 8, 40
    keys, _, positions = synthetic(heads, n, dim, seed=3)
    _, directions, _ = synthetic(heads, n, dim, seed=4)
    direction = torch.nn.functional.normalize(directions, dim=-1)
    cls = torch.arange(n) % 3
    values = direction * torch.tensor([1.0, 2.0, 1.0])[cls][None, :, None]
    log_weights = torch.tensor([0.0, 0.0, math.log(4)])[cls].expand(heads, -1).contiguous()
    comp = compressor(budget, heads=heads, dim=dim, mode="stream")
    stream(comp, keys, values, positions, batch=12, log_weights=log_weights)
    state = comp.state_dict()
    slots = state["slots"]
    drawn_class = cls[state["num_positions"].flatten()]
    observed = torch.zeros(3).index_add_(0, drawn_class, state["num_counts"].flatten().float())
    expected = torch.tensor([1.0, 4.0, 4.0]) / 9 * heads * slots
    assert observed.sum() == heads * slots
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF2_ALPHA001, (observed, expected)


def test_stream_cluster_samples_members_in_proportion_to_weight():
    # One tight cluster; members of weight 3 must be drawn 3x as often as those of weight 1.
    heads, n, dim = 64, 60, 8
    base = torch.randn(heads, 1, dim, generator=torch.Generator().manual_seed(5))
    keys = base + 0.001 * torch.randn(heads, n, dim, generator=torch.Generator().manual_seed(6))
    _, values, positions = synthetic(heads, n, dim, seed=7)
    heavy = torch.arange(n) % 2 == 1
    log_weights = (heavy * math.log(3)).float().expand(heads, -1).contiguous()
    comp = compressor(40, heads=heads, dim=dim, delta=1.0, mode="stream")
    stream(comp, keys, values, positions, batch=12, log_weights=log_weights)
    state = comp.state_dict()
    assert bool((state["sizes"] > 0).sum(1).eq(1).all())  # a single cluster per head
    counts, drawn = state["den_counts"].flatten(), state["den_positions"].flatten()
    observed = torch.stack([counts[~heavy[drawn]].sum(), counts[heavy[drawn]].sum()]).float()
    expected = torch.tensor([0.25, 0.75]) * observed.sum()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF1_ALPHA001, (observed, expected)


def test_stream_merged_cluster_samples_the_union_uniformly():
    # Two far-apart groups (10 and 30 tokens) form two clusters; a budget of 2 leaves room
    # for one, so they merge. The merged cluster's sample must come from the big group
    # with probability 31/41 (after one more member of it arrives).
    heads, dim = 120, 8
    gen = torch.Generator().manual_seed(8)
    centres = torch.zeros(2, dim)
    centres[1, 0] = 100.0
    group = torch.cat([torch.zeros(10), torch.ones(31)]).long()
    keys = (centres[group] + 0.01 * torch.randn(heads, 41, dim, generator=gen)).contiguous()
    _, values, positions = synthetic(heads, 41, dim, seed=9)
    comp = compressor(30, heads=heads, dim=dim, delta=1.0, mode="stream")
    comp.ingest(keys[:, :40], values[:, :40], positions[:, :40])
    assert bool((comp.state_dict()["sizes"] > 0).sum(1).eq(2).all())
    comp.budget = 2
    comp.ingest(keys[:, 40:], values[:, 40:], positions[:, 40:])
    state = comp.state_dict()
    assert bool((state["sizes"] > 0).sum(1).eq(1).all())
    drawn = group[state["den_positions"][:, 0]]
    observed = torch.stack([(drawn == 0).sum(), (drawn == 1).sum()]).float()
    expected = torch.tensor([10.0, 31.0]) / 41 * heads
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF1_ALPHA001, (observed, expected)


def test_stream_cluster_representatives_stay_more_than_delta_apart(real_qkv):
    keys, values, positions = middle_of(real_qkv[8])
    comp = compressor(keys.shape[1] // 4, mode="stream")
    deltas = []

    def separated():
        state = comp.state_dict()
        deltas.append(state["delta"].clone())
        for head in range(keys.shape[0]):
            reps = state["rep_keys"][head, state["sizes"][head] > 0].double()
            gaps = torch.cdist(reps, reps) + torch.diag(torch.full((len(reps),), math.inf, dtype=torch.float64))
            assert bool((gaps > state["delta"][head]).all())

    stream(comp, keys, values, positions, batch=64, check=separated)
    assert bool((deltas[-1] > deltas[0]).all())  # δ grew: merges were exercised


def test_stream_memory_grows_with_clusters_not_tokens():
    # 8 tight clusters of keys: 8x the tokens may only add the few numerator samples that
    # 1k tokens drew twice (the state is bounded by s + m·t unique entries).
    heads, dim = 3, 16
    gen = torch.Generator().manual_seed(10)
    centres = 10 * torch.randn(heads, 8, dim, generator=gen)

    def tokens(n: int):
        which = torch.randint(0, 8, (heads, n), generator=gen)
        keys = torch.gather(centres, 1, which[..., None].expand(-1, -1, dim))
        keys = keys + 0.01 * torch.randn(heads, n, dim, generator=gen)
        return keys, torch.randn(heads, n, dim, generator=gen)

    sizes = {}
    for n in (1_000, 8_000):
        comp = compressor(512, heads=heads, dim=dim, delta=1.0, mode="stream")
        keys, values = tokens(n)
        stream(comp, keys, values, torch.arange(n).expand(heads, -1).contiguous(), batch=500)
        assert bool((comp.state_dict()["sizes"] > 0).sum(1).eq(8).all())
        sizes[n] = comp.nbytes()
    assert sizes[8_000] <= 1.25 * sizes[1_000], sizes


# ------------------------------------------------------------------ kcenter mode


def hand_built_line():
    """One head, keys on a line at x = 0, 1, 2, 10, 11, 5 (oldest first); token i has value
    (0, i, 0, 0)."""
    keys = torch.zeros(1, 6, 4)
    keys[0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0, 5.0])
    values = torch.zeros(1, 6, 4)
    values[0, :, 1] = torch.arange(6.0)
    return keys, values, torch.arange(6)[None]


def test_kcenter_keeps_the_farthest_first_selection():
    # First centre: the oldest token (x=0); then the farthest from it (x=11); then the
    # farthest from {0, 11} (x=5, at distance 5). Kept in age order, as plain tokens.
    keys, values, positions = hand_built_line()
    comp = compressor(3, heads=1, dim=4, mode="kcenter")
    comp.ingest(keys, values, positions)
    e = comp.entries()
    assert e.positions.tolist() == [[0, 4, 5]]
    assert e.keys[0, :, 0].tolist() == [0.0, 11.0, 5.0]
    assert torch.equal(e.log_num, torch.zeros(1, 3)) and torch.equal(e.log_den, torch.zeros(1, 3))


def test_kcenter_streaming_evicts_the_younger_of_the_closest_pair():
    keys, values, positions = hand_built_line()
    comp = compressor(3, heads=1, dim=4, mode="kcenter")
    comp.ingest(keys[:, :4], values[:, :4], positions[:, :4])  # x = 0, 1, 2, 10: 1 is nearest 0, evicted
    assert comp.entries().positions.tolist() == [[0, 2, 3]]
    # {0, 2, 10} + {11, 5}: 11 goes (1 from 10), then 2 (2 from 0); 0, 10 and 5 remain.
    comp.ingest(keys[:, 4:], values[:, 4:], positions[:, 4:])
    assert comp.entries().keys[0, :, 0].tolist() == [0.0, 10.0, 5.0]


def test_kcenter_streaming_eviction_keeps_the_set_spread_like_farthest_first(real_qkv):
    # Streamed in batches of 64, the kept keys cover the middle about as well as one
    # farthest-first pass over all of it: the largest distance from a middle key to its
    # nearest kept key (the k-center objective) is at most twice the one-pass value.
    keys, values, positions = middle_of(real_qkv[8])
    budget = keys.shape[1] // 4
    streamed, once = compressor(budget, mode="kcenter"), compressor(budget, mode="kcenter")
    stream(streamed, keys, values, positions, batch=64)
    once.ingest(keys, values, positions)

    def radius(comp):
        return torch.cdist(keys.float(), comp.entries().keys.float()).min(2).values.max(1).values

    assert torch.all(radius(streamed) <= 2 * radius(once)), (radius(streamed), radius(once))


def closest_pair_reference(keys: torch.Tensor, surplus: int) -> list[int]:
    """The eviction rule written plainly, for one head [n, d]: `surplus` times, find the
    closest pair of live keys (the first row, then its first column, in age order, on ties)
    and drop its younger key. Returns the kept indices."""
    points = keys.double()
    dist = ((points[:, None, :] - points[None, :, :]) ** 2).sum(-1)
    dist.fill_diagonal_(math.inf)
    alive = list(range(points.shape[0]))
    for _ in range(surplus):
        sub = dist[alive][:, alive]
        row = int(sub.min(1).values.argmin())  # argmin returns the first of equal values
        col = int(sub[row].argmin())
        alive.remove(alive[max(row, col)])
    return alive


def test_kcenter_streaming_evicts_one_closest_pair_at_a_time(real_qkv):
    # Real keys (in bf16, the fast path's dtype: every squared distance is then exact in
    # float64, so any correct computation of it agrees to the bit) streamed in batches of
    # 64 over a full budget: each batch keeps exactly what the plain rule keeps from the
    # held keys plus the batch.
    keys, values, positions = middle_of(real_qkv[8])
    keys = keys.to(torch.bfloat16).float()
    budget, batch = 256, 64
    comp = compressor(budget, mode="kcenter")
    comp.ingest(keys[:, :budget], values[:, :budget], positions[:, :budget])
    for start in range(budget, budget + 6 * batch, batch):
        held = comp.entries()
        part = slice(start, start + batch)
        pool_keys = torch.cat([held.keys, keys[:, part]], 1)
        pool_positions = torch.cat([held.positions, positions[:, part]], 1)
        comp.ingest(keys[:, part], values[:, part], positions[:, part])
        for h in range(keys.shape[0]):
            kept = closest_pair_reference(pool_keys[h], batch)
            assert comp.entries().positions[h].tolist() == pool_positions[h, kept].tolist(), (start, h)


@pytest.mark.parametrize("weighting", ["none", "size"])
def test_kcenter_carried_neighbours_decide_as_a_recomputation_from_the_keys(real_qkv, weighting):
    # The nearest neighbours carried from batch to batch are a cache: a twin that forgets
    # them before every batch (as when loading a snapshot without them)
    # recomputes them from the held keys and keeps exactly the same entries.
    # The first batch overflows the budget by more than the budget (a flushed document):
    # farthest-first, after which the centres' neighbours are computed once.
    keys, values, positions = middle_of(real_qkv[15])
    carried = compressor(200, mode="kcenter", kcenter_weights=weighting)
    rebuilt = compressor(200, mode="kcenter", kcenter_weights=weighting)
    parts = [slice(0, 500)] + [slice(start, start + 64) for start in range(500, keys.shape[1], 64)]
    for part in parts:
        start = part.start
        state = rebuilt.state_dict()
        forgotten = {name: value for name, value in state.items() if name not in ("nn_dist", "nn_partner")}
        rebuilt.load_state_dict(forgotten)
        for comp in (carried, rebuilt):
            comp.ingest(keys[:, part], values[:, part], positions[:, part])
        a, b = carried.entries(), rebuilt.entries()
        assert torch.equal(a.positions, b.positions) and torch.equal(a.log_num, b.log_num), start
        state = carried.state_dict()
        if state["nn_partner"].shape[1]:
            # What is carried: each held key's nearest other held key and its squared
            # distance, or (partner -1) a lower bound of that distance.
            points = a.keys.double()
            true = torch.cdist(points, points).pow(2)
            true.diagonal(dim1=1, dim2=2).fill_(math.inf)
            nearest = true.min(2).values
            known = state["nn_partner"] >= 0
            torch.testing.assert_close(state["nn_dist"][known], nearest[known])
            partner_dist = true.gather(2, state["nn_partner"].clamp_min(0)[..., None])[..., 0]
            torch.testing.assert_close(partner_dist[known], nearest[known])
            assert bool((state["nn_dist"][~known] <= nearest[~known] * (1 + 1e-9)).all())
    assert carried.state_dict()["nn_partner"].shape[1] == 200  # it did carry them


@pytest.mark.parametrize(
    ("weighting", "sizes", "last_value"),
    [("size", [3.0, 2.0, 1.0], [0.0, 4.0, 0.0, 0.0]), ("mean", [3.0, 2.0, 1.0], [0.0, 3.5, 0.0, 0.0])],
)
def test_kcenter_weight_options_count_the_tokens_nearest_each_centre(weighting, sizes, last_value):
    # Nearest centre: x=0 takes {0, 1, 2}, x=11 takes {10, 11}, x=5 only itself.
    keys, values, positions = hand_built_line()
    comp = compressor(3, heads=1, dim=4, mode="kcenter", kcenter_weights=weighting)
    comp.ingest(keys, values, positions)
    e = comp.entries()
    torch.testing.assert_close(e.log_num.exp(), torch.tensor([sizes]))
    torch.testing.assert_close(e.log_den, e.log_num)
    torch.testing.assert_close(e.values[0, 1], torch.tensor(last_value))  # centre x=11, with x=10


def test_split_weights_is_true_for_stream_mode_only():
    # The cache takes the slower two-sum attention path for split-weight compressors; it
    # reads the flag per instance, so kcenter (a = b) is not sent through it.
    for weighting in ("none", "size", "mean"):
        assert compressor(100, mode="kcenter", kcenter_weights=weighting).split_weights is False
    assert compressor(100, mode="stream").split_weights is True


@pytest.mark.parametrize("weighting", ["none", "size", "mean"])
def test_kcenter_entries_have_one_weight_so_the_fused_path_is_exact(weighting):
    # Every kcenter entry has a == b, whether it came in with a weight (a method switch),
    # was chosen by farthest-first (the first, large batch) or survived streaming
    # evictions (later batches): the one-sum attention with bias a is then exactly the
    # two-sum form, which is what lets the cache use the fused kernel for it.
    from kvchat.cache.attention import segment_attention

    keys, values, positions = synthetic(3, 700, 16)
    log_weights = torch.rand(positions.shape, generator=torch.Generator().manual_seed(4))
    query = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(5))
    comp = compressor(100, dim=16, mode="kcenter", kcenter_weights=weighting)

    def check():
        e = comp.entries()
        assert torch.equal(e.log_num, e.log_den)
        segment = [(e.keys, e.values, e.log_num, e.log_den)]
        fused, _ = segment_attention(query, segment, 0.25, causal_last=False, split=False, want_mass=False)
        split, _ = segment_attention(query, segment, 0.25, causal_last=False, split=True, want_mass=False)
        torch.testing.assert_close(fused, split)

    comp.ingest(keys[:, :300], values[:, :300], positions[:, :300], log_weights[:, :300])  # farthest-first
    check()
    stream(
        comp,
        keys[:, 300:],
        values[:, 300:],
        positions[:, 300:],
        batch=64,
        log_weights=log_weights[:, 300:],
        check=check,
    )
    assert comp.entries().log_num.abs().sum() > 0  # weights really were carried


# ------------------------------------------------------------------ stream estimators


UNBIASED_SEEDS = 200
Z_LIMIT = 4.0  # |mean - exact| <= 4 standard errors: a correct estimator fails ~1 in 15,000


def test_stream_estimators_are_unbiased_for_a_nonzero_query():
    # For one fixed query q (scores <q, k>/sqrt d spread over about +-2), the sampled
    # numerator sum_j e^(a_j + s_j) v_j and denominator sum_j e^(b_j + s_j) must average,
    # over independent seeds, to the exact sum_i e^(s_i) v_i and sum_i e^(s_i): checked on
    # the denominator and on the numerator's projection onto two fixed directions, each
    # within Z_LIMIT standard errors of the seed mean. Streamed in batches of 50 into a
    # budget of 100, so reservoir replacements and cluster merges both happen.
    heads, n, dim = 1, 400, 16
    keys, values, positions = synthetic(heads, n, dim, seed=3)
    query = torch.randn(dim, generator=torch.Generator().manual_seed(11))
    scale = dim**-0.5
    exact_num = torch.exp(keys[0] @ query * scale).double() @ values[0].double()
    exact_den = torch.exp(keys[0] @ query * scale).double().sum()
    directions = torch.stack(
        [exact_num / exact_num.norm(), torch.nn.functional.normalize(torch.ones(dim), dim=0).double()]
    )

    numerators, denominators = [], []
    for seed in range(UNBIASED_SEEDS):
        comp = compressor(100, heads=heads, dim=dim, seed=seed, mode="stream")
        stream(comp, keys, values, positions, batch=50)
        e = comp.entries()
        scores = (e.keys[0] @ query * scale).double()
        numerators.append(torch.exp(e.log_num[0].double() + scores) @ e.values[0].double())
        denominators.append(torch.exp(e.log_den[0].double() + scores).sum())

    estimates = torch.cat([torch.stack(numerators) @ directions.T, torch.stack(denominators)[:, None]], 1)
    exact = torch.cat([directions @ exact_num, exact_den[None]])
    standard_error = estimates.std(0) / UNBIASED_SEEDS**0.5
    assert (standard_error > 0).all(), "the estimates must actually be sampled"
    z = (estimates.mean(0) - exact) / standard_error
    assert (z.abs() <= Z_LIMIT).all(), (estimates.mean(0), exact, z)


needs_native_farthest = pytest.mark.skipif(
    not native.built("farthest"), reason="kvchat.native._farthest not built (no C compiler at install)"
)


def farthest_both_ways(keys: torch.Tensor, k: int):
    """farthest_first's (centres, owners) with kvchat's kernel and with the torch loop."""
    results = []
    for kernel in (True, False):
        with native.kernels(farthest=kernel):
            results.append(_kcenter.farthest_first(keys, k, track_owner=True))
    return results


@needs_native_farthest
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1000, 1003])  # whole tiles of 16 points, and a part tile
def test_the_native_farthest_first_picks_the_centres_the_torch_loop_picks(dtype, n):
    """kvchat/native/_farthest.c against the torch loop on random keys (3 KV heads of 64
    channels, 250 centres): the same centres and every point's same centre."""
    keys = (3 * torch.randn(3, n, 64, generator=torch.Generator().manual_seed(5))).to(dtype)
    (kernel, kernel_owner), (loop, loop_owner) = farthest_both_ways(keys, 250)
    assert torch.equal(kernel, loop)
    assert torch.equal(kernel_owner, loop_owner)


@needs_native_farthest
def test_the_native_farthest_first_keeps_the_real_middle_the_torch_loop_keeps(real_qkv):
    keys, _, _ = middle_of(real_qkv[8])
    (kernel, kernel_owner), (loop, loop_owner) = farthest_both_ways(keys, keys.shape[1] // 4)
    assert torch.equal(kernel, loop)
    assert torch.equal(kernel_owner, loop_owner)


@needs_native_farthest
def test_the_farthest_kernel_s_scalar_path_gives_its_vector_path_s_centres():
    """The kernel's two paths (AVX-512, and the plain loop other CPUs run) compute the same
    numbers: the same centres and owners, on a CPU that has both."""
    if not native.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512: only the plain loop runs here")
    keys = torch.randn(2, 701, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    runs = []
    for vector in (True, False):
        with native.kernels(avx512=vector):
            runs.append(_kcenter.farthest_first(keys, 200, track_owner=True))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
