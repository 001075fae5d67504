"""The command line's fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_process():
    """`run` for a kvchat process that loads the real model (tests/conftest.py marks its
    users slow)."""
    from .test_cli import run

    return run
