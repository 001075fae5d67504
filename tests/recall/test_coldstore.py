"""The recall tier's rows on disk (kvchat/recall/cold_store.py): what a decode step reads back is
what went cold as its row codec keeps it (kvchat/recall/row_codec.py), from one file or
across the files a fork shares, in kvchat's own kernel and in PyTorch alike; the files never
have a name in their folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvchat import native
from kvchat.recall import row_codec
from kvchat.recall.cold_store import ColdStore, _nameless_file

H, D = 3, 8


@pytest.fixture(autouse=True, params=["native", "pytorch"])
def read_path(request):
    """Every test reads through both paths (`ColdStore.read`)."""
    if request.param == "native" and not native.built("coldrank"):
        pytest.skip("kvchat.native._coldrank not built (no C compiler at install)")
    with native.kernels(coldrank=request.param == "native"):
        yield


def rows_of(keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """keys [H, n, D] at rows [H, r] per head: [H, r, D]."""
    return keys.gather(1, rows[..., None].expand(-1, -1, D))


def kept(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [H, n, D] as the row codec keeps them."""
    return row_codec.decode(row_codec.encode(keys, values).transpose(0, 1), D, keys.dtype)


def assert_reads_back(store: ColdStore, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
    """The store gives, at `rows`, the keys and values [H, n, D] that went cold, as kept."""
    keys, values = kept(keys, values)
    got_keys, got_values = store.read(rows)
    assert torch.equal(got_keys, rows_of(keys, rows)) and torch.equal(got_values, rows_of(values, rows))


def test_rows_read_back_from_one_file():
    store = ColdStore(None, H, D, torch.bfloat16)
    keys, values = torch.randn(2, H, 50, D, dtype=torch.bfloat16)
    store.append(keys, values)
    assert_reads_back(store, keys, values, torch.randint(0, 50, (H, 7)))


def test_a_fork_of_a_fork_reads_each_row_from_the_file_that_holds_it():
    keys, values = torch.randn(2, H, 90, D, dtype=torch.bfloat16)
    parent = ColdStore(None, H, D, torch.bfloat16)
    parent.append(keys[:, :40], values[:, :40])
    child = parent.fork()
    child.append(keys[:, 40:70], values[:, 40:70])
    grandchild = child.fork()
    grandchild.append(keys[:, 70:], values[:, 70:])
    # every head reads from all three files at once, rows in no order
    assert_reads_back(grandchild, keys, values, torch.stack([torch.randperm(90)[:30] for _ in range(H)]))


def test_what_a_parent_writes_after_the_fork_is_not_the_forks():
    keys, values = torch.randn(2, H, 40, D, dtype=torch.bfloat16)
    parent = ColdStore(None, H, D, torch.bfloat16)
    parent.append(keys[:, :20], values[:, :20])
    twin = parent.fork()
    parent.append(keys[:, 20:30], values[:, 20:30])  # the same row numbers, other tokens
    twin.append(keys[:, 30:40], values[:, 30:40])
    rows = torch.arange(15, 30).expand(H, -1)
    twin_keys, _ = twin.read(rows)
    parent_keys, _ = parent.read(rows)
    keys, _ = kept(keys, values)
    assert torch.equal(parent_keys, keys[:, 15:30])
    assert torch.equal(twin_keys, torch.cat([keys[:, 15:20], keys[:, 30:40]], 1))


def test_a_cold_file_is_made_without_a_name_where_the_system_can(tmp_path):
    # A process killed at any moment then leaves nothing in the folder.
    fd = _nameless_file(tmp_path)
    try:
        assert list(tmp_path.iterdir()) == []
        if hasattr(os, "O_TMPFILE") and Path("/proc/self/fd").exists():
            # Linux names an O_TMPFILE file "#<inode> (deleted)"; an unlinked one keeps its name.
            assert Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith("#")
    finally:
        os.close(fd)


def test_a_folder_without_nameless_files_gets_a_named_one_unlinked_at_once(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # as on a system without the flag
    fd = _nameless_file(tmp_path)
    try:
        assert list(tmp_path.iterdir()) == []
        os.write(fd, b"rows")
        assert os.pread(fd, 4, 0) == b"rows"
    finally:
        os.close(fd)


def resident_bytes(address: int) -> int:
    """Resident bytes of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds that address")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_released_rows_leave_the_process_resident_memory_and_still_read_back():
    store = ColdStore(None, H, D, torch.float32)
    keys, values = torch.randn(2, H, 8192, D)
    store.append(keys, values)
    everything = torch.arange(8192).expand(H, -1)
    assert_reads_back(store, keys, values, everything)
    address = store.own.view.data_ptr()
    assert resident_bytes(address) >= 8192 * store.own.row_bytes  # every page a read touched
    store.release()
    assert resident_bytes(address) == 0
    assert_reads_back(store, keys, values, everything[:, ::97])
