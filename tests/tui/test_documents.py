"""Attaching a file (kvchat/tui/documents.py): what is refused says why, in the app's units."""

from __future__ import annotations

import pytest

from kvchat.tui.documents import MAX_FILE_BYTES, DocumentError, read_text_file


def test_a_file_over_the_limit_is_refused_with_its_size_in_decimal_megabytes(tmp_path):
    big = tmp_path / "big.txt"
    with big.open("wb") as out:
        out.truncate(MAX_FILE_BYTES + 500_000)  # sparse: no 16 MB written
    with pytest.raises(DocumentError) as refused:
        read_text_file(str(big))
    assert str(refused.value) == f"{big} is 16.5 MB, over the 16 MB limit; split it"
