"""The segment kernel equals the reference formula over the concatenated cache."""

from __future__ import annotations

import pytest
import torch

from kvchat.cache.attention import segment_attention, weighted_attention

H, G, D = 3, 3, 16
SCALE = D**-0.5


def cache_parts(split: bool, length: int, seed: int = 0):
    """Sinks (exact), a weighted middle, and a window whose last `length` entries are
    the queries' own tokens."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    sinks, middle, window = 4, 20, 6 + length
    a = rand(H, middle)
    b = rand(H, middle) if split else a.clone()
    if split:  # numerator-only and denominator-only entries, as subgen/balancekv make
        b[:, :3] = float("-inf")
        a[:, 3:6] = float("-inf")
    query = rand(H * G, length, D) * 3
    parts = [(rand(H, n, D) * 2, rand(H, n, D)) for n in (sinks, middle, window)]
    return query, parts, a, b


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("length", [1, 5])
def test_segment_attention_matches_the_reference_formula(split, length):
    query, ((sk, sv), (mk, mv), (wk, wv)), a, b = cache_parts(split, length)
    out, mass = segment_attention(
        query,
        [(sk, sv, None, None), (mk, mv, a, b), (wk, wv, None, None)],
        SCALE,
        causal_last=True,
        split=split,
        want_mass=True,
    )
    zeros = lambda n: torch.zeros(H, n)  # noqa: E731
    ref, ref_mass = weighted_attention(
        query,
        torch.cat([sk, mk, wk], 1),
        torch.cat([sv, mv, wv], 1),
        torch.cat([zeros(4), a, zeros(wk.shape[1])], 1),
        torch.cat([zeros(4), b, zeros(wk.shape[1])], 1),
        SCALE,
        causal_tail=length,
        return_mass=True,
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(mass, -1), ref_mass, rtol=1e-5, atol=1e-5)


def test_segment_attention_without_mass_returns_none():
    query, ((sk, sv), (mk, mv), (wk, wv)), a, b = cache_parts(True, 1)
    _, mass = segment_attention(
        query, [(mk, mv, a, b), (wk, wv, None, None)], SCALE, causal_last=True, split=True, want_mass=False
    )
    assert mass is None


def test_a_failed_split_estimate_stays_finite_with_its_mass_ratio_capped():
    # A numerator-only sample far heavier than anything in the denominator (what subgen's
    # sampled estimate can produce when its clusters miss a key): e^(s+a) / sum e^(s+b)
    # overflows fp32. The output stays finite: the values' a-weighted mean times e^CAP.
    from kvchat.cache.attention import SPLIT_RATIO_CAP

    query, ((sk, sv), (mk, mv), (wk, wv)), a, b = cache_parts(True, 1)
    a[:, 10] = 300.0
    out, _ = segment_attention(
        query,
        [(sk, sv, None, None), (mk, mv, a, b), (wk, wv, None, None)],
        SCALE,
        causal_last=True,
        split=True,
        want_mass=False,
    )
    assert torch.isfinite(out).all()
    mean_norm = mv[:, 10].norm(dim=-1).max()  # the heavy sample dominates the a-weighted mean
    assert out.norm(dim=-1).max() <= mean_norm * torch.exp(torch.tensor(SPLIT_RATIO_CAP)) * 1.01


def test_subgen_refuses_non_finite_keys_instead_of_clustering_forever():
    from kvchat.compress import make
    from kvchat.compress.base import LayerSpec

    compressor = make("subgen", LayerSpec(0, H, G, D, torch.device("cpu"), torch.float32, 0), 8)
    keys = torch.randn(H, 32, D)
    keys[1, 5, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite keys"):
        compressor.ingest(keys, torch.randn(H, 32, D), torch.arange(32).expand(H, -1).contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_matches_the_reference_formula(dtype):
    # One new token (already the window's last entry) over sinks, a middle with one
    # log-weight per entry (some heads padded with -inf) and the window.
    from kvchat.cache.attention import fused_segment_attention, fused_segments_available

    if not fused_segments_available(torch.device("cpu")):
        pytest.skip("this PyTorch build has no fused CPU attention with log-sum-exp")
    query, ((sk, sv), (mk, mv), (wk, wv)), a, _b = cache_parts(False, 1)
    a[0, -5:] = float("-inf")  # head 0 holds fewer middle entries (padding)
    cast = lambda t: t.to(dtype)  # noqa: E731
    out = fused_segment_attention(
        cast(query),
        [(cast(sk), cast(sv), None, None), (cast(mk), cast(mv), a, a), (cast(wk), cast(wv), None, None)],
        SCALE,
    )
    zeros = lambda n: torch.zeros(H, n)  # noqa: E731
    weights = torch.cat([zeros(4), a, zeros(wk.shape[1])], 1)
    ref, _ = weighted_attention(
        query, torch.cat([sk, mk, wk], 1), torch.cat([sv, mv, wv], 1), weights, weights, SCALE, causal_tail=1
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_fused_decode_attention_ignores_a_segment_masked_out_for_a_head():
    from kvchat.cache.attention import fused_segment_attention, fused_segments_available

    if not fused_segments_available(torch.device("cpu")):
        pytest.skip("this PyTorch build has no fused CPU attention with log-sum-exp")
    query, (_, (mk, mv), (wk, wv)), a, _b = cache_parts(False, 1)
    a[1] = float("-inf")  # head 1 has no middle entry at all
    out = fused_segment_attention(query, [(mk, mv, a, a), (wk, wv, None, None)], SCALE)
    window_only = fused_segment_attention(query, [(wk, wv, None, None)], SCALE)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[G : 2 * G], window_only[G : 2 * G], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride", [1, 3])
def test_sampled_mass_sums_the_taken_query_rows_scaled_to_the_chunk(stride):
    # The mass a prefill chunk gives score-based methods, from every `stride`-th query
    # (the last one always taken), equals the reference mass of exactly those queries
    # times chunk / taken; stride 1 is the exact mass of the whole chunk.
    from kvchat.cache.attention import sampled_mass

    length = 7
    query, ((sk, sv), (mk, mv), (wk, wv)), a, _b = cache_parts(False, length)
    segments = [(sk, sv, None, None), (mk, mv, a, a), (wk, wv, None, None)]
    mass = sampled_mass(query, segments, SCALE, stride)
    rows = list(range(length - 1, -1, -stride))[::-1]
    zeros = lambda n: torch.zeros(H, n)  # noqa: E731
    weights = torch.cat([zeros(4), a, zeros(wk.shape[1])], 1)
    _, full_mass = weighted_attention(
        query,
        torch.cat([sk, mk, wk], 1),
        torch.cat([sv, mv, wv], 1),
        weights,
        weights,
        SCALE,
        causal_tail=length,
        return_mass=True,
    )
    expected = torch.zeros_like(full_mass)
    keys, values = torch.cat([sk, mk, wk], 1), torch.cat([sv, mv, wv], 1)
    for r in rows:  # row r sees everything up to its own entry
        seen = keys.shape[1] - length + r + 1
        _, row = weighted_attention(
            query[:, r : r + 1],
            keys[:, :seen],
            values[:, :seen],
            weights[:, :seen],
            weights[:, :seen],
            SCALE,
            causal_tail=1,
            return_mass=True,
        )
        expected[..., :seen] += row
    expected *= length / len(rows)
    torch.testing.assert_close(torch.cat(mass, -1), expected, rtol=1e-4, atol=1e-5)
    if stride == 1:
        torch.testing.assert_close(torch.cat(mass, -1), full_mass, rtol=1e-4, atol=1e-5)


# -- the blocked bf16 prefill kernel ---------------------------------------------------------
needs_native_bf16 = pytest.mark.skipif(
    not __import__("kvchat.runtime", fromlist=["cpu_has_fast_bf16"]).cpu_has_fast_bf16(),
    reason="the blocked prefill kernel runs only on a CPU with native bf16",
)


def blocked_case(length: int, seed: int = 0):
    """bf16 query [Hq, L, 64] and a cache [H, n, 64] (sinks, a weighted middle with one
    head padded, the window whose last L entries are the chunk), and its bias [H, n]."""
    d = 64
    gen = torch.Generator().manual_seed(seed)
    n = 4 + 20 + 10 + length
    query = (torch.randn(H * G, length, d, generator=gen) * 1.5).bfloat16()
    keys = (torch.randn(H, n, d, generator=gen) * 1.5).bfloat16()
    values = torch.randn(H, n, d, generator=gen).bfloat16()
    bias = torch.zeros(H, n)
    bias[:, 4:24] = torch.randn(H, 20, generator=gen).abs()  # merged entries: a = b = log(degree)
    bias[0, 20:24] = float("-inf")  # head 0 holds fewer middle entries (padding)
    return query, keys, values, bias, d**-0.5


@needs_native_bf16
@pytest.mark.parametrize("tile_rows", [1, 5, 1000])  # one row per tile, a few, the whole chunk
def test_blocked_prefill_matches_the_reference_formula(tile_rows):
    import kvchat.cache.attention as attention

    length = 17
    query, keys, values, bias, scale = blocked_case(length)
    out, mass = attention.blocked_prefill_attention(
        query, keys, values, bias, scale, mass_stride=1, tile_bytes=tile_rows * H * G * keys.shape[1] * 2
    )
    # The reference in fp32 on the same (bf16) inputs; the kernel rounds scores and
    # probabilities to bf16 (as transformers' bf16 eager attention does): 2-3% at most.
    ref, ref_mass = weighted_attention(
        query.float(), keys.float(), values.float(), bias, bias, scale, causal_tail=length, return_mass=True
    )
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2
    torch.testing.assert_close(mass, ref_mass, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(mass.sum((1, 2)), torch.full((H,), float(G * length)), rtol=1e-2, atol=0)
    assert (mass[0, :, 20:24] == 0).all()  # padding receives nothing


@needs_native_bf16
@pytest.mark.parametrize("stride", [2, 3])
def test_blocked_prefill_mass_sums_every_stride_th_row_scaled_to_the_chunk(stride):
    import kvchat.cache.attention as attention

    length = 11
    query, keys, values, bias, scale = blocked_case(length, seed=1)
    _, mass = attention.blocked_prefill_attention(
        query, keys, values, bias, scale, mass_stride=stride, tile_bytes=4 * H * G * keys.shape[1] * 2
    )  # tiles of 4 rows
    rows = list(range(length - 1, -1, -stride))
    n = keys.shape[1]
    expected = torch.zeros(H, G, n)
    for r in rows:  # row r sees everything up to its own entry
        seen = n - length + r + 1
        _, row = weighted_attention(
            query[:, r : r + 1].float(),
            keys[:, :seen].float(),
            values[:, :seen].float(),
            bias[:, :seen],
            bias[:, :seen],
            scale,
            causal_tail=1,
            return_mass=True,
        )
        expected[..., :seen] += row
    expected *= length / len(rows)
    torch.testing.assert_close(mass, expected, rtol=2e-2, atol=2e-2)


@needs_native_bf16
def test_blocked_prefill_without_mass_returns_none_and_the_same_output():
    from kvchat.cache.attention import blocked_prefill_attention

    query, keys, values, bias, scale = blocked_case(9)
    out, mass = blocked_prefill_attention(query, keys, values, None, scale)
    with_mass, _ = blocked_prefill_attention(query, keys, values, None, scale, mass_stride=1)
    assert mass is None
    assert torch.equal(out, with_mass)


def test_only_bf16_on_a_cpu_takes_the_blocked_prefill():
    # float32 is the exact path (PyTorch's fused SDPA) and CUDA keeps its
    # fused kernels: the blocked kernel is for bf16 on a CPU only.
    from kvchat.cache.attention import blocked_prefill_available
    from kvchat.runtime import cpu_has_fast_bf16

    assert not blocked_prefill_available(torch.device("cpu"), torch.float32)
    assert not blocked_prefill_available(torch.device("cpu"), torch.float16)
    assert not blocked_prefill_available(torch.device("cuda"), torch.bfloat16)
    assert blocked_prefill_available(torch.device("cpu"), torch.bfloat16) == cpu_has_fast_bf16()


def _layer(dtype: torch.dtype, method: str = "chelsea"):
    from kvchat.cache.layer import CompressedLayer
    from kvchat.compress import make
    from kvchat.compress.base import LayerSpec

    spec = LayerSpec(0, H, G, 64, torch.device("cpu"), dtype, 0)
    return CompressedLayer(spec, make(method, spec, 16), sinks=4)


def test_float32_prefill_runs_the_fused_kernel_exactly():
    # The float32 chunk's output is bit for bit that of one fused SDPA call over the
    # concatenated parts (the exact path: greedy tokens identical to transformers'
    # generate, tests/model/test_engine.py).
    import torch.nn.functional as F

    from kvchat.kv_types import Entries

    layer = _layer(torch.float32)
    assert not layer.blocked_prefill
    gen = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    layer.append(rand(H, 40, 64), rand(H, 40, 64), torch.arange(40))
    weights = rand(H, 12).abs()
    layer.middle = Entries(rand(H, 12, 64), rand(H, 12, 64), torch.arange(4, 16).expand(H, -1), weights, weights)
    query, length = rand(H * G, 8, 64), 8
    out = layer.attend(query, 0.125, length)
    # The reference: one SDPA call over sinks, middle and window, the middle's weights as a bias.
    m = layer.middle
    keys = torch.cat([layer.sink_keys, m.keys, layer.window.keys], 1)[None]
    values = torch.cat([layer.sink_values, m.values, layer.window.values], 1)[None]
    n = keys.shape[2]
    visible = torch.ones(length, n, dtype=torch.bool)
    visible[:, n - length :] = torch.ones(length, length, dtype=torch.bool).tril()
    bias = torch.zeros(H, n)
    bias[:, 4 : 4 + m.length] = m.log_num
    mask = bias.repeat_interleave(G, 0)[:, None, :].masked_fill(~visible, float("-inf"))
    before = F.scaled_dot_product_attention(query[None], keys, values, attn_mask=mask, scale=0.125, enable_gqa=True)
    assert torch.equal(out, before[0])


@needs_native_bf16
def test_a_bf16_prefill_chunk_gives_score_keepers_the_exact_mass():
    # h2o in bf16: the chunk's mass comes from the blocked kernel's own probabilities, every
    # query counted (BLOCKED_MASS_STRIDE = 1), split into middle and window.
    from kvchat.cache.layer import BLOCKED_MASS_STRIDE

    layer = _layer(torch.bfloat16, "h2o")
    assert layer.blocked_prefill and layer.mass_stride == BLOCKED_MASS_STRIDE == 1
    gen = torch.Generator().manual_seed(4)
    rand = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731
    layer.append(rand(H, 44, 64), rand(H, 44, 64), torch.arange(44))
    layer.evict(20)  # 20 tokens into the middle (budget 16: h2o keeps 16)
    query, length = rand(H * G, 6, 64), 6
    layer.append(rand(H, length, 64), rand(H, length, 64), torch.arange(44, 44 + length))
    before_mid, before_win = layer.compressor.scores.clone(), layer.window.scores.clone()
    layer.attend(query, 0.125, length)
    m = layer.middle
    keys = torch.cat([layer.sink_keys, m.keys, layer.window.keys], 1).float()
    values = torch.cat([layer.sink_values, m.values, layer.window.values], 1).float()
    zeros = torch.zeros(H, keys.shape[1])
    _, mass = weighted_attention(query.float(), keys, values, zeros, zeros, 0.125, causal_tail=length, return_mass=True)
    torch.testing.assert_close(
        layer.compressor.scores - before_mid, mass[..., 4 : 4 + m.length].sum(1), rtol=2e-2, atol=2e-2
    )
    grown = torch.cat([before_win, torch.zeros(H, G, layer.window.scores.shape[-1] - before_win.shape[-1])], -1)
    torch.testing.assert_close(layer.window.scores - grown, mass[..., 4 + m.length :], rtol=2e-2, atol=2e-2)


def test_bf16_decode_attention_matches_the_reference_formula():
    # One query over a weighted middle (one entry hidden by -inf) and an exact segment:
    # the output and each segment's mass agree with float32 attention on the same bf16
    # numbers to bf16's rounding of the scores and probabilities.
    from kvchat.cache.attention import decode_attention

    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    query = (rand(H * G, 1, 64) * 3).bfloat16()
    mid_k, mid_v, win_k, win_v = (rand(H, n, 64).bfloat16() for n in (24, 24, 40, 40))
    weights = rand(H, 24).abs()
    weights[1, 7] = float("-inf")
    out, mass = decode_attention(
        query, [(mid_k, mid_v, weights, weights), (win_k, win_v, None, None)], 0.125, want_mass=True
    )
    bias = torch.cat([weights, torch.zeros(H, 40)], 1)
    ref, ref_mass = weighted_attention(
        query.float(),
        torch.cat([mid_k, win_k], 1).float(),
        torch.cat([mid_v, win_v], 1).float(),
        bias,
        bias,
        0.125,
        return_mass=True,
    )
    assert out.dtype == torch.bfloat16 and out.shape == (H * G, 1, 64)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(torch.cat(mass, -1), ref_mass, rtol=2e-2, atol=2e-3)
    assert mass[0][1, :, 7].eq(0).all()  # the hidden entry gets nothing


@needs_native_bf16
def test_a_bf16_decode_step_gives_score_keepers_the_mass_of_its_query():
    # h2o in bf16, a cache large enough for the products path: a decode step's output and
    # the mass it adds to the middle's and the window's scores are those of float32
    # attention over sinks + middle + window.
    from kvchat.cache.layer import SCORED_PRODUCTS_FROM

    layer = _layer(torch.bfloat16, "h2o")
    gen = torch.Generator().manual_seed(6)
    rand = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731
    cached = SCORED_PRODUCTS_FROM + 40
    layer.append(rand(H, cached, 64), rand(H, cached, 64), torch.arange(cached))
    layer.evict(20)
    query = rand(H * G, 1, 64)
    layer.append(rand(H, 1, 64), rand(H, 1, 64), torch.arange(cached, cached + 1))
    assert layer.entry_count() >= SCORED_PRODUCTS_FROM
    before_mid, before_win = layer.compressor.scores.clone(), layer.window.scores.clone()
    out = layer.attend(query, 0.125, 1)
    m = layer.middle
    keys = torch.cat([layer.sink_keys, m.keys, layer.window.keys], 1).float()
    values = torch.cat([layer.sink_values, m.values, layer.window.values], 1).float()
    zeros = torch.zeros(H, keys.shape[1])
    ref, mass = weighted_attention(query.float(), keys, values, zeros, zeros, 0.125, return_mass=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(
        layer.compressor.scores - before_mid, mass[..., 4 : 4 + m.length].sum(1), rtol=2e-2, atol=2e-3
    )
    torch.testing.assert_close(layer.window.scores - before_win, mass[..., 4 + m.length :], rtol=2e-2, atol=2e-3)


@needs_native_bf16
def test_a_bf16_decode_step_recalling_every_cold_row_attends_each_token_once():
    # h2o in bf16 with a recall tier of as many rows as went cold: the middle holds 16 of
    # them exactly, so those rows are recalled hidden (-inf) and the other 24 are attended
    # from the tier. The step's output is float32 attention over every token once, and the
    # mass the scores get is the middle's and the window's share of it.
    from kvchat.cache.layer import SCORED_PRODUCTS_FROM, CompressedLayer
    from kvchat.compress import make
    from kvchat.compress.base import LayerSpec
    from kvchat.recall.tier import RecallTier

    spec = LayerSpec(0, H, G, 64, torch.device("cpu"), torch.bfloat16, 0)
    cold, sinks = 40, 4
    tier = RecallTier(heads=H, head_dim=64, dtype=torch.bfloat16, device=spec.device, recall=cold)
    layer = CompressedLayer(spec, make("h2o", spec, 16), sinks=sinks, recall=tier)
    gen = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731
    total = sinks + cold + SCORED_PRODUCTS_FROM
    keys, values = rand(H, total + 1, 64), rand(H, total + 1, 64)  # the last: this step's token
    layer.append(keys[:, :total], values[:, :total], torch.arange(total))
    layer.evict(cold)
    layer.append(keys[:, total:], values[:, total:], torch.tensor([total]))
    m = layer.middle
    assert m.length == 16 and tier.rows == cold
    # A query that gives one token the middle holds 29-45% of the attention: were its
    # recalled copy attended too, that token would count twice.
    held = keys[torch.arange(H), m.positions[:, 0]].float()  # [H, 64]
    query = (0.875 * held).repeat_interleave(G, 0)[:, None, :].bfloat16()
    before_mid, before_win = layer.compressor.scores.clone(), layer.window.scores.clone()
    out = layer.attend(query, 0.125, 1)
    zeros = torch.zeros(H, total + 1)
    ref, mass = weighted_attention(query.float(), keys.float(), values.float(), zeros, zeros, 0.125, return_mass=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    middle_mass = mass.gather(-1, m.positions[:, None, :].expand(-1, G, -1)).sum(1)
    torch.testing.assert_close(layer.compressor.scores - before_mid, middle_mass, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(layer.window.scores - before_win, mass[..., sinks + cold :], rtol=2e-2, atol=2e-3)


def test_bf16_decode_attention_caps_the_logits_as_the_reference_does():
    # Gemma 2's soft-capping: with logits far past the cap, capped and uncapped outputs differ.
    from kvchat.cache.attention import decode_attention

    gen = torch.Generator().manual_seed(6)
    query = (torch.randn(H * G, 1, 64, generator=gen) * 6).bfloat16()
    keys, values = (torch.randn(H, 40, 64, generator=gen).bfloat16() for _ in range(2))
    weights = torch.randn(H, 40, generator=gen).abs()
    out, _ = decode_attention(query, [(keys, values, weights, weights)], 0.125, softcap=2.0)
    ref, _ = weighted_attention(query.float(), keys.float(), values.float(), weights, weights, 0.125, softcap=2.0)
    uncapped, _ = weighted_attention(query.float(), keys.float(), values.float(), weights, weights, 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert float((ref - uncapped).abs().max()) > 0.1


def test_segment_attention_caps_the_logits_as_the_reference_does():
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(H * G, 5, 64, generator=gen) * 6
    keys, values = torch.randn(H, 30, 64, generator=gen), torch.randn(H, 30, 64, generator=gen)
    out, _ = segment_attention(
        query, [(keys, values, None, None)], 0.125, causal_last=True, split=False, want_mass=False, softcap=2.0
    )
    ref, _ = weighted_attention(
        query, keys, values, torch.zeros(H, 30), torch.zeros(H, 30), 0.125, causal_tail=5, softcap=2.0
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_native_bf16
def test_blocked_prefill_caps_the_logits_as_the_reference_does():
    import kvchat.cache.attention as attention

    length = 17
    query, keys, values, bias, scale = blocked_case(length)
    query = (query.float() * 4).bfloat16()  # logits well past the cap
    out, _ = attention.blocked_prefill_attention(query, keys, values, bias, scale, softcap=3.0)
    ref, _ = weighted_attention(
        query.float(), keys.float(), values.float(), bias, bias, scale, causal_tail=length, softcap=3.0
    )
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2
