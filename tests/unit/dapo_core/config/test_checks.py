"""Tests of dapo_core.config.checks: the cross-field checks (batch arithmetic, loss, KL, sampling, step
order, ...), every closed-set field refusing a value outside its set, and the restart keys (whole restarts
>= 0, a stage timeout >= 0, positive windows and waits, a warning where restarts cannot act)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.config import (
    ConfigError,
    ConfigWarning,
    load_config,
    typed,
)
from dapo_core.config.checks import _closed_set_fields
from tests.unit.dapo_core.config.support import TINY
from tests.unit.dapo_core.config.support import error as _error
from tests.unit.dapo_core.config.support import load as _load

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


# ------------------------------------------------------------------------------------ cross checks
@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        (
            ["reward_model.overlong_buffer.len=32"],
            "reward_model.overlong_buffer.len",
            "< data.max_response_length",
        ),
        (["reward_model.overlong_buffer.len=0"], "reward_model.overlong_buffer.len", "> 0"),
        (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "actor_rollout_ref.actor.clip_ratio_c", "> 1"),
        (["data.gen_batch_size=8"], "data.gen_batch_size", ">= train_batch_size"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=5"], "ppo_mini_batch_size", "does not divide"),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
            "ppo_micro_batch_size_per_gpu",
            "divide",
        ),
        (["actor_rollout_ref.actor.loss_agg_mode=token_mean"], "loss_agg_mode", "seq-mean-token-sum-norm"),
        (["critic.loss_agg_mode=mean"], "critic.loss_agg_mode", "token-mean"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "grpo"),
        (["algorithm.kl_penalty=k4"], "algorithm.kl_penalty", "low_var_kl"),
        (["actor_rollout_ref.actor.kl_loss_type=full"], "kl_loss_type", "not implemented"),
        (
            ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
            "algorithm.kl_ctrl.horizon",
            "> 0",
        ),
        (["algorithm.filter_groups.metric=null"], "algorithm.filter_groups.metric", "required"),
        (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n", ">= 1"),
        (["algorithm.rollout_correction.rollout_is=tok"], "rollout_is", "token or sequence"),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=true",
            ],
            "rollout_is_threshold",
            "boolean",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=5_0.5",
            ],
            "rollout_is_threshold",
            "must be <= upper",
        ),
        (["algorithm.rollout_correction.rollout_rs=geometric"], "rollout_rs", "not supported"),
        (["algorithm.rollout_correction.rollout_rs=seq_mean_k3"], "rollout_rs_threshold", "is None"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                "algorithm.rollout_correction.rollout_rs_threshold=0.5_2",
            ],
            "rollout_rs_threshold",
            "single upper bound",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs='token_k1,seq_mean_k3'",
                "algorithm.rollout_correction.rollout_rs_threshold='2,3,4'",
            ],
            "rollout_rs_threshold",
            "one per option",
        ),
        (["algorithm.rollout_correction.loss_type=pg"], "loss_type", "reinforce"),
        (
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "actor_rollout_ref.rollout.calculate_log_probs=false",
            ],
            "calculate_log_probs",
            "true",
        ),
        (["trainer.step_order=lockstep"], "trainer.step_order", "async"),
        (["trainer.step_order=async"], "algorithm.rollout_correction.rollout_is", "rollout_is=token"),
        (
            ["trainer.step_order=async", "algorithm.rollout_correction.preset=disabled"],
            "algorithm.rollout_correction.rollout_is",
            "rollout_is=token",
        ),
        (
            ["trainer.step_order=async", "trainer.max_staleness=-1"],
            "trainer.max_staleness",
            ">= 0",
        ),
        (
            [
                "trainer.step_order=async",
                "algorithm.rollout_correction.rollout_is=token",
                "trainer.parameter_sync_step=2",
            ],
            "trainer.parameter_sync_step",
            "remove it",
        ),
        (
            ["trainer.step_order=async", "trainer.max_staleness=0", "trainer.max_off_policy_threshold=3"],
            "trainer.max_off_policy_threshold",
            "max_staleness",
        ),
        (
            ["trainer.step_order=replay_buffer", "trainer.parameter_sync_step=3"],
            "parameter_sync_step",
            "divide",
        ),
        (["trainer.max_off_policy_strategy=skip"], "max_off_policy_strategy", "wait"),
        (["actor_rollout_ref.actor.strategy=fsdp"], "actor_rollout_ref.actor.strategy", "deepspeed"),
        (["actor_rollout_ref.actor.strategy=megatron"], "strategy", "torch"),
        (["actor_rollout_ref.rollout.name=sglang"], "rollout.name", "vllm"),
        (["trainer.device=tpu"], "trainer.device", "auto"),
        (["algorithm.filter_groups.refill=greedy"], "filter_groups.refill", "adaptive"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "required"),
        (["actor_rollout_ref.rollout.val_kwargs.top_p=0"], "val_kwargs.top_p", "(0, 1]"),
        (["eval.top_k=0"], "eval.top_k", "-1"),
        (["actor_rollout_ref.actor.deepspeed.offload_param=true"], "offload_param", "zero_stage=3"),
        (["data.synthetic.ops=[+,/]"], "data.synthetic.ops", "subset"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "dro_beta", "> 0"),
        (["trainer.logger=[wandb]"], "trainer.logger", "console"),
    ],
)
def test_cross_field_checks(overrides, key, text):
    msg = _error(*overrides)
    line = next((ln for ln in msg.splitlines() if key in ln), None)
    assert line is not None, msg
    assert text in line, line


def test_all_problems_reported_at_once():
    msg = _error("actor_rollout_ref.actor.clip_ratio_c=0.5", "data.gen_batch_size=4", "trainer.step_order=x")
    lines = [ln for ln in msg.splitlines() if ln.startswith("  ")]
    assert len(lines) == 3
    assert all(re.match(r"  [a-z_.]+: .+", ln) for ln in lines)


def test_valid_edge_values_pass():
    _load("reward_model.overlong_buffer.len=31", "actor_rollout_ref.actor.clip_ratio_c=1.0001")
    _load("algorithm.filter_groups.enable=false", "data.gen_batch_size=8")  # no DS: smaller gen batch is fine
    _load("actor_rollout_ref.actor.kl_loss_type=k3+", "algorithm.kl_penalty=low_var_kl+")
    _load(
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
        "algorithm.rollout_correction.rollout_rs='seq_mean_k1,seq_max_k3'",
        "algorithm.rollout_correction.rollout_rs_threshold='0.999_1.001,0.01'",
    )
    _load("trainer.step_order=replay_buffer", "trainer.parameter_sync_step=4")
    _load("trainer.step_order=async", "algorithm.rollout_correction.rollout_is=token")
    _load("trainer.step_order=async", "trainer.max_staleness=0")  # nothing stale, nothing to correct


def test_the_async_order_is_the_replay_loop_with_one_update_and_a_version_bound():
    from dapo_core.config import off_policy_threshold, runs_ahead, sync_parts, typed

    sync = typed(_load())
    assert not runs_ahead(sync) and sync_parts(sync) == 1
    a = typed(
        _load(
            "trainer.step_order=async",
            "trainer.max_staleness=2",
            "algorithm.rollout_correction.rollout_is=token",
        )
    )
    assert runs_ahead(a) and sync_parts(a) == 1
    assert off_policy_threshold(a) == 3  # span counts the step itself: lag 2 is span 3
    r = typed(_load("trainer.step_order=replay_buffer", "trainer.parameter_sync_step=4"))
    assert runs_ahead(r) and sync_parts(r) == 4 and off_policy_threshold(r) == 8


def test_warnings_not_errors():
    with pytest.warns(ConfigWarning, match="filter_groups.metric"):
        load_config(TINY, ["algorithm.filter_groups.metric=my_extra"])
    with pytest.warns(ConfigWarning, match="rollout.n"):
        load_config(
            TINY, ["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
        )
    with pytest.warns(ConfigWarning, match="max_position_embeddings"):
        load_config(TINY, ["data.max_response_length=250"])
    with pytest.warns(ConfigWarning, match="register_policy_loss"):
        load_config(TINY, ["actor_rollout_ref.actor.policy_loss.loss_mode=my_loss"])


@settings(max_examples=25, deadline=None)
@given(
    tbs=st.integers(1, 64),
    mini=st.integers(1, 64),
    n=st.integers(2, 8),
    micro=st.integers(1, 64),
)
def test_batch_divisibility_property(tbs, mini, n, micro):
    overrides = [
        f"data.train_batch_size={tbs}",
        f"data.gen_batch_size={tbs}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
    ]
    ok = tbs % mini == 0 and (mini * n) % micro == 0
    if ok:
        _load(*overrides)
    else:
        assert "does not divide" in _error(*overrides)


def test_option_lists_are_the_algo_layers():
    from dapo_core.algo import advantages, kl, losses
    from dapo_core.config import checks, choices

    assert choices.allowed("LossAggMode") == losses.LOSS_AGG_MODES and checks.KL_KINDS is kl.KL_KINDS
    assert checks.ADV_ESTIMATOR_REGISTRY is advantages.ADV_ESTIMATOR_REGISTRY
    assert set(checks.GROUP_ESTIMATORS) <= set(advantages.ADV_ESTIMATOR_REGISTRY)
    # verl names without an implementation here are refused at load, not at the first advantage stage
    assert "algorithm.adv_estimator" in _error("algorithm.adv_estimator=gdpo")
    # rollout correction is validated by the algo layer's rules: a boolean threshold fails even with IS off
    msg = _error("algorithm.rollout_correction.rollout_is_threshold=true")
    assert "algorithm.rollout_correction.rollout_is_threshold" in msg and "boolean" in msg


def test_eval_temperature_zero_is_greedy_and_negative_is_refused():
    # `dapo eval` decodes greedily at temperature 0 (evaluate_model: do_sample = temperature > 0); the rollout
    # still refuses 0 while it samples.
    cfg = load_config(TINY, ["eval.temperature=0", "eval.n=1"])
    assert cfg.eval.temperature == 0
    with pytest.raises(ConfigError, match=r"eval\.temperature"):
        load_config(TINY, ["eval.temperature=-1"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        load_config(TINY, ["actor_rollout_ref.rollout.temperature=0"])


def test_actor_mixed_precision_keys():
    mp = "actor_rollout_ref.actor.fsdp_config.mixed_precision."
    assert (
        typed(_load(mp + "param_dtype=bf16")).actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype
        == "bf16"
    )
    assert "param_dtype: 'float16' is not one of" in _error(mp + "param_dtype=float16")
    with pytest.warns(ConfigWarning, match=r"deepspeed\.bf16=true"):
        load_config(TINY, ["actor_rollout_ref.actor.strategy=deepspeed", mp + "param_dtype=bfloat16"])
