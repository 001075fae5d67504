"""The recall tier in a chat, on the real embedded model: what `kvchat ask --json`
reports, what a turn's metrics and the memory map say, and that a saved session, a
resume and a fork keep the setting (and a resume the tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat import native
from kvchat.chat.controller import Controller
from kvchat.cli.sessions import memory_table
from kvchat.settings import DEFAULT_RECALL, CacheSettings, SamplingSettings

from .test_coldstore import resident_bytes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# A window of 16 behind 4 sinks: a chat prompt alone sends tokens cold.
SMALL = ["--window", "16", "--sinks", "4", "--batch", "8", "--budget", "16", "--max-new-tokens", "8"]
QUESTION = (
    "The keeper of the lighthouse on the northern cape wrote down one number each night: "
    "the number of ships that passed. On the first night it was 41. What did he write down?"
)


def ask(cwd: Path, *options: str) -> dict:
    env = {**os.environ, "KVCHAT_DB": str(cwd / "kvchat.db"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", QUESTION, "--json", *SMALL, *options],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_ask_json_reports_the_cold_tier_and_what_was_recalled(tmp_path):
    answer = ask(tmp_path, "--recall", "32", "--no-save")
    assert answer["recall"] == 32
    assert answer["cold_bytes"] > 0  # the tokens that left the window, on disk
    assert 0 < answer["recalled"] <= 32  # cold tokens per KV head and step, over the answer
    assert answer["kv_bytes"] > 0


def test_ask_json_without_recall_has_no_cold_tier(tmp_path):
    answer = ask(tmp_path, "--recall", "off", "--no-save")
    assert (answer["recall"], answer["cold_bytes"], answer["recalled"]) == (0, 0, 0)


@pytest.mark.skipif(
    native.ranking_path() is None, reason="recall is on by default only where kvchat's ranking kernel runs"
)
def test_ask_recalls_by_default_where_kvchats_kernel_runs(tmp_path):
    answer = ask(tmp_path, "--no-save")
    assert answer["recall"] == DEFAULT_RECALL and answer["cold_bytes"] > 0


def small(recall: int | None) -> CacheSettings:
    return CacheSettings(method="window", budget="16", window=16, sinks=4, batch=8, recall=recall)


def test_a_session_without_a_recall_setting_takes_the_engines_default(engine):
    for kernel in (True, False):
        with native.kernels(coldrank=kernel):
            session = engine.new_session(small(None))
            expected = DEFAULT_RECALL if kernel and native.ranking_path() is not None else 0
            assert session.settings.recall == session.cache.recall == expected
            chat = Controller(engine, None, small(None), SamplingSettings(max_new_tokens=8))
            chat.load()
            assert chat.settings.recall == expected  # what /recall shows and new sessions take


@pytest.mark.skipif("avx2" not in native.ranking_paths(), reason="no AVX2 here, or no kernel")
def test_a_cpu_with_avx2_but_no_vnni_recalls_by_default(engine):
    # The kernel's AVX2 path (forced here): measured as fast in place as the VNNI one.
    with native.kernels(ranking_path="avx2"):
        session = engine.new_session(small(None))
        assert session.settings.recall == DEFAULT_RECALL
        recalling = [layer for layer in session.cache.compressed_layers if layer.recalls]
        assert {type(layer.recall.index).__name__ for layer in recalling} == {"NativeKeyIndex"}


@pytest.fixture
def saved(engine, store):
    """A controller that answered one question with recall 32 (saved), and its turn."""
    chat = Controller(engine, store, small(32), SamplingSettings(max_new_tokens=8))
    outcome = chat.send(QUESTION)
    assert outcome.save_error is None
    return chat, outcome.result


def test_a_turn_counts_disk_bytes_apart_from_kv_bytes(saved):
    chat, result = saved
    cache = chat.conversation.session.cache
    assert result.metrics.cold_bytes == cache.cold_bytes() > 0
    assert result.metrics.kv_bytes == cache.nbytes()  # RAM only: the index, not the rows on disk


def test_the_memory_map_says_which_tokens_the_last_answer_recalled(saved):
    chat, result = saved
    report = chat.memory_report()
    assert report.recall == 32 and report.cold_bytes > 0
    assert report.recall_steps == result.metrics.new_tokens
    assert report.recalled == pytest.approx(result.metrics.recalled, abs=0.01)
    assert len(report.layer_recalled) == len(report.layers)
    # Every recalled token lies in one span and one cell, and none in the answer itself
    # (it was in the window while it was written); a span's figure is the tokens a layer
    # recalled there, on average, so at most its length.
    assert report.recalled_tokens > 0
    assert sum(report.span_recalled) == pytest.approx(sum(report.cell_recalled), abs=0.1)
    assert 0 < sum(report.span_recalled) <= report.recalled_tokens
    assert report.span_recalled[-1] == 0
    assert all(n <= s.end - s.start for n, s in zip(report.span_recalled, report.spans))
    assert all(start < end for start, end in report.recalled_runs)


def test_sessions_show_memory_prints_the_disk_tier_of_the_saved_session(saved, store):
    chat, _ = saved
    text = memory_table(store, chat.conversation.session_id)
    assert "disk tier:" in text and "last answer:" in text


def test_resume_keeps_the_recall_setting(saved, engine, store):
    first, _ = saved
    chat = Controller(engine, store, small(0), SamplingSettings(max_new_tokens=8))
    chat.open_saved(first.conversation.session_id)
    session = chat.conversation.session
    assert session.settings.recall == 32 and session.cache.recall == 32
    assert chat.settings.recall == 32  # like the method, it follows the open conversation
    # The tier is saved with it (tests/recall/test_recall_saved.py): the resumed one is whole.
    assert session.cache.cold_bytes() == first.conversation.session.cache.cold_bytes() > 0
    before = session.cache.cold_bytes()
    chat.send("And on the second night?")
    assert session.cache.cold_bytes() > before


def test_a_fork_keeps_the_recall_setting(saved):
    chat, _ = saved
    twin = chat.fork()
    assert twin.session.settings.recall == 32 and twin.session.cache.recall == 32
    assert twin.session.cache.cold_bytes() == chat.conversation.session.cache.cold_bytes() > 0


def test_turning_recall_off_rebuilds_without_a_tier_and_is_saved(saved, store):
    chat, _ = saved
    outcome = chat.set_recall(0)
    session = chat.conversation.session
    assert outcome.tokens == len(session.token_ids) and outcome.save_error is None
    assert session.cache.recall == 0 and session.cache.cold_bytes() == 0
    assert store.get_session(chat.conversation.session_id).params["recall"] == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_after_a_turn_the_cold_rows_it_read_hold_none_of_the_process_memory(engine):
    session = engine.new_session(small(8))
    session.send(QUESTION, SamplingSettings(max_new_tokens=8))
    files = [layer.recall.store.own for layer in session.cache.compressed_layers if layer.recall is not None]
    files = [f for f in files if f is not None and f.view is not None]
    assert files, "the turn sent tokens cold"
    assert [resident_bytes(f.view.data_ptr()) for f in files] == [0] * len(files)
