"""Where kvchat keeps its files: one data home, never the current folder."""

from __future__ import annotations

from pathlib import Path

import platformdirs
import pytest

from kvchat import paths


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("KVCHAT_HOME", "KVCHAT_DB", "KVCHAT_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_data_home_is_the_platform_user_data_dir(clean_env):
    assert paths.data_home() == Path(platformdirs.user_data_dir("kvchat", appauthor=False))
    assert paths.data_home().is_absolute()


def test_kvchat_home_moves_everything(clean_env, tmp_path):
    clean_env.setenv("KVCHAT_HOME", str(tmp_path))
    assert paths.data_home() == tmp_path
    assert paths.sessions_db() == tmp_path / "sessions" / "kvchat.db"
    assert paths.models_dir() == tmp_path / "models"
    assert paths.config_path() == tmp_path / "config.toml"


def test_a_relative_kvchat_home_is_fixed_to_an_absolute_path(clean_env, tmp_path):
    clean_env.chdir(tmp_path)
    clean_env.setenv("KVCHAT_HOME", "data")
    assert paths.data_home() == tmp_path / "data"


def test_the_sessions_db_is_db_then_kvchat_db_then_the_home(clean_env, tmp_path):
    clean_env.setenv("KVCHAT_HOME", str(tmp_path))
    clean_env.setenv("KVCHAT_DB", str(tmp_path / "env.db"))
    assert paths.sessions_db("/given.db") == Path("/given.db")
    assert paths.sessions_db() == tmp_path / "env.db"


def test_the_config_file_is_kvchat_config_else_the_platform_config_dir(clean_env, tmp_path):
    assert paths.config_path() == Path(platformdirs.user_config_dir("kvchat", appauthor=False)) / "config.toml"
    clean_env.setenv("KVCHAT_CONFIG", str(tmp_path / "mine.toml"))
    assert paths.config_path() == tmp_path / "mine.toml"


def test_no_default_path_is_relative_to_the_current_folder(clean_env):
    for path in (paths.data_home(), paths.sessions_db(), paths.models_dir(), paths.config_path()):
        assert path.is_absolute(), path
