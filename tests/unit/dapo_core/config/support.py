"""Shared by the config tests: the configs folder, the tiny CPU config, and loading with warnings off."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dapo_core.config import ConfigError, ConfigWarning, load_config

CONFIGS = Path(__file__).resolve().parents[4] / "configs"
TINY = CONFIGS / "tiny_cpu.yaml"


def load(*overrides: str, path: Path | None = TINY):
    """The config at `path` (null: the schema's defaults) with `overrides`, its warnings ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(path, overrides)


def error(*overrides: str, path: Path | None = TINY) -> str:
    """The `ConfigError` text that loading `path` with `overrides` raises."""
    with pytest.raises(ConfigError) as ei:
        load(*overrides, path=path)
    return str(ei.value)
