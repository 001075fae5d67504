"""bumblebee (kvchat/compress/bumblebee.py): streaming submodular summarisation.

The objective is recomputed here from its definition, g = lam * f_FL + (1 - lam) * c with
f_FL(A) = (1/|V|) sum_{v in V} max_{a in A} sim(v, a) (the mean coverage of V, so that the
greedy and the streaming rule weigh it alike), sim = (1 + cos)/2, and
c(A) = sum_u phi(sum_{a in A} m_u(a)), so that the tests do not reuse the method's code.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvchat import compress, native
from kvchat.cache.attention import weighted_attention
from kvchat.calibration.evaluate import attention_error, compress_middle, uniform_middle
from kvchat.compress.base import LayerSpec
from kvchat.runtime import cpu_has_fast_bf16

SINKS = RECENT = 256


def make_bee(budget: int, *, heads: int = 2, group: int = 2, dim: int = 8, seed: int = 0, **params):
    spec = LayerSpec(0, heads, group, dim, torch.device("cpu"), torch.float32, seed)
    return compress.make("bumblebee", spec, budget, **params)


def random_tokens(gen: torch.Generator, start: int, count: int, *, heads=2, group=2, dim=8):
    """keys, values, positions [start, start + count), scores: a synthetic batch."""
    keys = torch.randn(heads, count, dim, generator=gen)
    values = torch.randn(heads, count, dim, generator=gen)
    positions = torch.arange(start, start + count).expand(heads, -1).contiguous()
    scores = torch.rand(heads, group, count, generator=gen)
    return keys, values, positions, scores


def phi_reference(x: float, phi: str, alpha: float, beta: float) -> float:
    """phi(x), the power family inverted by bisection (independent of the method's Newton)."""
    if phi == "log":
        return math.log1p(x)

    def g(y: float) -> float:
        return alpha * y ** (1 / alpha) + beta * y

    low, high = 0.0, 1.0
    while g(high) < x:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if g(mid) < x else (low, mid)
    return (low + high) / 2


def similarity(keys: torch.Tensor) -> torch.Tensor:
    """sim(i, j) = (1 + cos(k_i, k_j)) / 2 for keys [n, d], in float64."""
    unit = torch.nn.functional.normalize(keys.double(), dim=-1)
    return (1 + unit @ unit.T) / 2


def objective(sim: torch.Tensor, mass: torch.Tensor, *, lam, phi, alpha, beta):
    """g_lambda(members) for one KV head as a function of the member indices, every token
    of sim [n, n] in the ground set V (weight 1 each); mass [G, n] is the accumulated
    attention per query head. Plain Python arithmetic: the sets are tiny."""
    sim_rows, mass_rows = sim.tolist(), mass.tolist()

    def g(members) -> float:
        members = list(members)
        diversity = sum(max(row[a] for a in members) for row in sim_rows) / len(sim_rows)
        importance = sum(phi_reference(sum(m[a] for a in members), phi, alpha, beta) for m in mass_rows)
        return lam * diversity + (1 - lam) * importance

    return g


def scores_by_position(bee) -> list[dict[int, torch.Tensor]]:
    """Per head: position -> accumulated score [G] of each kept entry."""
    state = bee.state_dict()
    return [
        {int(p): state["scores"][h, :, j] for j, p in enumerate(state["positions"][h])}
        for h in range(state["positions"].shape[0])
    ]


def test_registered_with_a_help_line_for_every_parameter():
    cls = compress.get("bumblebee")
    assert cls.name == "bumblebee" and cls.needs_attention
    assert set(cls.param_help) == set(cls.defaults)
    assert cls.defaults["lam"] == 0.5 and cls.defaults["alpha"] == 0.5 and cls.defaults["beta"] == 1.0


@pytest.mark.parametrize(
    "params", [{"phi": "cubic"}, {"lam": 1.5}, {"normalize": "zscore"}, {"alpha": 1.5}, {"tau": 3}]
)
def test_invalid_parameters_are_refused(params):
    with pytest.raises(ValueError):
        make_bee(8, **params)


def test_budget_covering_everything_gives_exact_attention_on_real_data(real_qkv):
    q, k, v = real_qkv[8]
    h, n, d = k.shape
    mid = slice(SINKS, n - RECENT)
    keys, values = k[:, mid].contiguous(), v[:, mid].contiguous()
    size = keys.shape[1]
    positions = torch.arange(SINKS, n - RECENT).expand(h, -1).contiguous()
    group = q.shape[0] // h
    bee = make_bee(size, heads=h, group=group, dim=d)
    for start in range(0, size, 64):
        part = slice(start, start + 64)
        scores = torch.rand(h, group, keys[:, part].shape[1])
        bee.ingest(keys[:, part], values[:, part], positions[:, part], scores=scores)
    e = bee.entries()
    assert e.length == size and torch.equal(e.positions, positions)
    queries = q[:, -32:]
    approx, _ = weighted_attention(queries, e.keys, e.values, e.log_num, e.log_den, d**-0.5)
    exact, _ = weighted_attention(queries, keys, values, torch.zeros(h, size), torch.zeros(h, size), d**-0.5)
    torch.testing.assert_close(approx, exact, rtol=1e-5, atol=1e-6)


def test_weighted_entries_keep_their_weights_when_everything_fits():
    gen = torch.Generator().manual_seed(1)
    keys, values, positions, scores = random_tokens(gen, 0, 12)
    weights = torch.rand(2, 12, generator=gen) * 3
    bee = make_bee(20)
    for part in (slice(0, 5), slice(5, 12)):
        bee.ingest(
            keys[:, part], values[:, part], positions[:, part], log_weights=weights[:, part], scores=scores[..., part]
        )
    e = bee.entries()
    assert torch.equal(e.keys, keys) and torch.equal(e.values, values)
    assert torch.equal(e.log_num, weights) and torch.equal(e.log_den, weights)


def test_streaming_respects_a_hard_budget_as_it_changes(real_qkv):
    q, k, v = real_qkv[1]
    h, n, d = k.shape
    group = q.shape[0] // h
    bee = make_bee(40, heads=h, group=group, dim=d)
    for step, start in enumerate(range(0, 600, 7)):
        if step == 40:
            bee.budget = 25  # the cache lowered a percentage budget
        if step == 60:
            bee.budget = 50
        part = slice(start, start + 7)
        positions = torch.arange(n)[part].expand(h, -1)
        bee.ingest(k[:, part], v[:, part], positions, scores=torch.rand(h, group, 7))
        e = bee.entries()
        assert e.length <= bee.budget
        assert e.keys.shape[:2] == e.positions.shape == e.log_num.shape
        bee.observe(torch.rand(h, group, e.length))
    assert e.length == 50


def test_each_kv_head_is_summarised_on_its_own(real_qkv):
    """A head keeps the same tokens whatever the other heads hold: evictions are decided
    per head, each head taking as many per round as its own ranking allows. The other KV
    heads (and their query heads) are swapped for another layer's."""
    layers = sorted(real_qkv)
    for layer, swap in zip(layers, layers[1:] + layers[:1]):
        q, k, v = real_qkv[layer]
        other_q, other_k, _ = real_qkv[swap]
        group = q.shape[0] // k.shape[0]
        q2, k2 = q.clone(), k.clone()
        q2[group:], k2[1:] = other_q[group:], other_k[1:]
        budget = (k.shape[1] - SINKS - RECENT) // 4
        kept = [
            compress_middle(
                "bumblebee",
                qq,
                kk,
                v,
                budget=budget,
                sinks=SINKS,
                recent=RECENT,
                layer=layer,
                batch=64,
                params={"greedy_max": 0},
            ).positions[0]
            for qq, kk in ((q, k), (q2, k2))
        ]
        assert torch.equal(kept[0], kept[1])


def test_a_flush_streams_in_pieces_like_decode_batches():
    """A batch of hundreds of tokens that the offline greedy does not take (the flush of a
    held prefill past greedy_max) is streamed in pieces of STREAM_BATCH, each like a decode
    batch, not as one piece quadratic in its size."""
    from kvchat.compress.bumblebee import STREAM_BATCH

    gen = torch.Generator().manual_seed(13)
    count = 2 * STREAM_BATCH + 40
    keys, values, positions, scores = random_tokens(gen, 0, count)
    whole, pieces = make_bee(32, greedy_max=0), make_bee(32, greedy_max=0)  # no offline greedy
    whole.ingest(keys, values, positions, scores=scores)
    for first in range(0, count, STREAM_BATCH):
        part = slice(first, first + STREAM_BATCH)
        pieces.ingest(keys[:, part], values[:, part], positions[:, part], scores=scores[..., part])
    assert whole.entries().length == 32
    assert torch.equal(whole.entries().positions, pieces.entries().positions)
    assert torch.equal(whole.entries().keys, pieces.entries().keys)


def test_a_batch_larger_than_the_budget_is_cut_to_the_budget():
    gen = torch.Generator().manual_seed(2)
    bee = make_bee(16)
    keys, values, positions, scores = random_tokens(gen, 0, 100)
    bee.ingest(keys, values, positions, scores=scores)
    assert bee.entries().length == 16
    bee.budget = 0
    bee.ingest(*random_tokens(gen, 100, 4)[:3])
    assert bee.entries().length == 0


def test_reposition_moves_every_key_and_rebuilds_the_neighbour_cache():
    gen = torch.Generator().manual_seed(5)
    bee = make_bee(10)
    for start in range(0, 40, 8):
        keys, values, positions, scores = random_tokens(gen, start, 8)
        bee.ingest(keys, values, positions, scores=scores)
    before = bee.entries()

    def shift(keys, positions):  # any re-rotation: a fixed rotation of the coordinate pairs
        return torch.cat([-keys[..., 4:], keys[..., :4]], -1) + positions[..., None] * 0.01, positions - 3

    bee.reposition(shift)
    expected_keys, expected_positions = shift(before.keys, before.positions)
    after = bee.entries()
    assert torch.equal(after.keys, expected_keys) and torch.equal(after.positions, expected_positions)
    assert torch.equal(after.values, before.values)
    others = -10 * torch.eye(after.length)  # a key is not its own neighbour
    nearest = torch.stack([(similarity(keys) + others).max(-1).values for keys in after.keys])
    torch.testing.assert_close(bee.state_dict()["nn_sim"], nearest.float())


@pytest.mark.parametrize(("phi", "alpha", "beta"), [("log", 0.5, 1.0), ("power", 0.5, 1.0), ("power", 0.3, 0.5)])
def test_each_swap_does_not_lower_the_objective(phi, alpha, beta):
    """Algorithm 2: when a candidate is swapped in, g(S' - evicted) >= g(S) on V = S'."""
    gen = torch.Generator().manual_seed(6)
    params = dict(lam=0.5, phi=phi, alpha=alpha, beta=beta)
    bee = make_bee(6, **params)
    swaps = 0
    for t in range(60):
        keys, values, positions, scores = random_tokens(gen, t, 1)
        state = bee.state_dict()
        bee.ingest(keys, values, positions, scores=scores)
        if state["positions"].shape[1] < 6:
            continue
        after = bee.state_dict()
        for h in range(2):
            sim = similarity(torch.cat([state["keys"][h], keys[h]]))
            ground_mass = torch.cat([state["scores"][h], scores[h].double()], 1)
            ground_pos = torch.cat([state["positions"][h], positions[h]]).tolist()
            kept = [ground_pos.index(p) for p in after["positions"][h].tolist()]
            if 6 not in kept:
                continue  # the candidate itself was evicted: the summary is unchanged
            swaps += 1
            g = objective(sim, ground_mass, **params)
            assert g(kept) >= g(range(6)) - 1e-6
        bee.observe(0.05 * torch.rand(2, 2, bee.entries().length, generator=gen))
    assert swaps >= 5  # the property was exercised, not skipped


def test_the_evicted_member_is_the_one_whose_removal_costs_least():
    """argmin_i g(i | S' - i) over S' = S + candidate, with g from its definition."""
    gen = torch.Generator().manual_seed(7)
    params = dict(lam=0.5, phi="power", alpha=0.5, beta=1.0)
    bee = make_bee(5, **params)
    for t in range(40):
        keys, values, positions, scores = random_tokens(gen, t, 1)
        state = bee.state_dict()
        bee.ingest(keys, values, positions, scores=scores)
        if state["positions"].shape[1] < 5:
            continue
        after = bee.state_dict()
        for h in range(2):
            sim = similarity(torch.cat([state["keys"][h], keys[h]]))
            ground_mass = torch.cat([state["scores"][h], scores[h].double()], 1)
            ground_pos = torch.cat([state["positions"][h], positions[h]]).tolist()
            (evicted,) = set(ground_pos) - set(after["positions"][h].tolist())
            g = objective(sim, ground_mass, **params)
            loss = {i: g(range(6)) - g([j for j in range(6) if j != i]) for i in range(6)}
            assert loss[ground_pos.index(evicted)] <= min(loss.values()) + 1e-6


def test_lam_zero_evicts_like_a_pure_concave_over_modular_rule():
    """lam = 0: only importance counts. The rule is replayed here on positions and scores."""
    gen = torch.Generator().manual_seed(8)
    budget = 8
    bee = make_bee(budget, lam=0.0, phi="log")
    replay: list[dict[int, torch.Tensor]] = [{}, {}]  # per head: position -> mass [G]
    for start in range(0, 120, 5):
        keys, values, positions, scores = random_tokens(gen, start, 5)
        bee.ingest(keys, values, positions, scores=scores)
        for h in range(2):
            for j in range(5):
                replay[h][start + j] = scores[h, :, j].double()
                if len(replay[h]) > budget:
                    total = sum(replay[h].values())
                    loss = {
                        p: sum(math.log1p(total[u]) - math.log1p(total[u] - m[u]) for u in range(2))
                        for p, m in replay[h].items()
                    }
                    del replay[h][min(loss, key=lambda p: (loss[p], p))]
            assert bee.entries().positions[h].tolist() == sorted(replay[h])
        mass = torch.rand(2, 2, bee.entries().length, generator=gen)
        bee.observe(mass)
        for h in range(2):
            for j, p in enumerate(bee.entries().positions[h].tolist()):
                replay[h][p] = replay[h][p] + mass[h, :, j].double()


def test_lam_one_evicts_the_most_redundant_member():
    """lam = 1: only diversity counts; with V = S' the loser is the member whose nearest
    neighbour is closest (highest nearest-neighbour similarity)."""
    gen = torch.Generator().manual_seed(9)
    bee = make_bee(6, lam=1.0)
    for t in range(50):
        keys, values, positions, scores = random_tokens(gen, t, 1)
        state = bee.state_dict()
        bee.ingest(keys, values, positions, scores=scores)
        if state["positions"].shape[1] < 6:
            continue
        after = bee.state_dict()
        for h in range(2):
            ground_pos = torch.cat([state["positions"][h], positions[h]]).tolist()
            (evicted,) = set(ground_pos) - set(after["positions"][h].tolist())
            nn_sim = (similarity(torch.cat([state["keys"][h], keys[h]])) - 10 * torch.eye(7)).max(-1).values
            assert nn_sim[ground_pos.index(evicted)] >= nn_sim.max() - 1e-6


def test_scores_follow_their_tokens_through_evictions_and_reordering():
    gen = torch.Generator().manual_seed(10)
    bee = make_bee(10, greedy_max=4096)
    expected: list[dict[int, torch.Tensor]] = [{}, {}]  # per head: position -> score [G]
    for start, count in [(0, 8), (8, 8), (16, 8), (24, 30), (54, 8)]:  # streaming, then a greedy batch
        keys, values, positions, _ = random_tokens(gen, start, count)
        ticks = torch.arange(start, start + count).float()
        scores = torch.stack([ticks * 0.01, ticks * 0.02])
        for head in expected:
            head.update({start + j: scores[:, j].double() for j in range(count)})
        bee.ingest(keys, values, positions, scores=scores.expand(2, -1, -1).contiguous())
        kept = bee.entries().positions
        mass = torch.stack([kept * 1e-3, kept * 2e-3], 1).float()  # [H, G, n]: a function of the token
        bee.observe(mass)
        for h, head in enumerate(expected):
            for j, p in enumerate(kept[h].tolist()):
                head[p] = head[p] + mass[h, :, j].double()
    for h, head in enumerate(scores_by_position(bee)):
        assert len(head) == 10
        for p, score in head.items():
            torch.testing.assert_close(score, expected[h][p])


def test_a_prefill_batch_is_selected_by_the_offline_greedy():
    """Algorithm 1 with V = the batch; budget 4 of 30 lets the stochastic greedy sample
    every remaining token, so it is the exact greedy, replayed here."""
    gen = torch.Generator().manual_seed(11)
    params = dict(lam=0.5, phi="power", alpha=0.5, beta=1.0)
    keys, values, positions, scores = random_tokens(gen, 0, 30)
    bee = make_bee(4, greedy_max=4096, **params)
    bee.ingest(keys, values, positions, scores=scores)
    for h in range(2):
        sim = similarity(keys[h])
        g = objective(sim, scores[h].double(), **params)
        picked: list[int] = []
        for _ in range(4):
            picked.append(max((e for e in range(30) if e not in picked), key=lambda e: g(picked + [e])))
        assert bee.entries().positions[h].tolist() == sorted(picked)


def test_a_sampled_greedy_picks_each_token_at_most_once():
    """1,000 tokens, budget 100: each step draws 47 of the untaken tokens, not all of them;
    a pick leaves the untaken list, so no token is drawn and kept twice."""
    gen = torch.Generator().manual_seed(5)
    bee = make_bee(100, greedy_max=4096)
    keys, values, positions, scores = random_tokens(gen, 0, 1000)
    bee.ingest(keys, values, positions, scores=scores)
    for head in bee.entries().positions.tolist():
        assert len(head) == 100 and len(set(head)) == 100 and all(0 <= p < 1000 for p in head)


def test_beats_uniform_at_a_quarter_of_the_middle_on_real_data(real_qkv):
    """The paper's prefill setting: the whole middle arrives at once (offline greedy),
    scores are the causal column sums of the prompt, sinks and recent window exact."""
    bee_errors, uniform_errors = [], []
    for layer, (q, k, v) in real_qkv.items():
        budget = (k.shape[1] - SINKS - RECENT) // 4
        for seed in range(5):
            middle = compress_middle(
                "bumblebee",
                q,
                k,
                v,
                budget=budget,
                sinks=SINKS,
                recent=RECENT,
                layer=layer,
                seed=seed,
                params={"greedy_max": 4096},
            )
            assert middle.length == budget
            bee_errors.append(attention_error(q, k, v, middle, sinks=SINKS, recent=RECENT))
            baseline = uniform_middle(k, v, budget=budget, sinks=SINKS, recent=RECENT, seed=seed)
            uniform_errors.append(attention_error(q, k, v, baseline, sinks=SINKS, recent=RECENT))
    assert sum(bee_errors) / len(bee_errors) < sum(uniform_errors) / len(uniform_errors)


def test_streaming_beats_uniform_at_a_quarter_of_the_middle_on_real_data(real_qkv):
    """Algorithm 2 alone (greedy_max=0: no offline greedy), the middle arriving in batches
    of 64 as the window overflows; scores are the causal column sums of the text."""
    bee_errors, uniform_errors = [], []
    for layer, (q, k, v) in real_qkv.items():
        budget = (k.shape[1] - SINKS - RECENT) // 4
        middle = compress_middle(
            "bumblebee",
            q,
            k,
            v,
            budget=budget,
            sinks=SINKS,
            recent=RECENT,
            layer=layer,
            batch=64,
            params={"greedy_max": 0},
        )
        assert middle.length == budget
        bee_errors.append(attention_error(q, k, v, middle, sinks=SINKS, recent=RECENT))
        for seed in range(5):
            baseline = uniform_middle(k, v, budget=budget, sinks=SINKS, recent=RECENT, seed=seed)
            uniform_errors.append(attention_error(q, k, v, baseline, sinks=SINKS, recent=RECENT))
    assert sum(bee_errors) / len(bee_errors) < sum(uniform_errors) / len(uniform_errors)


@pytest.mark.skipif(
    not cpu_has_fast_bf16(),
    reason="a bf16 layer's greedy holds bf16 cosines only where the CPU multiplies bf16 natively",
)
def test_a_bf16_layers_greedy_covers_the_keys_as_well_as_a_float32_layers(real_qkv):
    """The offline greedy of a bf16 layer runs on bf16 cosines. With lam = 1 (diversity
    alone, where the cosines decide every pick), on the same real keys its picks cover
    them as well as a float32 layer's: at least 99.9% of its mean best similarity. A
    uniform quarter reaches 99.3-99.4% of it here, so a greedy that lost its diversity
    term would fail this."""
    for layer, (_q, k, v) in real_qkv.items():
        heads, n, dim = k.shape
        keys = k.bfloat16()
        positions = torch.arange(n).expand(heads, -1).contiguous()
        coverage = {}
        for dtype in (torch.bfloat16, torch.float32):
            spec = LayerSpec(layer, heads, 3, dim, torch.device("cpu"), dtype, 0)
            bee = compress.make("bumblebee", spec, n // 4, lam=1.0)
            bee.ingest(keys.to(dtype), v.to(dtype), positions)
            kept = bee.entries().positions
            coverage[dtype] = [similarity(keys[h])[:, kept[h]].max(1).values.mean() for h in range(heads)]
        for bf16, fp32 in zip(coverage[torch.bfloat16], coverage[torch.float32]):
            assert bf16 >= 0.999 * fp32


needs_native_greedy = pytest.mark.skipif(
    not native.built("greedy"), reason="kvchat.native._greedy not built (no C compiler at install)"
)
VARIANTS = [{}, {"phi": "log"}, {"alpha": 0.7}, {"normalize": "minmax"}, {"lam": 1.0}]


def greedy_pool(
    enabled: bool, dtype: torch.dtype, params: dict, weighted: bool = False, n: int = 1500, budget: int = 300
):
    """A prefill of n random tokens (3 KV heads of 64 channels) through the offline greedy,
    with kvchat's kernel or the Python loop: (the kept positions [3, budget], keys, scores)."""
    spec = LayerSpec(0, 3, 3, 64, torch.device("cpu"), dtype, 7)
    bee = compress.make("bumblebee", spec, budget, **params)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3, n, 64, generator=gen).to(dtype)
    weights = torch.randint(1, 4, (3, n), generator=gen).float().log() if weighted else None
    scores = torch.rand(3, 3, n, generator=gen)
    with native.kernels(greedy=enabled):
        bee.ingest(keys, keys.clone(), torch.arange(n).expand(3, -1).contiguous(), log_weights=weights, scores=scores)
    return bee.entries().positions, keys, scores


@needs_native_greedy
@pytest.mark.skipif(
    native.status().greedy.path != "avx512", reason="the kernel sums in torch's order only on its AVX-512 path"
)
@pytest.mark.parametrize("params", VARIANTS)
@pytest.mark.parametrize("weighted", [False, True])
def test_the_native_greedy_keeps_the_tokens_the_python_loop_keeps(params, weighted):
    """kvchat/native/_greedy.c against `BumbleBee._greedy`'s own loop on a bf16 layer (the
    fast path: cosines in bf16): 1,500 tokens, budget 300 (each step samples 24 of them),
    the same generator draws, every objective variant, plain and weighted entries: the
    same tokens. (Elsewhere the plain loop sums in another order than torch: the test
    below holds there.)"""
    native_kept, _, _ = greedy_pool(True, torch.bfloat16, params, weighted)
    python_kept, _, _ = greedy_pool(False, torch.bfloat16, params, weighted)
    assert torch.equal(native_kept, python_kept)


@needs_native_greedy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("params", VARIANTS)
def test_the_native_greedy_scores_as_the_python_loop(params, dtype):
    """On a float32 layer (and on a bf16 one where the kernel has no AVX-512 pass) the
    kernel sums a candidate's coverage in another order than torch, so a near-tie can fall
    the other way (then the picks part): the objective of what it keeps, recomputed here,
    is within 0.1% of the loop's in every head."""
    settings = {"lam": 0.5, "phi": "power", "alpha": 0.5, "beta": 1.0, **params}
    settings.pop("normalize", None)
    kept = {}
    for enabled in (True, False):
        kept[enabled], keys, scores = greedy_pool(enabled, dtype, params, n=600, budget=120)
    for h in range(3):
        g = objective(similarity(keys[h].float()), scores[h].double(), **settings)
        mine, theirs = g(kept[True][h].tolist()), g(kept[False][h].tolist())
        assert abs(mine - theirs) <= 1e-3 * abs(theirs)


needs_native_rounds = pytest.mark.skipif(
    not native.built("summary"), reason="kvchat.native._summary not built (no C compiler at install)"
)


def streamed(kernel: bool, params: dict, weighted: bool, batch: int, n: int = 1500, budget: int = 300):
    """n random tokens (3 KV heads of 64 channels, bf16) streamed through Algorithm 2 in
    batches (greedy_max 0), its append and rounds in kvchat's kernel or in NumPy: (the kept
    positions [3, budget], keys)."""
    spec = LayerSpec(0, 3, 3, 64, torch.device("cpu"), torch.bfloat16, 7)
    bee = compress.make("bumblebee", spec, budget, greedy_max=0, **params)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3, n, 64, generator=gen).to(torch.bfloat16)
    weights = torch.randint(1, 4, (3, n), generator=gen).float().log() if weighted else None
    scores = torch.rand(3, 3, n, generator=gen)
    with native.kernels(summary=kernel):
        for first in range(0, n, batch):
            part = slice(first, first + batch)
            bee.ingest(
                keys[:, part],
                keys[:, part].clone(),
                torch.arange(n)[part].expand(3, -1).contiguous(),
                log_weights=None if weights is None else weights[:, part],
                scores=scores[:, :, part],
            )
    return bee.entries().positions, keys


