"""Where kvchat keeps its files: one per-user data home, never the current folder.

    data home     $KVCHAT_HOME, else the platform's user data dir (platformdirs)
    sessions DB   --db, else $KVCHAT_DB, else <data home>/sessions/kvchat.db
    models        <data home>/models   (converted model copies, calibration caches)
    config file   $KVCHAT_CONFIG, else <platform config dir>/config.toml; with
                  $KVCHAT_HOME set, <data home>/config.toml

A checkout run through the Makefile sets KVCHAT_HOME to the repository root, so `make
run` keeps using the repository's own `sessions/` and `models/` folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "kvchat"
ENV_HOME = "KVCHAT_HOME"
ENV_DB = "KVCHAT_DB"
ENV_CONFIG = "KVCHAT_CONFIG"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser().absolute() if value else None


def data_home() -> Path:
    """The folder all of kvchat's data lives under (not created here)."""
    return _env_path(ENV_HOME) or Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def sessions_db(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The sessions database: an explicit --db, else $KVCHAT_DB, else under the data home."""
    if explicit:
        return Path(explicit).expanduser()
    return _env_path(ENV_DB) or data_home() / "sessions" / "kvchat.db"


def models_dir() -> Path:
    """Converted/dequantised model copies and per-model calibration caches."""
    return data_home() / "models"


def config_path() -> Path:
    """The TOML config file (it need not exist)."""
    explicit = _env_path(ENV_CONFIG)
    if explicit:
        return explicit
    if _env_path(ENV_HOME):
        return data_home() / "config.toml"
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)) / "config.toml"
