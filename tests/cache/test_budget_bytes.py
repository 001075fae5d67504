"""`--budget 64MB`: the whole KV cache of a session in bytes, shared across layers by
measurement (docs/design.md, "Budgets")."""

from __future__ import annotations

import json

import pytest
import torch

from kvchat import compress
from kvchat.cache import budget as allocate
from kvchat.cache.compressed_cache import CompressedCache
from kvchat.calibration import calibrate
from kvchat.chat import persist
from kvchat.errors import InputTooLong
from kvchat.kv_types import LayerGeometry
from kvchat.settings import Budget, CacheSettings, SamplingSettings

# A byte budget that the real model on its default path (int8 weights, bf16 cache) must
# compress under: a window of 128 tokens is about 3 MB of the 6 MB, the middles share the
# rest (about 130 entries per layer).
LIMIT = "6MB"
LIMIT_BYTES = 6_000_000
WINDOW = 128
DOCUMENT_TOKENS = 1600
DECODE_STEPS = 8


# -- parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "nbytes", "shown"),
    [
        ("64MB", 64_000_000, "64MB"),
        ("64 MB", 64_000_000, "64MB"),
        ("64mb", 64_000_000, "64MB"),
        ("64MiB", 64 * 2**20, "64MiB"),
        ("64 mib", 64 * 2**20, "64MiB"),
        ("1GB", 10**9, "1GB"),
        ("1.5GiB", 3 * 2**29, "1.5GiB"),
        ("500KB", 500_000, "500KB"),
        ("512KiB", 2**19, "512KiB"),
    ],
)
def test_a_size_parses_to_bytes_and_reads_back_as_given(text, nbytes, shown):
    budget = Budget.parse(text)
    assert budget.in_bytes and budget.value == nbytes and str(budget) == shown
    assert Budget.parse(str(budget)) == budget  # what a snapshot stores reads back the same


def test_entry_and_share_budgets_are_not_sizes():
    assert not Budget.parse("1024").in_bytes and not Budget.parse("25%").in_bytes


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("64MX", "unknown unit 'MX'"),
        ("64 bytes", "unknown unit"),
        ("0MB", "more than 0"),
        ("MB", "give entries per KV head"),
    ],
)
def test_a_bad_size_is_refused_naming_the_units(text, says):
    with pytest.raises(ValueError, match=says):
        Budget.parse(text)


# -- what an entry costs, and sharing the bytes ----------------------------------------------------
def spec(heads: int = 3, dim: int = 64, dtype=torch.bfloat16):
    from kvchat.compress.base import LayerSpec

    return LayerSpec(0, heads, 3, dim, torch.device("cpu"), dtype)


def test_the_probe_counts_an_entry_s_auxiliary_state():
    # Keys + values (bf16) + position (int64) + log-weight (float32) per entry and KV head;
    # h2o adds its accumulated score (float32) per KV head.
    chelsea = allocate.middle_cost("chelsea", {}, spec())
    h2o = allocate.middle_cost("h2o", {}, spec())
    kv = 3 * 2 * 64 * 2
    assert kv < chelsea.per_entry < h2o.per_entry
    assert chelsea.per_entry == kv + 3 * (8 + 4)
    assert h2o.per_entry == kv + 3 * (8 + 4) + 3 * 4


def test_a_method_that_outgrows_its_budget_cannot_take_a_byte_budget():
    with pytest.raises(ValueError, match="cannot keep to a budget in bytes"):
        allocate.middle_cost("chelsea", {"outlier_heads": "0", "outlier_cache": "full"}, spec())


def test_the_middles_share_the_bytes_evenly_or_by_weight_and_never_pass_them():
    costs = [allocate.MiddleCost(1000, 100.0, True)] * 4
    even = allocate.split_middle(400_000, costs, None)
    assert even == [990] * 4
    weighted = allocate.split_middle(400_000, costs, [3.0, 1.0, 0.0, 0.0])
    assert weighted[0] > weighted[1] > weighted[2] == weighted[3] > 0  # the floor: half is shared evenly
    assert sum(c.bytes_at(b) for c, b in zip(costs, weighted)) <= 400_000


