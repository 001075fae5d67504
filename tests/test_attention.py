"""The segment kernel equals the reference formula over the concatenated cache."""

from __future__ import annotations

import pytest
import torch

from kvchat.attention import segment_attention, weighted_attention

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
        query, [(sk, sv, None, None), (mk, mv, a, b), (wk, wv, None, None)], SCALE,
        causal_last=True, split=split, want_mass=True,
    )
    zeros = lambda n: torch.zeros(H, n)  # noqa: E731
    ref, ref_mass = weighted_attention(
        query, torch.cat([sk, mk, wk], 1), torch.cat([sv, mv, wv], 1),
        torch.cat([zeros(4), a, zeros(wk.shape[1])], 1), torch.cat([zeros(4), b, zeros(wk.shape[1])], 1),
        SCALE, causal_tail=length, return_mass=True,
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(mass, -1), ref_mass, rtol=1e-5, atol=1e-5)


def test_segment_attention_without_mass_returns_none():
    query, ((sk, sv), (mk, mv), (wk, wv)), a, b = cache_parts(True, 1)
    _, mass = segment_attention(query, [(mk, mv, a, b), (wk, wv, None, None)], SCALE, causal_last=True,
                                split=True, want_mass=False)
    assert mass is None


def test_a_failed_split_estimate_stays_finite_with_its_mass_ratio_capped():
    # A numerator-only sample far heavier than anything in the denominator (what subgen's
    # sampled estimate can produce when its clusters miss a key): e^(s+a) / sum e^(s+b)
    # overflows fp32. The output stays finite: the values' a-weighted mean times e^CAP.
    from kvchat.attention import SPLIT_RATIO_CAP

    query, ((sk, sv), (mk, mv), (wk, wv)), a, b = cache_parts(True, 1)
    a[:, 10] = 300.0
    out, _ = segment_attention(query, [(sk, sv, None, None), (mk, mv, a, b), (wk, wv, None, None)], SCALE,
                               causal_last=True, split=True, want_mass=False)
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
    from kvchat.attention import fused_segment_attention, fused_segments_available

    if not fused_segments_available(torch.device("cpu")):
        pytest.skip("this PyTorch build has no fused CPU attention with log-sum-exp")
    query, ((sk, sv), (mk, mv), (wk, wv)), a, _b = cache_parts(False, 1)
    a[0, -5:] = float("-inf")  # head 0 holds fewer middle entries (padding)
    cast = lambda t: t.to(dtype)  # noqa: E731
    out = fused_segment_attention(
        cast(query), [(cast(sk), cast(sv), None, None), (cast(mk), cast(mv), a, a), (cast(wk), cast(wv), None, None)],
        SCALE,
    )
    zeros = lambda n: torch.zeros(H, n)  # noqa: E731
    weights = torch.cat([zeros(4), a, zeros(wk.shape[1])], 1)
    ref, _ = weighted_attention(query, torch.cat([sk, mk, wk], 1), torch.cat([sv, mv, wv], 1), weights, weights,
                                SCALE, causal_tail=1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_fused_decode_attention_ignores_a_segment_masked_out_for_a_head():
    from kvchat.attention import fused_segment_attention, fused_segments_available

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
    from kvchat.attention import sampled_mass

    length = 7
    query, ((sk, sv), (mk, mv), (wk, wv)), a, _b = cache_parts(False, length)
    segments = [(sk, sv, None, None), (mk, mv, a, a), (wk, wv, None, None)]
    mass = sampled_mass(query, segments, SCALE, stride)
    rows = list(range(length - 1, -1, -stride))[::-1]
    zeros = lambda n: torch.zeros(H, n)  # noqa: E731
    weights = torch.cat([zeros(4), a, zeros(wk.shape[1])], 1)
    _, full_mass = weighted_attention(query, torch.cat([sk, mk, wk], 1), torch.cat([sv, mv, wv], 1), weights,
                                      weights, SCALE, causal_tail=length, return_mass=True)
    expected = torch.zeros_like(full_mass)
    keys, values = torch.cat([sk, mk, wk], 1), torch.cat([sv, mv, wv], 1)
    for r in rows:  # row r sees everything up to its own entry
        seen = keys.shape[1] - length + r + 1
        _, row = weighted_attention(query[:, r : r + 1], keys[:, :seen], values[:, :seen], weights[:, :seen],
                                    weights[:, :seen], SCALE, causal_tail=1, return_mass=True)
        expected[..., :seen] += row
    expected *= length / len(rows)
    torch.testing.assert_close(torch.cat(mass, -1), expected, rtol=1e-4, atol=1e-5)
    if stride == 1:
        torch.testing.assert_close(torch.cat(mass, -1), full_mass, rtol=1e-4, atol=1e-5)
