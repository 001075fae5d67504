"""Decode-time compressor work runs on one thread and hands the engine its count back."""

from __future__ import annotations

import pytest
import torch

from kvchat.compress.onethread import SMALL_INGEST, single_threaded, small_ingest_single_threaded


class Recorder:
    """Records the torch thread count its methods see."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @small_ingest_single_threaded
    def ingest(self, keys: torch.Tensor, fail: bool = False) -> None:
        self.seen.append(torch.get_num_threads())
        if fail:
            raise RuntimeError("boom")

    @single_threaded
    def observe(self, mass: torch.Tensor) -> None:
        self.seen.append(torch.get_num_threads())


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_a_decode_batch_and_an_observation_run_on_one_thread_then_restore_the_count(two_threads):
    rec = Recorder()
    rec.ingest(torch.zeros(3, 64, 8))
    rec.observe(torch.zeros(3, 3, 100))
    assert rec.seen == [1, 1]
    assert torch.get_num_threads() == 2


def test_a_prefill_flush_keeps_the_engine_threads(two_threads):
    rec = Recorder()
    rec.ingest(torch.zeros(3, SMALL_INGEST + 1, 8))
    assert rec.seen == [2]


def test_the_count_comes_back_when_the_work_fails(two_threads):
    with pytest.raises(RuntimeError):
        Recorder().ingest(torch.zeros(3, 64, 8), fail=True)
    assert torch.get_num_threads() == 2