def test_sharp_attention_loses_less_than_spread_attention_when_the_middle_is_cut():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 600, 16, generator=gen), torch.randn(1, 600, 16, generator=gen)
    sharp = keys[:, 300:301].expand(1, 600, 16) * 20  # every query points at one middle key
    spread = torch.zeros(1, 600, 16)  # every key scores the same: attention spreads evenly
    sharp_curve = allocate.error_curve(sharp, keys, values, recent=64, queries=64)
    spread_curve = allocate.error_curve(spread, keys, values, recent=64, queries=64)
    assert sharp_curve[0] > 0.5 and sharp_curve[1] < 0.01  # that one key is all it needs
    assert spread_curve[4] > 10 * sharp_curve[4] and spread_curve[-1] == sharp_curve[-1] == 0


def test_the_greedy_gives_the_middle_to_the_layer_that_loses_most_without_it():
    fractions = (0.0, 0.5, 1.0)
    curves = [[0.1, 0.05, 0.0], [0.9, 0.3, 0.0], [0.1, 0.05, 0.0]]
    shares = allocate.greedy_fractions(curves, fractions, target=0.25, step=1 / 8)
    assert sum(shares) == 0.75 and shares[1] > shares[0] == shares[2]
    assert allocate.greedy_fractions(curves, fractions, target=0.25, step=1 / 8) == shares


# -- the real model: every method stays within the bytes --------------------------------------------
@pytest.fixture(scope="module")
def engine(engine_fast):
    """The default CPU path, not the exact one: bytes are what matter here."""
    return engine_fast


@pytest.fixture(scope="module")
def document(engine) -> list[int]:
    from kvchat.calibration.realkv import essays_text

    return engine.tokenizer(essays_text()[:9000], add_special_tokens=False).input_ids[:DOCUMENT_TOKENS]


def observed(session) -> list[int]:
    """The cache's bytes after every settle (every forward pass: prefill chunks, flushes
    and decode steps)."""
    sizes: list[int] = []
    cache = session.cache
    settle = cache.settle

    def settle_and_measure() -> None:
        settle()
        sizes.append(cache.nbytes())

    cache.settle = settle_and_measure
    return sizes


@pytest.mark.parametrize("method", [m for m in compress.available() if m != "full"])
def test_every_method_stays_within_a_byte_budget_after_every_forward_pass_and_uses_it(engine, document, method):
    session = engine.new_session(CacheSettings(method=method, budget=LIMIT, window=WINDOW))
    sizes = observed(session)
    session.feed(document, chunk=256)
    for token in document[:DECODE_STEPS]:
        engine.forward([token], session.cache)
    assert len(sizes) >= DOCUMENT_TOKENS // 256 + DECODE_STEPS
    assert max(sizes) <= LIMIT_BYTES
    assert session.cache.entries_per_head() < session.cache.tokens_seen  # it compressed
    # Used: the window refills between evictions (a batch of 64 tokens of 128 is ~1.5 MB).
    assert max(sizes) > 0.9 * LIMIT_BYTES and sizes[-1] > 0.7 * LIMIT_BYTES


def test_a_compressor_that_outgrows_the_probe_is_held_to_the_budget_by_lowering_its_layer(engine, document):
    # subgen's stream mode keeps cluster representatives beside its entries, more of them
    # at larger budgets than the probe's small ones: the cache lowers those layers' budgets.
    session = engine.new_session(CacheSettings(method="subgen", budget=LIMIT, window=WINDOW, params={"mode": "stream"}))
    planned = session.cache.layer_budgets()
    sizes = observed(session)
    session.feed(document, chunk=256)
    lowered = session.cache.layer_budgets()
    assert all(now <= before for now, before in zip(lowered, planned)) and lowered != planned
    assert max(sizes) <= LIMIT_BYTES and max(sizes) > 0.9 * LIMIT_BYTES
    assert session.cache.meta()["layer_budgets"] == lowered  # the snapshot keeps the lowered allocation


def test_window_takes_the_whole_byte_budget_as_its_window(engine, document):
    session = engine.new_session(CacheSettings(method="window", budget=LIMIT, window=WINDOW))
    sizes = observed(session)
    session.feed(document, chunk=256)
    _, window = session.cache.targets(session.cache.tokens_seen)
    assert window > 1.9 * WINDOW and session.cache.layer_budgets() == [0] * 30  # --window does not bind it
    assert max(sizes) <= LIMIT_BYTES and sizes[-1] > 0.99 * LIMIT_BYTES


