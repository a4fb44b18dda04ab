"""Cross-field checks: every closed-set field refuses a value outside its set, and the restart keys (whole
restarts >= 0, a stage timeout >= 0, positive windows and waits, a warning where restarts cannot act)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dapo_core.config import ConfigError, ConfigWarning, load_config, typed
from dapo_core.config.checks import _closed_set_fields

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


def test_closed_set_fields_are_the_schemas_literal_fields_stored_as_plain_values():
    fields = {key: (values, is_list) for key, values, is_list in _closed_set_fields()}
    assert fields["actor_rollout_ref.actor.loss_agg_mode"][0][0] == "token-mean"
    assert fields["trainer.logger"] == (("console", "jsonl", "tensorboard"), True)
    assert fields["algorithm.rollout_correction.rollout_is"] == (("token", "sequence"), False)
    assert len(fields) == 24
    cfg = typed(load_config(CONFIG, ["actor_rollout_ref.actor.deepspeed.zero_stage=2"]))
    assert type(cfg.actor_rollout_ref.actor.deepspeed.zero_stage) is int  # OmegaConf stores the value's type
    assert type(cfg.trainer.step_order) is str


@pytest.mark.parametrize(
    ("key", "values"),
    [pytest.param(key, values, id=key) for key, values, is_list in _closed_set_fields() if not is_list],
)
def test_a_value_outside_a_closed_set_is_one_line_naming_the_key_and_the_set(key, values):
    bad = 7 if isinstance(values[0], int) else "not-a-choice"
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [f"{key}={bad}"])
    lines = [ln for ln in str(err.value).splitlines() if ln.startswith(f"  {key}:")]
    assert len(lines) == 1, str(err.value)
    assert all(str(v) in lines[0] for v in values), lines[0]
