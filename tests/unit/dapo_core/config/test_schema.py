"""Tests of dapo_core.config.schema: every field documented, `configs/dapo.yaml` equal to the defaults, verl's
key paths and defaults, and the shipped configs (tiny CPU, the 32B runs) carrying the reference values."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from dapo_core.config import (
    DapoConfig,
    all_keys,
    field_docs,
    gen_batch_size,
)
from tests.unit.dapo_core.config.support import CONFIGS
from tests.unit.dapo_core.config.support import load as _load


# ------------------------------------------------------------------------------------------ schema
def _sections(cls, prefix=""):
    for f in dataclasses.fields(cls):
        yield cls, f, prefix + f.name
        if f.default_factory is not dataclasses.MISSING:
            sub = f.default_factory()
            if dataclasses.is_dataclass(sub):
                yield from _sections(type(sub), prefix + f.name + ".")


def test_every_field_has_a_one_line_docstring():
    missing = [key for cls, f, key in _sections(DapoConfig) if not field_docs(cls).get(f.name)]
    assert missing == []
    multiline = [key for cls, f, key in _sections(DapoConfig) if "\n" in field_docs(cls)[f.name]]
    assert multiline == []


def test_dapo_yaml_equals_schema_defaults_and_comments_every_key():
    base = _load(path=CONFIGS / "dapo.yaml")
    defaults = OmegaConf.structured(DapoConfig)
    assert OmegaConf.to_container(base) == OmegaConf.to_container(defaults)
    text = (CONFIGS / "dapo.yaml").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert all("#" in ln for ln in lines), [ln for ln in lines if "#" not in ln]
    assert len(lines) == len(all_keys())


def test_verl_key_paths_exist():
    keys = set(all_keys())
    for key in (
        "data.gen_batch_size",
        "actor_rollout_ref.actor.clip_ratio_low",
        "actor_rollout_ref.actor.clip_ratio_high",
        "actor_rollout_ref.actor.clip_ratio_c",
        "actor_rollout_ref.actor.loss_agg_mode",
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "actor_rollout_ref.rollout.val_kwargs.top_p",
        "algorithm.filter_groups.max_num_gen_batches",
        "algorithm.rollout_correction.rollout_is_threshold",
        "reward_model.overlong_buffer.penalty_factor",
        "trainer.max_off_policy_strategy",
        "eval.top_p",
    ):
        assert key in keys


def test_reference_defaults():
    c = _load(path=None)
    a = c.actor_rollout_ref.actor
    assert (a.clip_ratio, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.2, 0.2, 3.0)
    assert a.kl_loss_type == "low_var_kl" and a.kl_loss_coef == 0.001 and a.optim.lr == 1e-6
    assert c.algorithm.kl_ctrl.kl_coef == 0.001 and c.algorithm.kl_ctrl.horizon == 10000
    assert c.algorithm.rollout_correction.rollout_is is None  # YAML default, not the dataclass "sequence"
    assert c.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert c.actor_rollout_ref.rollout.calculate_log_probs is True
    assert c.trainer.max_off_policy_threshold == 8 and c.trainer.seed == 1
    assert (c.eval.n, c.eval.temperature, c.eval.top_p, c.eval.top_k) == (8, 1.0, 0.7, -1)
    t = c.actor_rollout_ref.model.tiny
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.head_dim) == (128, 384, 2, 32)


# --------------------------------------------------------------------------------------- overrides


# -------------------------------------------------------------------------------------- the configs
def test_tiny_cpu_is_dapo_on_small_batches():
    c = _load()
    a, r, alg = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout, c.algorithm
    assert (
        c.data.synthetic.enable
        and c.actor_rollout_ref.model.path == ""
        and c.actor_rollout_ref.model.sft.enable
    )
    assert (r.name, a.strategy, c.trainer.device) == ("hf", "torch", "cpu")
    assert (c.data.train_batch_size, gen_batch_size(c), r.n) == (16, 32, 8)
    assert (c.data.max_prompt_length, c.data.max_response_length) == (64, 32)
    assert (a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu) == (8, 64)
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.loss_agg_mode) == (
        0.2,
        0.28,
        10.0,
        "token-mean",
    )
    fg = alg.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "acc", 10)
    ob = c.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 8, 1.0)
    assert (c.trainer.total_training_steps, c.trainer.test_freq, c.trainer.save_freq) == (100, 20, 20)


COMMON_32B = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_ctrl.kl_coef": 0.0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.0,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,
    "actor_rollout_ref.actor.clip_ratio_c": 10.0,
    "data.max_prompt_length": 2048,
    "data.max_response_length": 20480,
    "reward_model.overlong_buffer.enable": True,
    "reward_model.overlong_buffer.len": 4096,
    "reward_model.overlong_buffer.penalty_factor": 1.0,
    "data.train_batch_size": 512,
    "actor_rollout_ref.rollout.n": 16,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.7,
    "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": 10,
    "actor_rollout_ref.actor.optim.weight_decay": 0.1,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 4,
    "actor_rollout_ref.rollout.enable_chunked_prefill": True,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.actor.strategy": "fsdp2",  # the recipe's FSDP over all 128 GPUs
    "reward_model.reward_manager": "dapo",
    "trainer.val_before_train": True,
    "trainer.test_freq": 5,
    "trainer.save_freq": 5,
    "trainer.total_epochs": 1,
    "trainer.resume_mode": "auto",
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 16,
    "eval.n": 32,
    "eval.temperature": 1.0,
    "eval.top_p": 0.7,
    # the memory features: the reference values, honoured
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 22528,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 22528,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 22528,
}


NOT_YET_32B = {
    "actor_rollout_ref.rollout.max_num_batched_tokens": (8192, "22528"),
}
"""32B reference values not implemented yet: (value in the config, reference value in the line's comment)."""


@pytest.mark.parametrize(
    ("name", "aime", "specific"),
    [
        (
            "dapo_qwen2.5_32b.yaml",
            "52",
            {
                "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
                "algorithm.filter_groups.enable": True,
                "algorithm.filter_groups.metric": "acc",
                "algorithm.filter_groups.max_num_gen_batches": 10,
                "gen": 1536,
                "actor_rollout_ref.rollout.gpu_memory_utilization": 0.80,
            },
        ),
        (
            "dapo_wo_ds_qwen2.5_32b.yaml",
            "50",
            {
                "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
                "algorithm.filter_groups.enable": False,
                "gen": 512,
                "actor_rollout_ref.rollout.gpu_memory_utilization": 0.7,
            },
        ),
        (
            "dapo_early_qwen2.5_32b.yaml",
            "44",
            {
                "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
                "algorithm.filter_groups.enable": False,
                "gen": 512,
                "actor_rollout_ref.rollout.gpu_memory_utilization": 0.80,
            },
        ),
    ],
)
def test_32b_configs_carry_reference_values(name, aime, specific, monkeypatch):
    for var in ("MODEL_PATH", "TRAIN_FILE", "TEST_FILE"):
        monkeypatch.delenv(var, raising=False)
    c = _load(path=CONFIGS / name)
    for key, want in {**COMMON_32B, **specific}.items():
        got = gen_batch_size(c) if key == "gen" else OmegaConf.select(c, key)
        assert got == want, (name, key, got, want)
    # Not implemented yet: at the default, with the reference value kept in the line's comment.
    lines = (CONFIGS / name).read_text().splitlines()
    for key, (default, reference) in NOT_YET_32B.items():
        assert OmegaConf.select(c, key) == default, (name, key)
        leaf = key.rsplit(".", 1)[1]
        commented = [
            ln for ln in lines if ln.strip().startswith(f"{leaf}:") and f"reference: {reference}" in ln
        ]
        assert commented, (name, key, reference)
    assert f"{aime}%" in (CONFIGS / name).read_text().splitlines()[0]
    assert c.actor_rollout_ref.model.path == "Qwen/Qwen2.5-32B"
    monkeypatch.setenv("MODEL_PATH", "/models/q32")
    monkeypatch.setenv("TRAIN_FILE", "/d/train.parquet")
    c = _load(path=CONFIGS / name)
    assert c.actor_rollout_ref.model.path == "/models/q32" and list(c.data.train_files) == [
        "/d/train.parquet"
    ]
