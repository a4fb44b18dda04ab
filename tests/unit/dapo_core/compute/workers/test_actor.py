"""On-policy skip of the old_log_prob forward: the update without `old_log_probs` (π_old = the current
policy's own log-probs, detached) gives the loss, gradients, metrics and weights of the path with a separate
forward; the flow decides it from the config and refuses what would not be exact."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from dapo_core.algo.losses import agg_loss
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers import ActorWorker, RolloutWorker
from dapo_core.config import load_config, typed
from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory
from dapo_core.stages import compute_advantage_table
from flows.learn import old_log_prob_needed, pi_old_source
from tests.helpers import tiny_model_cfg

N = 4
ACTOR = {
    "strategy": "torch",
    "optim": {"lr": 1e-2, "lr_warmup_steps": 0},
    "ppo_mini_batch_size": 3,  # the whole batch (3 prompts × n): one optimizer step
    "ppo_micro_batch_size_per_gpu": 5,  # three uneven micro-batches: sums over them are tested too
    "ppo_epochs": 1,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 10.0,
    "loss_agg_mode": "token-mean",
    "policy_loss": {"loss_mode": "vanilla"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    cfg = tiny_model_cfg(num_hidden_layers=1, max_position_embeddings=64)
    return str(build_tiny_model(tmp_path_factory.mktemp("m"), cfg, seed=0))


def _batch(model_dir: str, gen_step: int, weights=None) -> pa.Table:
    t = pa.table(
        {
            "prompt_id": pa.array(range(3), pa.int64()),
            "data_source": ["synthetic_arith"] * 3,
            "ground_truth": ["3"] * 3,
            "prompt_ids": pa.array([[1, 10 + i, 11, 12 + i] for i in range(3)], pa.list_(pa.int32())),
        }
    )
    s = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 7, "do_sample": True}
    roll = RolloutWorker(model_dir, seed=5, train_sampling=s, val_sampling={**s, "do_sample": False})
    if weights is not None:
        roll.sync_weights(weights)
    out = roll.generate(B.repeat_interleave_prompts(t, N, uid_fn=uid_factory(0, "onp")), gen_step=gen_step)
    rewards = [1.0, -1.0, 0.5, -0.5, 1.0, 1.0, -1.0, 0.0, -1.0, 1.0, 1.0, -1.0]
    return out.append_column("reward", pa.array(rewards, pa.float32()))


def _grads_recorder(actor: ActorWorker) -> dict[str, torch.Tensor]:
    """The accumulated gradient of every parameter just before the optimizer step consumes it."""
    seen: dict[str, torch.Tensor] = {}
    for name, p in actor.engine.model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, name=name: seen.__setitem__(name, q.grad.clone()))
    return seen


def _update(actor: ActorWorker, table: pa.Table, step: int, separate: bool):
    if separate:
        table = actor.compute_log_prob(table)
    adv, _ = compute_advantage_table(table, pad_token_id=0, adv_estimator="grpo")
    return table, actor.update_actor(
        adv, global_steps=step, pi_old="old_log_probs" if separate else "current"
    )


def test_skipping_the_old_log_prob_forward_changes_no_loss_gradient_or_weight(model_dir):
    """Two on-policy updates (the second on data sampled after the first) with and without the separate
    forward: pg loss, clip fraction, grad norm, every gradient, entropy and the weights agree to float
    precision; the ratio is exactly 1 on the skip path."""
    ref = ActorWorker(model_dir, ACTOR, pad_token_id=0, temperature=1.0, rollout_n=N, total_steps=4)
    skip = ActorWorker(model_dir, ACTOR, pad_token_id=0, temperature=1.0, rollout_n=N, total_steps=4)
    g_ref, g_skip = _grads_recorder(ref), _grads_recorder(skip)
    weights = None
    for step in (1, 2):
        batch = _batch(model_dir, gen_step=step, weights=weights)
        with_old, m_ref = _update(ref, batch, step, separate=True)
        _, m_skip = _update(skip, batch, step, separate=False)
        assert "old_log_probs" in with_old.column_names
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy_loss"):
            assert m_skip[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), key
        assert m_skip["actor/pg_clipfrac"] == m_ref["actor/pg_clipfrac"] == 0.0
        assert m_skip["actor/ppo_kl"] == 0.0  # log π − log π_old is exactly 0 without the separate forward
        # actor/entropy: what the old_log_prob stage logs (agg over the whole batch), now from the update
        t = B.to_padded(with_old, 0, columns=["entropy"])
        stage_entropy = float(agg_loss(t["entropy"], t["response_mask"].float(), "token-mean"))
        assert m_skip["actor/entropy"] == pytest.approx(stage_entropy, rel=1e-5)
        assert g_ref.keys() == g_skip.keys() and g_ref
        for name in g_ref:
            torch.testing.assert_close(g_skip[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)
        w_ref, w_skip = _weights(ref), _weights(skip)
        for name in w_ref:
            torch.testing.assert_close(w_skip[name], w_ref[name], rtol=0, atol=1e-6, msg=name)
        if weights is not None:
            assert any(not torch.equal(w_ref[k], weights[k]) for k in w_ref)  # the update moved the policy
        weights = w_ref


def test_an_update_refuses_a_pi_old_the_batch_does_not_hold(model_dir):
    """π_old comes from where the flow says; a batch without that column is refused, naming it."""
    batch, _ = compute_advantage_table(_batch(model_dir, gen_step=1), pad_token_id=0, adv_estimator="grpo")
    actor = ActorWorker(model_dir, ACTOR, pad_token_id=0, temperature=1.0, rollout_n=N, total_steps=2)
    with pytest.raises(ValueError, match=r"pi_old='old_log_probs' but the batch has no old_log_probs column"):
        actor.update_actor(batch, global_steps=1)


def test_bypass_mode_takes_the_rollout_log_probs_as_pi_old_without_the_stage(model_dir):
    """Bypass mode over three mini-batches: the update of a batch without `old_log_probs` (the flow skips the
    stage) equals the update given `old_log_probs = rollout_log_probs` (what the stage commits in bypass
    mode), is not on-policy (the ratio against π_rollout is not 1), and reports the entropy the skipped
    stage would have."""
    bypass = {
        **ACTOR,
        "ppo_mini_batch_size": 1,  # three optimizer steps
        "ppo_micro_batch_size_per_gpu": 2,
        "policy_loss": {"loss_mode": "bypass_mode"},
    }
    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": True}
    kw = {"pad_token_id": 0, "temperature": 1.0, "rollout_n": N, "total_steps": 2, "rollout_correction": rc}
    batch = _batch(model_dir, gen_step=1)
    # a behaviour policy other than the trained one: the stale samples of the async order
    stale = pa.array(
        [
            [lp - 0.05 * (i % 3) for i, lp in enumerate(r)]
            for r in batch.column("rollout_log_probs").to_pylist()
        ],
        batch.schema.field("rollout_log_probs").type,
    )
    batch = batch.set_column(batch.schema.get_field_index("rollout_log_probs"), "rollout_log_probs", stale)
    adv, _ = compute_advantage_table(batch, pad_token_id=0, adv_estimator="grpo")
    given = adv.append_column("old_log_probs", adv.column("rollout_log_probs"))
    a, b = ActorWorker(model_dir, bypass, **kw), ActorWorker(model_dir, bypass, **kw)
    with_entropy = a.compute_log_prob(adv)  # what the skipped stage would log, from the same weights
    t = B.to_padded(with_entropy, 0, columns=["entropy"])
    stage_entropy = float(agg_loss(t["entropy"], t["response_mask"].float(), "token-mean"))
    m_skip = a.update_actor(adv, global_steps=1, pi_old="rollout_log_probs")
    m_given = b.update_actor(given, global_steps=1)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/rollout_corr/rollout_is_mean"):
        assert m_skip[key] == m_given[key], key
    assert m_skip["actor/ppo_kl"] != 0.0
    # from the update's forward: the mean over mini-batches of each one's token-mean entropy
    assert m_skip["actor/entropy"] == pytest.approx(stage_entropy, rel=0.1)
    assert "actor/entropy" not in m_given  # there the stage reported it
    w_a, w_b = _weights(a), _weights(b)
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def _cfg(*overrides: str):
    return typed(load_config("configs/tiny_cpu.yaml", list(overrides)))


def test_the_flow_skips_only_exactly_on_policy_updates(tmp_path):
    no_model = str(tmp_path)  # no config.json: no dropout
    # the CPU default takes 2 optimizer steps per batch (ppo_mini_batch_size 8 of 16 prompts): not on-policy
    assert "ppo_mini_batch_size=8" in old_log_prob_needed(_cfg(), model_path=no_model)
    on = "actor_rollout_ref.actor.ppo_mini_batch_size=16"
    assert old_log_prob_needed(_cfg(on), model_path=no_model) is None
    # the replay order's local updates: train_batch_size / parameter_sync_step prompts each
    assert old_log_prob_needed(_cfg(), parts=2, model_path=no_model) is None
    refused = {
        "when_on_policy=false": "actor_rollout_ref.actor.skip_old_log_prob_when_on_policy=false",
        "ppo_epochs=2": "actor_rollout_ref.actor.ppo_epochs=2",
        "use_kl_in_reward": "algorithm.use_kl_in_reward=true",
        "rollout_correction": "algorithm.rollout_correction.rollout_is=token",
    }
    for why, override in refused.items():
        assert why in old_log_prob_needed(_cfg(on, override), model_path=no_model), override
    # bypass mode: π_old is the rollout's log-probs, so no forward even with several mini-batches
    bypass = [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    assert old_log_prob_needed(_cfg(*bypass), model_path=no_model) is None
    always = "actor_rollout_ref.actor.skip_old_log_prob_when_on_policy=false"
    assert old_log_prob_needed(_cfg(*bypass, always), model_path=no_model) == always
    # what the update is told: π_old from the stage, the rollout or its own forward; the stage runs while
    # the critic warms up (the actor does not train then)
    warmup = "trainer.critic_warmup=1"
    for cfg, step, want in (
        (_cfg(), 1, "old_log_probs"),
        (_cfg(on), 1, "current"),
        (_cfg(*bypass), 1, "rollout_log_probs"),
        (_cfg(on, warmup), 1, "old_log_probs"),
        (_cfg(on, warmup), 2, "current"),
    ):
        assert pi_old_source(cfg, step, model_path=no_model) == want, (step, want)
    (tmp_path / "config.json").write_text('{"attention_dropout": 0.1, "hidden_size": 8}')
    assert "dropout 0.1" in old_log_prob_needed(_cfg(on), model_path=str(tmp_path))


def _weights(worker) -> dict:
    """The worker's current weights, copied (what a push sends)."""
    return {k: v.detach().clone() for k, v in worker.sync_tensors()}
