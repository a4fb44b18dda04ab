"""Cross-field checks of the restart keys: whole restarts >= 0, a stage timeout >= 0, positive windows and
waits, and a warning where restarts cannot act (in-process workers)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dapo_core.config import ConfigError, ConfigWarning, load_config

CONFIG = Path(__file__).resolve().parents[4] / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_restarts=-1", "trainer.max_restarts: -1 must be a whole number >= 0"),
        ("trainer.stage_timeout_s=-5", "trainer.stage_timeout_s: -5.0 must be a finite number >= 0"),
        ("trainer.restart_window_s=0", "trainer.restart_window_s: 0.0 must be a finite number > 0"),
        ("trainer.restart_wait_s=-1", "trainer.restart_wait_s: -1.0 must be a finite number > 0"),
    ],
)
def test_bad_restart_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match="Invalid configuration") as err:
        load_config(CONFIG, [override])
    assert message in str(err.value)


def test_restarts_without_ray_warn_and_with_ray_load_quietly():
    with pytest.warns(ConfigWarning, match="act on Ray workers only"):
        load_config(CONFIG, ["trainer.use_ray=false", "trainer.max_restarts=2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(CONFIG, ["trainer.max_restarts=2", "trainer.stage_timeout_s=600"])
