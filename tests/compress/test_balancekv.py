"""balancekv: BalanceKV's balanced halvings (docs/methods.md, "balancekv")."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.calibration.evaluate import attention_error, compress_middle, uniform_middle
from kvchat.compress import make
from kvchat.compress.base import LayerSpec

LOG2 = math.log(2.0)
SINKS = RECENT = 256
VARIANTS = [
    {"mode": "code", "schedule": "stream"},
    {"mode": "code", "schedule": "prefill"},
    {"mode": "paper", "schedule": "stream"},
    {"mode": "paper", "schedule": "prefill"},
]
VARIANT_IDS = [f"{v['mode']}-{v['schedule']}" for v in VARIANTS]


def spec(heads: int = 3, dim: int = 64, seed: int = 0) -> LayerSpec:
    return LayerSpec(1, heads, 3, dim, torch.device("cpu"), torch.float32, seed)


def random_batches(count: int, size: int, heads: int = 3, dim: int = 64, seed: int = 0):
    """`count` batches of `size` tokens with consecutive positions."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(count):
        positions = torch.arange(i * size, (i + 1) * size).expand(heads, -1).contiguous()
        yield torch.randn(heads, size, dim, generator=gen) * 2, torch.randn(heads, size, dim, generator=gen), positions


def real_middle(real_qkv, layer: int = 8):
    """The middle (between 256 sinks and 256 recent tokens) of a real layer, with its
    positions, and the last 64 queries."""
    q, k, v = real_qkv[layer]
    n = k.shape[1]
    middle = slice(SINKS, n - RECENT)
    positions = torch.arange(n)[middle].expand(k.shape[0], -1).contiguous()
    return q[:, -64:], k[:, middle].contiguous(), v[:, middle].contiguous(), positions


def test_incoming_weights_are_carried_as_token_counts():
    ((keys, values, positions),) = random_batches(1, 64)
    log_weights = torch.full((3, 64), math.log(3.0))
    kept_all = make("balancekv", spec(), 64, schedule="prefill")
    kept_all.ingest(keys, values, positions, log_weights=log_weights)
    halved = make("balancekv", spec(), 32, schedule="prefill")
    halved.ingest(keys, values, positions, log_weights=log_weights)

    assert torch.equal(kept_all.entries().log_num, log_weights)
    assert torch.equal(kept_all.entries().log_den, log_weights)
    # After one halving each survivor stands for twice the tokens it stood for.
    assert torch.allclose(halved.entries().log_den, torch.full((3, 32), math.log(6.0)))


@pytest.mark.parametrize("n", [255, 256, 257, 300])
def test_one_balancing_round_keeps_half_and_carries_an_odd_token(n):
    ((keys, values, positions),) = random_batches(1, n)
    comp = make("balancekv", spec(), math.ceil(n / 2), schedule="prefill")
    comp.ingest(keys, values, positions)
    e = comp.entries()

    assert e.length == math.ceil(n / 2)
    assert torch.all(e.positions[:, 1:] > e.positions[:, :-1])  # survivors keep sequence order
    # Minority-prefix survivors stand for two tokens in the numerator, tail survivors for one;
    # in the denominator every halved survivor counts for the two tokens it replaces, and
    # the odd token out is carried with its own count: no token's count is lost.
    assert torch.all((e.log_num == 0) | (e.log_num == LOG2))
    torch.testing.assert_close(e.log_den.exp().sum(1), torch.full((3,), float(n)))
    if n % 2:
        assert torch.all(e.positions[:, -1] == n - 1) and torch.all(e.log_den[:, -1] == 0)


@pytest.mark.parametrize("mode", ["code", "paper"])
def test_a_single_leftover_entry_keeps_its_count_under_streaming(mode):
    # Budget 3, batches of 4 reduced early and one token at a time: buffers of one entry
    # arise; none may vanish. Every ingested token stays counted in the denominator.
    comp = make("balancekv", spec(heads=1, dim=8), 3, mode=mode, batch=4)
    for keys, values, positions in random_batches(9, 1, heads=1, dim=8):
        comp.ingest(keys, values, positions)
        assert len(comp) <= 3
    e = comp.entries()
    if mode == "code":
        torch.testing.assert_close(e.log_den.exp().sum(), torch.tensor(9.0))
    else:
        assert torch.isfinite(e.log_den).any() and torch.isfinite(e.log_num).any()


def test_paper_mode_keeps_numerator_buckets_smaller_than_a_batch_exact():
    # 64 tokens of norm ~1 and 8 of norm ~100: a different value-norm bucket, smaller
    # than the batch (32): its members stay in the numerator at weight 1.
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 72, 16, generator=gen)
    values = torch.randn(1, 72, 16, generator=gen)
    values = values / values.norm(dim=-1, keepdim=True) * 0.9
    values[0, 64:] *= 100
    positions = torch.arange(72)[None]
    comp = make("balancekv", spec(heads=1, dim=16), 48, mode="paper", batch=32)
    for start in range(0, 72, 8):
        comp.ingest(keys[:, start : start + 8], values[:, start : start + 8], positions[:, start : start + 8])
    e = comp.entries()
    large = e.positions[0] >= 64
    assert sorted(e.positions[0][large & torch.isfinite(e.log_num[0])].tolist()) == list(range(64, 72))
    assert torch.all(e.log_num[0][large & torch.isfinite(e.log_num[0])] == 0)