def test_full_under_a_byte_budget_refuses_the_turn_that_would_pass_it(engine):
    session = engine.new_session(CacheSettings(method="full", budget="4MB"))
    sizes = observed(session)
    session.send("Say hi.", SamplingSettings(max_new_tokens=4))
    assert max(sizes) <= 4_000_000
    with pytest.raises(InputTooLong, match=r"past --budget 4MB: use a compressing method.*or raise `--budget`"):
        session.check_fits(200, 16)


def test_auto_prefill_holds_the_input_exact_only_when_it_fits_the_budget(engine, document):
    session = engine.new_session(CacheSettings(method="h2o", budget=LIMIT, window=WINDOW))
    assert session.prefill_mode(64) == "exact-then-compress"  # 64 tokens: about 1.5 MB
    assert session.prefill_mode(len(document)) == "streaming"  # held whole: about 37 MB


def test_an_explicit_exact_prefill_that_would_pass_the_budget_is_refused(engine):
    session = engine.new_session(
        CacheSettings(method="h2o", budget=LIMIT, window=WINDOW, prefill_mode="exact-then-compress")
    )
    with pytest.raises(InputTooLong, match=r"more than --budget 6MB: use `--prefill streaming` or raise"):
        session.check_fits(1000, 16)


def test_a_budget_below_the_sinks_and_window_says_the_minimum(engine):
    with pytest.raises(
        ValueError,
        match=r"below the [0-9.]+ MB that 4 sinks and a window of 128 take in the 30 "
        r"layers of this model; raise --budget or lower --window",
    ):
        engine.new_session(CacheSettings(method="h2o", budget="2MB", window=WINDOW))


def test_a_window_left_unset_shrinks_so_sinks_and_window_take_at_most_half_the_bytes(engine):
    session = engine.new_session(CacheSettings(method="h2o", budget="4MB", window=1024, fit_window=True))
    allocation = session.cache.allocation
    sink_bytes, window_bytes = allocate.exact_token_bytes("h2o", {}, session.cache.specs[0])
    exact = 30 * (4 * sink_bytes + allocation.byte_window * window_bytes)
    assert 1 <= allocation.byte_window < 1024 and exact <= 2_000_000
    assert all(budget > 0 for budget in allocation.layer_budgets)  # the other half buys middle entries


def test_a_window_that_fits_is_not_shrunk(engine):
    session = engine.new_session(CacheSettings(method="h2o", budget="64MB", window=WINDOW, fit_window=True))
    assert session.cache.allocation.byte_window == WINDOW


def test_a_fitted_window_is_saved_with_the_session(engine, store):
    session = engine.new_session(CacheSettings(method="h2o", budget="4MB", window=1024, fit_window=True))
    sid = persist.new_session_row(store, session, "fitted")
    persist.save_snapshot(store, sid, session)
    resumed, _ = persist.resume(store, engine, sid)
    assert resumed.settings.fit_window and resumed.cache.targets(0) == session.cache.targets(0)


def test_a_session_saved_before_fitting_keeps_its_window_as_given():
    saved = persist.settings_meta(CacheSettings(budget="4MB"))
    del saved["fit_window"]
    assert persist.settings_from_meta(saved, CacheSettings(fit_window=True)).fit_window is False


def test_only_a_window_left_unset_may_be_fitted():
    from kvchat.cli.options import cache_options
    from kvchat.cli.parser import build_parser

    def fits(argv: list[str], config: dict | None = None) -> bool:
        return cache_options(build_parser(config or {}).parse_args(argv)).for_method().fit_window

    assert fits(["ask", "hi"]) and not fits(["ask", "hi", "--window", "512"])
    assert not fits(["--window", "512", "ask", "hi"]) and not fits(["ask", "hi"], {"window": 512})