@needs_native_rounds
@pytest.mark.parametrize("params", VARIANTS[:4])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("batch", [64, 256])  # a decode step's batch, a flush's piece
def test_the_native_rounds_keep_the_tokens_the_numpy_rounds_keep(params, weighted, batch):
    """kvchat/native/_summary.c against `_StreamingSummary`'s NumPy append and rounds:
    1,500 tokens streamed into a summary of 300, every objective that mixes in attention,
    plain and weighted entries: the same tokens."""
    native_kept, _ = streamed(True, params, weighted, batch)
    numpy_kept, _ = streamed(False, params, weighted, batch)
    assert torch.equal(native_kept, numpy_kept)


@needs_native_rounds
@pytest.mark.parametrize("weighted", [False, True])
def test_with_diversity_alone_the_native_rounds_cover_the_tokens_as_the_numpy_rounds(weighted):
    """With lam = 1 two mutual neighbours have equal losses when their cosine is the same
    both ways: the kernel's is (one chain of multiply-adds), torch's product can differ in
    the last bit between the two, so the pair's tie can fall the other way and the kept
    tokens part. What is kept covers the tokens as well: the mean similarity of every
    token to its nearest kept one is within 0.1% of the NumPy rounds', in every head."""
    kept = {}
    for kernel in (True, False):
        kept[kernel], keys = streamed(kernel, {"lam": 1.0}, weighted, batch=64)
    for h in range(3):
        sim = similarity(keys[h].float())
        mine, theirs = (sim[:, kept[kernel][h]].max(1).values.mean() for kernel in (True, False))
        assert abs(mine - theirs) <= 1e-3 * theirs


@needs_native_rounds
def test_the_rounds_kernel_s_scalar_path_keeps_its_vector_path_s_tokens():
    """The kernel's neighbour searches (append and rounds) on AVX-512 and in the plain loops
    other CPUs run compute the same cosines: the same tokens kept, on a CPU that has both."""
    if not native.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512: only the plain loop runs here")
    kept = []
    for vector in (True, False):
        with native.kernels(avx512=vector):
            kept.append(streamed(True, {}, False, batch=64)[0])
    assert torch.equal(kept[0], kept[1])