def test_den_weight_same_uses_the_numerator_weight_in_the_denominator():
    ((keys, values, positions),) = random_batches(1, 256)
    comp = make("balancekv", spec(), 64, schedule="prefill", den_weight="same")
    comp.ingest(keys, values, positions)
    e = comp.entries()
    assert torch.equal(e.log_num, e.log_den)
    assert e.log_num.max() > 0


def test_merge_and_reduce_holds_logarithmically_many_batches():
    batch, n = 32, 2048
    comp = make("balancekv", spec(dim=16), 2 * batch, batch=batch)
    for keys, values, positions in random_batches(n // 16, 16, dim=16):
        comp.ingest(keys, values, positions)
    state = comp.state_dict()
    levels_in_use = int((torch.bincount(state["level"]) > 0).sum())

    assert levels_in_use <= math.log2(n / batch) + 2
    assert len(comp) <= batch * levels_in_use
    # Every token is accounted for exactly once: level-l entries count 2^l tokens.
    assert torch.allclose(state["log_count"].exp().sum(1), torch.full((3,), float(n)))


def test_balanced_half_approximates_the_weighted_value_sum_better_than_a_random_half():
    n, dim = 256, 16
    scale = dim**-0.5

    def emitted_sum(queries, entries):  # sum_j e^{a_j} e^{<q, k_j>/sqrt d} v_j, a_j as emitted
        return torch.exp(queries @ entries.keys[0].T * scale + entries.log_num[0]) @ entries.values[0]

    def random_half_sum(queries, keys, values):  # a uniform half, each survivor standing for 2
        return 2 * torch.exp(queries @ keys.T * scale) @ values

    balanced_errors, random_errors = [], []
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        keys = torch.randn(1, n, dim, generator=gen) * 0.5
        values = torch.randn(1, n, dim, generator=gen)
        queries = torch.randn(32, dim, generator=gen)
        full = torch.exp(queries @ keys[0].T * scale) @ values[0]

        comp = make("balancekv", spec(heads=1, dim=dim, seed=seed), n // 2, schedule="prefill")
        comp.ingest(keys, values, torch.arange(n)[None])
        balanced = emitted_sum(queries, comp.entries())
        pick = torch.randperm(n, generator=gen)[: n // 2]
        random = random_half_sum(queries, keys[0, pick], values[0, pick])

        balanced_errors.append(((balanced - full).norm(dim=-1) / full.norm(dim=-1)).mean())
        random_errors.append(((random - full).norm(dim=-1) / full.norm(dim=-1)).mean())

    balanced_error = torch.stack(balanced_errors).mean()
    random_error = torch.stack(random_errors).mean()
    assert balanced_error < 0.75 * random_error, (balanced_error, random_error)


def quarter_budget_errors(real_qkv, method_params, seeds=range(5)):
    """Mean attention error over layers and seeds of balancekv and of uniform sampling,
    middle kept at 1/4 (256 sinks and 256 recent tokens exact)."""
    ours, uniform = [], []
    for layer, (q, k, v) in real_qkv.items():
        budget = (k.shape[1] - SINKS - RECENT) // 4
        for seed in seeds:
            kept = compress_middle(
                "balancekv",
                q,
                k,
                v,
                budget=budget,
                sinks=SINKS,
                recent=RECENT,
                layer=layer,
                seed=seed,
                params=method_params,
            )
            ours.append(attention_error(q, k, v, kept, sinks=SINKS, recent=RECENT))
            baseline = uniform_middle(k, v, budget=budget, sinks=SINKS, recent=RECENT, seed=seed)
            uniform.append(attention_error(q, k, v, baseline, sinks=SINKS, recent=RECENT))
    return sum(ours) / len(ours), sum(uniform) / len(uniform)


def test_beats_uniform_sampling_on_real_attention_at_a_quarter(real_qkv):
    # The paper's setting: the middle compressed once (T = 2 halvings), code walk.
    ours, uniform = quarter_budget_errors(real_qkv, {"mode": "code", "schedule": "prefill"})
    assert ours < uniform, (ours, uniform)


def test_default_stream_schedule_beats_uniform_sampling_on_real_attention_at_a_quarter(real_qkv):
    # The default: merge-and-reduce over batches of 64 tokens leaving the window, as in chat.
    ours, uniform = [], []
    for layer, (q, k, v) in real_qkv.items():
        budget = (k.shape[1] - SINKS - RECENT) // 4
        for seed in range(3):
            kept = compress_middle(
                "balancekv", q, k, v, budget=budget, sinks=SINKS, recent=RECENT, layer=layer, seed=seed, batch=64
            )
            ours.append(attention_error(q, k, v, kept, sinks=SINKS, recent=RECENT))
            baseline = uniform_middle(k, v, budget=budget, sinks=SINKS, recent=RECENT, seed=seed)
            uniform.append(attention_error(q, k, v, baseline, sinks=SINKS, recent=RECENT))
    assert sum(ours) / len(ours) < sum(uniform) / len(uniform), (ours, uniform)


# ------------------------------------------------------------------ long chats


def long_chat(comp, sizes, heads: int = 3, dim: int = 32, seed: int = 0, check=None):
    """Ingest batches of the given sizes (exact tokens, consecutive positions); calls
    check(tokens seen) after each. Returns every key ingested [H, n, d]."""
    gen = torch.Generator().manual_seed(seed)
    seen, all_keys = 0, []
    for size in sizes:
        keys = torch.randn(heads, size, dim, generator=gen) * 2
        values = torch.randn(heads, size, dim, generator=gen)
        comp.ingest(keys, values, torch.arange(seen, seen + size).expand(heads, -1).contiguous())
        seen += size
        all_keys.append(keys)
        if check is not None:
            check(seen)
    return torch.cat(all_keys, 1)


@pytest.mark.parametrize("schedule", ["stream", "prefill"])
def test_a_long_chat_keeps_every_token_counted(schedule):
    # Many small ingests past the budget, odd sizes included: after every one, the count
    # weights (b = log count) of each head sum to the tokens seen. A prefill schedule that
    # halved the whole middle, mixing entries of count 1, 2, 4, ... in one walk, would keep
    # 0.35-0.56 of the count after 48 ingests of 64 tokens at budget 512.
    comp = make("balancekv", spec(dim=32), 512, schedule=schedule)

    def check(seen):
        assert len(comp) <= 512
        torch.testing.assert_close(comp.entries().log_den.exp().sum(1), torch.full((3,), float(seen)))
        if schedule == "prefill":
            # Halvings never mix counts: an entry of level l stands for exactly 2^l tokens.
            state = comp.state_dict()
            torch.testing.assert_close(state["log_count"], (state["level"] * LOG2).float().expand(3, -1))

    long_chat(comp, [64] * 40 + [37, 1, 100, 63, 1, 1, 99] * 3, check=check)


def test_one_shot_prefill_is_whole_middle_halvings():
    # The authors' setting: one ingest, the whole middle halved T times; every survivor of
    # T = 3 halvings is at level 3 and stands for 8 tokens.
    comp = make("balancekv", spec(dim=32), 128, schedule="prefill")
    long_chat(comp, [1024])
    state = comp.state_dict()
    assert state["level"].tolist() == [3] * 128
    torch.testing.assert_close(comp.entries().log_den, torch.full((3, 128), 3 * LOG2))


def test_prefill_denominator_estimate_stays_close_to_exact_over_a_long_chat():
    # 48 ingests of 64 tokens at budget 512 (6x over): sum_j e^(s_j + b_j) against the exact
    # sum_i e^(s_i) over every token, for 256 random queries per head. Halving the whole
    # middle at once gives a mean ratio of 0.43; merge-and-reduce by level keeps it near 1
    # (measured 0.98-1.01).
    dim = 32
    comp = make("balancekv", spec(dim=dim), 512, schedule="prefill")
    keys = long_chat(comp, [64] * 48, dim=dim)
    e = comp.entries()
    queries = torch.randn(3, 256, dim, generator=torch.Generator().manual_seed(5))
    scale = dim**-0.5
    exact = torch.logsumexp(queries @ keys.transpose(1, 2) * scale, -1)
    estimate = torch.logsumexp(queries @ e.keys.transpose(1, 2) * scale + e.log_den[:, None, :], -1)
    ratio = (estimate - exact).exp()
    assert 0.85 < float(ratio.mean()) < 1.15, ratio.mean()


def test_a_prefill_snapshot_without_levels_loads_with_levels_from_the_counts():
    # Snapshots written before the prefill schedule kept levels have none: each entry's
    # level is read back from its count, and the chat goes on counting every token.
    comp = make("balancekv", spec(dim=32), 128, schedule="prefill")
    long_chat(comp, [300, 64, 64])
    state = comp.state_dict()
    old = {name: value for name, value in state.items() if name != "level"}
    twin = make("balancekv", spec(dim=32), 128, schedule="prefill")
    twin.load_state_dict(old)
    assert torch.equal(twin.state_dict()["level"], state["level"])
    long_chat(twin, [64] * 5, seed=1)
    torch.testing.assert_close(twin.entries().log_den.exp().sum(1), torch.full((3,), 428.0 + 320.0))