# -- allocation by measurement ---------------------------------------------------------------------
def test_the_measured_allocation_is_not_uniform_and_fits_the_budget(engine, document):
    auto = engine.new_session(CacheSettings(method="h2o", budget=LIMIT, window=WINDOW))
    even = engine.new_session(CacheSettings(method="h2o", budget=LIMIT, window=WINDOW, allocation="uniform"))
    weights = engine.measured("layer_weights")
    assert len(set(auto.cache.layer_budgets())) > 5 and len(set(even.cache.layer_budgets())) == 1
    # The layer that needs the most middle gets the most entries.
    assert auto.cache.layer_budgets().index(max(auto.cache.layer_budgets())) == weights.index(max(weights))
    auto.feed(document, chunk=256)
    assert sum(auto.cache.layer_nbytes()) == auto.cache.nbytes() <= LIMIT_BYTES


def test_the_measurement_is_recomputed_identically_when_its_file_is_damaged(tiny_model_dir, tmp_path, monkeypatch):
    # On the small second model: measuring the embedded one again takes half a minute.
    from kvchat.model.loading import load_model

    tiny = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    saved = tmp_path / "allocation.json"
    monkeypatch.setattr(calibrate, "measurement_path", lambda fingerprint: saved)
    weights = calibrate.layer_weights(tiny)
    saved.write_text("{not json")
    assert calibrate.layer_weights(tiny) == weights
    assert len(json.loads(saved.read_text())["curves"]) == tiny.num_layers == 2  # and written back


def test_a_resumed_session_keeps_its_allocation(engine, document, store):
    session = engine.new_session(CacheSettings(method="chelsea", budget=LIMIT, window=WINDOW))
    session.feed(document, chunk=256)
    sid = persist.new_session_row(store, session, "allocation")
    persist.save_snapshot(store, sid, session)
    resumed, _ = persist.resume(store, engine, sid)
    assert resumed.settings.allocation == "auto"
    assert resumed.cache.layer_budgets() == session.cache.layer_budgets()
    assert resumed.cache.nbytes() == session.cache.nbytes()


def test_switching_method_reallocates_the_bytes(engine, document):
    session = engine.new_session(CacheSettings(method="chelsea", budget=LIMIT, window=WINDOW))
    sizes = observed(session)
    session.feed(document, chunk=256)
    before = session.cache.layer_budgets()
    session.switch_method("h2o")  # h2o's scores make an entry dearer: fewer entries
    assert sum(session.cache.layer_budgets()) < sum(before)
    assert max(sizes) <= LIMIT_BYTES and session.cache.nbytes() <= LIMIT_BYTES


def test_a_fork_keeps_the_allocation(engine, document):
    session = engine.new_session(CacheSettings(method="h2o", budget=LIMIT, window=WINDOW))
    session.feed(document[:400])
    twin = session.fork()
    assert twin.cache.layer_budgets() == session.cache.layer_budgets()
    with pytest.raises(ValueError, match="allocation"):
        session.fork(CacheSettings(method="h2o", budget=LIMIT, window=WINDOW, allocation="uniform"))


def test_a_cache_without_measurements_shares_the_bytes_evenly():
    cache = CompressedCache(
        num_layers=4,
        num_kv_heads=3,
        group_size=3,
        head_dim=64,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        geometry=[LayerGeometry(inv_freq=torch.ones(32))] * 4,
        max_positions=8192,
        method="h2o",
        budget="4MB",
        window=64,
    )
    assert len(set(cache.layer_budgets())) == 1 and cache.layer_budgets()[0] > 0


def byte_cache(sliding: list[int | None]) -> CompressedCache:
    return CompressedCache(
        num_layers=len(sliding),
        num_kv_heads=2,
        group_size=2,
        head_dim=32,
        device=torch.device("cpu"),
        dtype=torch.float32,
        geometry=[LayerGeometry(inv_freq=torch.ones(16), sliding_window=w) for w in sliding],
        max_positions=8192,
        method="h2o",
        budget="2MB",
        window=64,
    )


def test_sliding_window_layers_leave_their_bytes_to_the_other_layers_middles():
    every = byte_cache([None] * 4).layer_budgets()
    local_global = byte_cache([48, None, 48, None])
    budgets = local_global.layer_budgets()
    assert budgets[0] == budgets[2] == 0  # no middle where the model slides
    assert min(budgets[1], budgets[3]) > max(every)  # the other layers' middles grow
    assert local_global.allocation.sliding_keep == [47, None, 47, None]  # their window less the query


