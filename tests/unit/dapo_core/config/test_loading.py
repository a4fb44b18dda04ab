"""Tests of dapo_core.config.loading: overrides, unknown keys and wrong types named, base chains, struct
mode, the config hash and text, the helpers, rollout-correction presets and secret-safe YAML."""

from __future__ import annotations

import pytest
from omegaconf.errors import ConfigAttributeError

from dapo_core.config import (
    ConfigError,
    config_hash,
    gen_batch_size,
    load_config,
    load_config_text,
    need_reference_policy,
    resolve_device,
    to_safe_yaml,
    to_yaml,
    typed,
    use_critic,
)
from tests.unit.dapo_core.config.support import CONFIGS, TINY
from tests.unit.dapo_core.config.support import error as _error
from tests.unit.dapo_core.config.support import load as _load


def test_dotted_overrides_and_plus_prefix():
    c = _load("actor_rollout_ref.actor.clip_ratio_high=0.3", "+data.seed=7", "trainer.logger=[console]")
    assert c.actor_rollout_ref.actor.clip_ratio_high == 0.3
    assert c.data.seed == 7 and list(c.trainer.logger) == ["console"]


def test_string_accepted_for_list_keys_as_in_verl_scripts():
    c = _load("data.train_files=/x/train.parquet", "data.val_files=/x/aime.parquet")
    assert list(c.data.train_files) == ["/x/train.parquet"] and list(c.data.val_files) == ["/x/aime.parquet"]


def test_empty_override_value_is_empty_string():
    c = _load("actor_rollout_ref.model.path=")
    assert c.actor_rollout_ref.model.path == ""


def test_unknown_override_names_full_key_and_closest():
    msg = _error("actor_rollout_ref.actor.clip_ratio_hgh=0.3")
    assert "actor_rollout_ref.actor.clip_ratio_hgh" in msg
    assert "did you mean clip_ratio_high" in msg


def test_unknown_key_in_wrong_section_suggests_full_path():
    msg = _error("actor_rollout_ref.clip_ratio_high=0.3")
    assert "did you mean actor_rollout_ref.actor.clip_ratio_high" in msg


def test_plus_override_of_unknown_key_is_an_error():
    msg = _error("+algorithm.filter_groups.metrc=acc")
    assert "algorithm.filter_groups.metrc" in msg and "metric" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    (tmp_path / "child.yaml").write_text(
        f"base: {CONFIGS / 'dapo.yaml'}\ndata:\n  train_batch_sz: 4\nreward_model:\n  overlong_buffr: {{}}\n"
    )
    msg = _error(path=tmp_path / "child.yaml")
    assert "data.train_batch_sz" in msg and "did you mean train_batch_size" in msg
    assert "reward_model.overlong_buffr" in msg and "overlong_buffer" in msg  # all problems listed
    assert "child.yaml" in msg


def test_wrong_type_names_key():
    msg = _error("data.train_batch_size=abc")
    assert "data.train_batch_size" in msg and "wrong type" in msg
    msg = _error("actor_rollout_ref.actor.optim.betas=0.9")
    assert "actor_rollout_ref.actor.optim.betas" in msg


def test_override_without_equals():
    assert "key=value" in _error("data.seed")


def test_base_chain_and_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\ndata:\n  seed: 5\n")
    (tmp_path / "b.yaml").write_text(
        f"base: {CONFIGS / 'tiny_cpu.yaml'}\ndata:\n  seed: 4\n  shuffle: false\n"
    )
    c = _load(path=tmp_path / "a.yaml")
    assert c.data.seed == 5 and c.data.shuffle is False and c.data.train_batch_size == 16
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    assert "cycle" in _error(path=tmp_path / "c.yaml")
    assert "does not exist" in _error(path=tmp_path / "missing.yaml")


def test_struct_mode_rejects_new_attributes():
    c = _load()
    with pytest.raises(ConfigAttributeError):
        c.data.not_a_key = 1


# ------------------------------------------------------------------------------------- hash & text
def test_config_hash_stable_and_sensitive():
    a, b = _load(), _load()
    assert config_hash(a) == config_hash(b) and len(config_hash(a)) == 64
    assert config_hash(_load("data.seed=2")) != config_hash(a)
    assert config_hash(load_config_text(to_yaml(a))) == config_hash(a)


def test_load_config_text_validates():
    text = to_yaml(_load()).replace("clip_ratio_c: 10.0", "clip_ratio_c: 0.5")
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_config_text(text)
    with pytest.raises(ConfigError, match="base"):
        load_config_text("base: dapo.yaml\n")


# ----------------------------------------------------------------------------------------- helpers
def test_helpers():
    c = _load(path=None)
    assert gen_batch_size(c) == c.data.train_batch_size == 1024
    assert not need_reference_policy(c)
    assert need_reference_policy(_load("actor_rollout_ref.actor.use_kl_loss=true"))
    assert need_reference_policy(_load("algorithm.use_kl_in_reward=true"))
    assert not use_critic(c)
    assert use_critic(_load("algorithm.adv_estimator=gae"))
    assert not use_critic(_load("algorithm.adv_estimator=gae", "critic.enable=false"))
    assert use_critic(_load("critic.enable=true"))


def test_resolve_device():
    import torch

    assert resolve_device(_load("trainer.device=cpu")) == "cpu"
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(_load("trainer.device=auto")) == want
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"trainer\.device"):
            resolve_device(_load("trainer.device=cuda"))


def test_rollout_correction_preset_expands_at_load_and_reloads_the_same():
    c = load_config(TINY, ["algorithm.rollout_correction.preset=bypass_pg_geo_rs_seq_tis"])
    rc = c.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs, rc.rollout_rs_threshold) == (
        "sequence",
        "seq_mean_k1",
        "0.999_1.001",
    )
    assert rc.bypass_mode is True and rc.loss_type == "reinforce"
    assert load_config_text(to_yaml(c)).algorithm.rollout_correction == rc
    with pytest.raises(
        ConfigError, match=r"rollout_correction\.preset: unknown .* did you mean 'bypass_pg_is'"
    ):
        load_config(TINY, ["algorithm.rollout_correction.preset=bypas_pg_is"])


def test_to_safe_yaml_writes_secret_env_values_back_as_references(monkeypatch):
    # What the CLI hands to the flows (Prefect stores it as a parameter) and what the run records hold.
    monkeypatch.setenv("DAPO_TEST_API_KEY", "s3cr3t-v4lue")
    monkeypatch.setenv("DAPO_TEST_PLAIN", "not-a-secret-name")
    cfg = load_config(
        TINY,
        [
            "trainer.project_name=${oc.env:DAPO_TEST_API_KEY}",
            "trainer.experiment_name=${oc.env:DAPO_TEST_PLAIN}",
        ],
    )
    text = to_safe_yaml(cfg)
    assert "s3cr3t-v4lue" not in text and "${oc.env:DAPO_TEST_API_KEY}" in text
    assert "not-a-secret-name" in text  # only secret-looking names are masked
    again = typed(load_config_text(text))
    assert (again.trainer.project_name, again.trainer.experiment_name) == (
        "s3cr3t-v4lue",
        "not-a-secret-name",
    )
    assert to_safe_yaml(load_config(TINY)) == to_yaml(load_config(TINY))  # no secret: the same text
