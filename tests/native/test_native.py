"""kvchat's kernels (kvchat/native/__init__.py): the status says what was built and what
runs, the switch reads the environment and changes for a block, and a wrong call to a
kernel raises ValueError before any address reaches C."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat import native

ROOT = Path(__file__).resolve().parents[2]
H, D, M = 2, 16, 8  # KV heads, query channels, ranking channels


def importable(name: str) -> bool:
    try:
        importlib.import_module(f"kvchat.native._{name}")
    except ImportError:
        return False
    return True


def needs(name: str):
    return pytest.mark.skipif(not native.built(name), reason=f"kvchat.native._{name} not built (no C compiler)")


# ---- status ---------------------------------------------------------------------------


def test_the_status_says_which_kernels_are_built_as_imports_find_them():
    state = native.status()
    assert [k.name for k in state.kernels] == list(native.KERNELS)
    for kernel in state.kernels:
        assert kernel.built == importable(kernel.name)
        assert kernel.enabled == (kernel.built and getattr(native.settings(), kernel.name))
        assert (kernel.path is None) == (not kernel.enabled or kernel.name == "coldrank" and state.ranking_path is None)
    assert state.ranking_path == native.ranking_path() == state.coldrank.path


def test_the_status_text_has_a_line_per_kernel():
    lines = native.describe_status().splitlines()
    assert [line.split()[0] for line in lines] == list(native.KERNELS)
    with native.kernels(greedy=False):
        greedy = native.describe_status().splitlines()[1]
    assert ("switched off" if native.built("greedy") else "not built") in greedy


def test_a_kernel_switched_off_is_not_used_and_the_block_restores_the_switch():
    before = native.settings()
    with native.kernels(native.Settings(coldrank=False, summary=False)) as inside:
        assert inside == native.settings()
        assert not native.use("coldrank") and not native.use("summary")
        assert native.ranking_path() is None
        assert native.use("greedy") == native.built("greedy")
        assert not native.status().summary.enabled and native.status().summary.path is None
    assert native.settings() == before
    with pytest.raises(ValueError, match="no kernel named"):
        native.use("coldrnak")


@needs("coldrank")
def test_a_forced_ranking_path_is_the_path_and_one_this_cpu_lacks_is_refused():
    with native.kernels(ranking_path="scalar"):
        assert native.ranking_path() == "scalar" == native.status().ranking_path
    lacking = [p for p in native.RANKING_PATHS if p not in native.ranking_paths()]
    for path in lacking:
        with pytest.raises(ValueError, match="does not run it"):
            native.configure(ranking_path=path)


@needs("greedy")
def test_avx512_off_runs_the_compressors_kernels_plain_loops():
    with native.kernels(avx512=False):
        assert native.status().greedy.path == "scalar"
    assert native.status().greedy.path == ("avx512" if native.cpu_has_avx512() else "scalar")


# ---- the environment ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("words", "off"),
    [
        ("", set()),
        ("off", {"coldrank", "greedy", "summary", "farthest"}),
        ("-greedy, -summary", {"greedy", "summary"}),
        ("off,coldrank", {"greedy", "summary", "farthest"}),
        ("none,+farthest", {"coldrank", "greedy", "summary"}),
        ("-avx512", {"avx512"}),
        ("off,all", set()),
    ],
)
def test_kvchat_kernels_turns_kernels_off_and_on_in_order(words, off):
    settings = native.parse_settings({"KVCHAT_KERNELS": words})
    assert {f for f in (*native.KERNELS, "avx512") if not getattr(settings, f)} == off
    assert settings.ranking_path is None


def test_kvchat_ranking_path_forces_a_path_and_unknown_words_are_refused():
    assert native.parse_settings({"KVCHAT_RANKING_PATH": "AVX2"}).ranking_path == "avx2"
    assert native.parse_settings({"KVCHAT_RANKING_PATH": "auto"}).ranking_path is None
    with pytest.raises(ValueError, match="KVCHAT_RANKING_PATH"):
        native.parse_settings({"KVCHAT_RANKING_PATH": "avx9"})
    with pytest.raises(ValueError, match="names no kernel"):
        native.parse_settings({"KVCHAT_KERNELS": "-greedyy"})


def test_the_environment_is_read_at_import_and_the_loader_imports_no_torch():
    code = (
        "import sys, kvchat.native as n; s = n.status(); print(s.greedy.enabled, s.coldrank.enabled, "
        "s.farthest.enabled == n.built('farthest'), 'torch' in sys.modules)"
    )
    env = {**os.environ, "KVCHAT_KERNELS": "-greedy,-coldrank", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True", "False"]


# ---- checked calls: the recall kernel -------------------------------------------------


def index(rows: int = 40) -> tuple[torch.Tensor, ...]:
    """A packed index of `rows` random rows: (blocks, lo, step, channels)."""
    capacity = -(-rows // native.BLOCK) * native.BLOCK
    blocks = torch.zeros(H, capacity // native.BLOCK, 8 * M, dtype=torch.uint8)
    native.pack_codes(torch.randint(0, 16, (H, rows, M), dtype=torch.uint8), blocks, 0)
    lo = torch.randn(H, capacity).to(torch.bfloat16)
    step = torch.rand(H, capacity).to(torch.bfloat16)
    return blocks, lo, step, torch.arange(M) * 2


@needs("coldrank")
def test_a_right_call_ranks():
    blocks, lo, step, channels = index()
    query = torch.randn(H, 3, D)
    scores, top = torch.empty(H, 40), torch.empty(H, 5, dtype=torch.long)
    native.rank_scores(blocks, lo, step, 40, query, channels, scores, path="scalar")
    native.rank_top_rows(blocks, lo, step, 40, query, channels, top, path="scalar")
    assert torch.equal(top.sort(1).values, scores.topk(5, 1).indices.sort(1).values)


@needs("coldrank")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lo": lambda lo: lo.float()}, "lo must be bfloat16, not float32"),
        ({"channels": lambda c: c.int()}, "channels must be int64"),
        ({"query": lambda q: q.double()}, "query must be float32 or bfloat16"),
        ({"step": lambda s: s[:, :16]}, r"step must be shaped \[2, 48\]"),
        ({"query": lambda q: q[:1]}, r"query must be shaped \[2, \*, \*\]"),
        ({"channels": lambda c: c[:4]}, r"channels must be shaped \[8\]"),
        ({"query": lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)}, "query must be contiguous"),
        ({"lo": lambda lo: lo.t().contiguous().t()}, "lo must be contiguous"),
        ({"rows": lambda r: 49}, r"rows must be in \[1, 48\], not 49"),
        ({"rows": lambda r: 0}, r"rows must be in \[1, 48\], not 0"),
        ({"out": lambda o: torch.empty(H, 41, dtype=torch.long)}, r"k \(out's columns\) must be in \[1, 40\]"),
        ({"out": lambda o: o.int()}, "out must be int64"),
        ({"bias": lambda b: torch.zeros(H, 39)}, r"bias columns must be in \[40,"),
        ({"bias": lambda b: torch.zeros(H, 48, dtype=torch.float64)}, "bias must be float32"),
        ({"query": lambda q: q.to("meta")}, "query must be on the CPU, not meta"),
        ({"query": lambda q: q.tolist()}, "query must be a tensor or an array, not list"),
        ({"path": lambda p: "avx9"}, "ranking path 'avx9'"),
    ],
)
def test_a_wrong_ranking_call_raises_before_the_kernel_runs(change, message):
    blocks, lo, step, channels = index()
    args = {
        "blocks": blocks,
        "lo": lo,
        "step": step,
        "rows": 40,
        "query": torch.randn(H, 3, D),
        "channels": channels,
        "out": torch.empty(H, 5, dtype=torch.long),
        "bias": None,
        "path": None,
    }
    for name, make in change.items():
        args[name] = make(args[name])
    with pytest.raises(ValueError, match=message):
        native.rank_top_rows(**args)


@needs("coldrank")
def test_a_ranking_channel_outside_the_query_is_refused_by_the_kernel():
    blocks, lo, step, channels = index()
    with pytest.raises(ValueError, match="ranking channel outside"):
        native.rank_scores(blocks, lo, step, 40, torch.randn(H, 3, D), channels + D, torch.empty(H, 40))


@needs("coldrank")
def test_a_wrong_pack_is_refused():
    blocks = torch.zeros(H, 3, 8 * M, dtype=torch.uint8)
    codes = torch.zeros(H, 10, M, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"first must be in \[0, 38\], not 40"):
        native.pack_codes(codes, blocks, 40)
    with pytest.raises(ValueError, match="a multiple of 8 channels"):
        native.pack_codes(torch.zeros(H, 10, 6, dtype=torch.uint8), blocks, 0)
    with pytest.raises(ValueError, match=r"blocks must be shaped \[2, \*, 64\]"):
        native.pack_codes(codes, blocks[:1], 0)


@needs("coldrank")
def test_gather_checks_its_buffers_and_refuses_a_row_past_the_file():
    unit = 10
    view = torch.randint(0, 256, (30, H, unit), dtype=torch.uint8)  # a cold file's rows
    rows = torch.tensor([[3, 7], [0, 29]])
    out = torch.empty(H, 2, unit, dtype=torch.uint8)
    native.gather_rows([(view, 0, 1 << 62, 0)], rows, out)
    assert torch.equal(out[1, 1], view[29, 1]) and torch.equal(out[0, 0], view[3, 0])
    with pytest.raises(IndexError):  # past the view: outside the store, whatever the source says
        native.gather_rows([(view, 0, 1 << 62, 0)], torch.tensor([[3, 7], [0, 30]]), out)
    with pytest.raises(ValueError, match="rows must be int64"):
        native.gather_rows([(view, 0, 1 << 62, 0)], rows.int(), out)
    with pytest.raises(ValueError, match="source 0 must be uint8, not int8"):
        native.gather_rows([(view.view(torch.int8), 0, 1 << 62, 0)], rows, out)
    with pytest.raises(ValueError, match=r"source 0 must be shaped \[\*, 2, 10\]"):
        native.gather_rows([(view[:, :1].contiguous(), 0, 1 << 62, 0)], rows, out)


# ---- checked calls: the compressors' kernels --------------------------------------------


@needs("farthest")
def test_a_wrong_farthest_call_raises():
    tiles = torch.randn(H, 3, D, 16)
    chosen = torch.empty(H, 5, dtype=torch.long)
    native.farthest_centres(tiles, 40, chosen)
    with pytest.raises(ValueError, match=r"n must be in \[33, 48\], not 20"):
        native.farthest_centres(tiles, 20, chosen)
    with pytest.raises(ValueError, match=r"owner must be shaped \[2, 48\]"):
        native.farthest_centres(tiles, 40, chosen, torch.empty(H, 40, dtype=torch.long))
    with pytest.raises(ValueError, match="tiles must be contiguous"):
        native.farthest_centres(tiles.transpose(2, 3).contiguous().transpose(2, 3), 40, chosen)
    with pytest.raises(ValueError, match=r"k \(chosen's columns\) must be in \[0, 40\]"):
        native.farthest_centres(tiles, 40, torch.empty(H, 41, dtype=torch.long))


def summary_arrays(n: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    unit = rng.standard_normal((H, n, D)).astype(np.float32)
    return {
        "unit": unit / np.linalg.norm(unit, axis=-1, keepdims=True),
        "nn_sim": np.zeros((H, n), np.float32),
        "nn_idx": np.full((H, n), -1, np.int64),
    }


@needs("summary")
def test_a_wrong_summary_call_raises():
    a = summary_arrays()
    native.summary_append(a["unit"], 0, 4, a["nn_sim"], a["nn_idx"])
    assert (a["nn_idx"] >= 0).all()
    with pytest.raises(ValueError, match="nn_idx must be int64, not int32"):
        native.summary_append(a["unit"], 0, 4, a["nn_sim"], a["nn_idx"].astype(np.int32))
    with pytest.raises(ValueError, match=r"held must be in \[0, 12\], not 13"):
        native.summary_append(a["unit"], 13, 4, a["nn_sim"], a["nn_idx"])
    with pytest.raises(ValueError, match="unit must be contiguous"):
        native.summary_append(np.asfortranarray(a["unit"]), 0, 4, a["nn_sim"], a["nn_idx"])
    with pytest.raises(ValueError, match="nn_sim must be writable"):
        native.summary_append(a["unit"], 0, 4, _read_only(a["nn_sim"]), a["nn_idx"])
    objective = {"lam": 0.5, "phi_log": False, "alpha": 0.5, "beta": 1.0, "minmax": False}
    with pytest.raises(ValueError, match=r"mass must be shaped \[2, 3, 12\]"):
        native.summary_shrink(
            a["unit"],
            np.ones((H, 12)),
            np.zeros((H, 3, 11)),
            np.zeros((H, 12), np.int64),
            np.ones((H, 12), bool),
            a["nn_sim"],
            a["nn_idx"],
            budget=6,
            block=4,
            **objective,
        )


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@needs("greedy")
def test_a_wrong_greedy_call_raises():
    n, picked, sample = 20, 5, 8
    unit = torch.nn.functional.normalize(torch.randn(n, D), dim=-1)
    call = {
        "picked": picked,
        "sample": sample,
        "draws": torch.rand(picked, H, sample),
        "head": 1,
        "count": None,
        "weight": float(n),
        "mass": np.random.default_rng(0).random((3, n)),
        "out": np.empty(picked, np.int64),
        "lam": 0.5,
        "phi_log": False,
        "alpha": 0.5,
        "beta": 1.0,
        "minmax": False,
    }
    native.greedy_picks(unit @ unit.T, **call)
    assert len(set(call["out"].tolist())) == picked
    for change, message in [
        ({"mass": call["mass"].astype(np.float32)}, "mass must be float64, not float32"),
        ({"draws": torch.rand(2, H, sample)}, r"draws' steps must be in \[5,"),
        ({"head": 2}, r"head must be in \[0, 1\], not 2"),
        ({"out": np.empty(picked + 1, np.int64)}, r"out must be shaped \[5\]"),
        ({"count": np.ones(n, np.float64)}, "count must be float32"),
    ]:
        with pytest.raises(ValueError, match=message):
            native.greedy_picks(unit @ unit.T, **{**call, **change})
    with pytest.raises(ValueError, match=r"cosines must be shaped \[20, 20\]"):
        native.greedy_picks((unit @ unit.T)[:, :19].contiguous(), **call)