def test_a_sliding_layer_keeps_at_most_an_even_share_of_a_small_byte_budget():
    allocation = byte_cache([100_000, None, 100_000, None]).allocation
    keep = allocation.sliding_keep[0]
    share = 2_000_000 / 4  # an even share of 2 MB over 4 layers
    assert keep * allocation.window_token_bytes <= share < (keep + 1) * allocation.window_token_bytes
    assert allocation.sliding_keep == [keep, None, keep, None]


# -- through the command line ------------------------------------------------------------------------
def kvchat(argv: list[str], capsys, monkeypatch, cwd) -> tuple[int, list[str], str]:
    from kvchat.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("KVCHAT_DB", str(cwd / "kvchat.db"))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, err.strip().splitlines(), out


def test_ask_with_a_byte_budget_reports_kv_bytes_within_it(embedded, tmp_path, capsys, monkeypatch):
    code, _, out = kvchat(
        [
            "ask",
            "What is the capital of France?",
            "--budget",
            "12 MB",
            "--window",
            "128",
            "--method",
            "h2o",
            "--dtype",
            "float32",
            "--json",
            "--no-save",
            "--max-new-tokens",
            "8",
        ],
        capsys,
        monkeypatch,
        tmp_path,
    )
    answer = json.loads(out)
    assert code == 0 and answer["budget"] == "12MB" and 0 < answer["kv_bytes"] <= 12_000_000


def test_a_byte_budget_too_small_for_a_given_window_is_one_line_naming_the_minimum(
    embedded, tmp_path, capsys, monkeypatch
):
    code, lines, _ = kvchat(
        ["ask", "hi", "--budget", "1MiB", "--window", "1024", "--method", "h2o", "--dtype", "float32", "--no-save"],
        capsys,
        monkeypatch,
        tmp_path,
    )
    assert code == 2 and len(lines) == 1
    assert "budget 1MiB is below the" in lines[0] and "a window of 1024" in lines[0]
    assert lines[0].endswith("raise --budget or lower --window")


def test_a_small_byte_budget_shrinks_the_window_that_was_not_given(embedded, tmp_path, capsys, monkeypatch):
    code, _, out = kvchat(
        [
            "ask",
            "hi",
            "--budget",
            "1MiB",
            "--method",
            "h2o",
            "--dtype",
            "float32",
            "--json",
            "--no-save",
            "--max-new-tokens",
            "4",
        ],
        capsys,
        monkeypatch,
        tmp_path,
    )
    answer = json.loads(out)
    assert code == 0 and 0 < answer["kv_bytes"] <= 2**20


def test_a_byte_budget_below_the_smallest_layout_is_refused_naming_the_sinks(embedded, tmp_path, capsys, monkeypatch):
    code, lines, _ = kvchat(
        ["ask", "hi", "--budget", "100KB", "--method", "h2o", "--dtype", "float32", "--no-save"],
        capsys,
        monkeypatch,
        tmp_path,
    )
    assert code == 2 and len(lines) == 1
    assert "budget 100KB is below the" in lines[0] and "a window of 1 take" in lines[0]
    assert lines[0].endswith("raise --budget or lower --sinks")


def test_a_bad_budget_unit_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    code, lines, _ = kvchat(["ask", "hi", "--budget", "64MX"], capsys, monkeypatch, tmp_path)
    assert code == 2 and lines == ["kvchat: error: budget '64MX': unknown unit 'MX'; use KB, KiB, MB, MiB, GB or GiB"]


def test_an_unknown_allocation_is_one_line_naming_the_choices(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit:
        kvchat(["ask", "hi", "--allocation", "pyramid"], capsys, monkeypatch, tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1
    assert "--allocation: invalid choice: 'pyramid'" in lines[0] and "'uniform'" in lines[0]


def test_allocation_defaults_to_auto_and_reaches_the_settings():
    from kvchat.cli.options import cache_options
    from kvchat.cli.parser import build_parser

    assert cache_options(build_parser({}).parse_args(["ask", "hi"])).for_method().allocation == "auto"
    args = build_parser({}).parse_args(["ask", "hi", "--allocation", "uniform", "--budget", "64MB"])
    settings = cache_options(args).for_method()
    assert settings.allocation == "uniform" and settings.budget == "64MB"
