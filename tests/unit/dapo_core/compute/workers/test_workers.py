"""Workers on a tiny model, in-process: rollout → log-probs → advantage → actor/critic updates."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers import ActorWorker, CriticWorker, RefWorker, RolloutWorker
from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory
from dapo_core.stages import compute_advantage_table
from tests.helpers import tiny_model_cfg

TINY = tiny_model_cfg(num_hidden_layers=1, max_position_embeddings=64)
ACTOR = {
    "strategy": "torch",
    "optim": {"lr": 1e-2, "lr_warmup_steps": 0},
    "ppo_mini_batch_size": 2,
    "ppo_micro_batch_size_per_gpu": 4,
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
    return str(build_tiny_model(tmp_path_factory.mktemp("m"), TINY, seed=0))


def _prompts(n_prompts: int = 2, n: int = 4) -> pa.Table:
    t = pa.table(
        {
            "prompt_id": pa.array(range(n_prompts), pa.int64()),
            "data_source": ["synthetic_arith"] * n_prompts,
            "ground_truth": ["3"] * n_prompts,
            "prompt_ids": pa.array([[1, 10 + i, 11, 12] for i in range(n_prompts)], pa.list_(pa.int32())),
        }
    )
    return B.repeat_interleave_prompts(t, n, uid_fn=uid_factory(0, "workers"))


def _rollout(model_dir):
    s = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "do_sample": True}
    return RolloutWorker(model_dir, seed=3, train_sampling=s, val_sampling={**s, "do_sample": False})


def test_rollout_adds_the_generate_columns_and_is_reproducible(model_dir):
    w = _rollout(model_dir)
    t = _prompts()
    a, b = w.generate(t, gen_step=1), w.generate(t, gen_step=1)
    assert a.column("response_ids").to_pylist() == b.column("response_ids").to_pylist()
    assert set(a.column("gen_step").to_pylist()) == {1} and set(a.column("weight_version").to_pylist()) == {0}
    assert [len(x) for x in a.column("rollout_log_probs").to_pylist()] == list(B.response_lengths(a))
    c = w.generate(t, gen_step=2)
    assert a.column("response_ids").to_pylist() != c.column("response_ids").to_pylist()


def test_actor_recomputes_rollout_log_probs_and_an_update_moves_the_policy(model_dir):
    roll = _rollout(model_dir)
    t = roll.generate(_prompts(), gen_step=0)
    actor = ActorWorker(model_dir, ACTOR, pad_token_id=0, temperature=1.0, rollout_n=4, total_steps=5)
    t = actor.compute_log_prob(t)
    for old, ro in zip(
        t.column("old_log_probs").to_pylist(), t.column("rollout_log_probs").to_pylist(), strict=True
    ):
        assert np.allclose(old, ro, atol=1e-5)
    rewards = pa.array([1.0, -1.0, -1.0, 1.0] * 2, pa.float32())
    t = t.append_column("reward", rewards)
    t, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo")
    before = {k: v.detach().clone() for k, v in actor.sync_tensors()}
    metrics = actor.update_actor(t, global_steps=1)
    assert {"actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac"} <= set(metrics)
    after = {k: v.detach().clone() for k, v in actor.sync_tensors()}
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # weight sync: the rollout now samples from the updated policy
    roll.sync_weights(after)
    t2 = actor.compute_log_prob(roll.generate(_prompts(), gen_step=5))
    for old, ro in zip(
        t2.column("old_log_probs").to_pylist(), t2.column("rollout_log_probs").to_pylist(), strict=True
    ):
        assert np.allclose(old, ro, atol=1e-5)


def test_ref_worker_matches_the_untrained_actor(model_dir):
    t = _rollout(model_dir).generate(_prompts(), gen_step=0)
    ref = RefWorker(model_dir, pad_token_id=0, temperature=1.0).compute_ref_log_prob(t)
    for a, b in zip(
        ref.column("ref_log_probs").to_pylist(), t.column("rollout_log_probs").to_pylist(), strict=True
    ):
        assert np.allclose(a, b, atol=1e-5)


def test_critic_values_then_updates_reduce_the_value_loss(model_dir):
    t = _rollout(model_dir).generate(_prompts(), gen_step=0)
    critic = CriticWorker(
        model_dir,
        {"optim": {"lr": 3e-3}, "ppo_mini_batch_size": 2, "ppo_epochs": 1, "cliprange_value": 100.0},
        pad_token_id=0,
        rollout_n=4,
    )
    t = critic.compute_values(t)
    assert all(v == 0.0 for row in t.column("values").to_pylist() for v in row)  # zero-initialised head
    t = t.append_column("reward", pa.array([1.0] * t.num_rows, pa.float32()))
    t, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="gae", gamma=1.0, lam=1.0)
    losses = [critic.update_critic(t, global_steps=i)["critic/vf_loss"] for i in range(4)]
    assert losses[-1] < losses[0]


def test_workers_read_their_input_and_commit_their_output_themselves(model_dir, tmp_path):
    """The driver hands a StageJob (URIs and limits); the worker reads, computes, validates and commits a
    column delta; the committed views equal what the in-memory calls give."""
    from dapo_core.data.schemas import SchemaError
    from dapo_core.store import RunStore
    from dapo_core.store.jobs import StageJob

    store = RunStore(tmp_path / "run")
    root = str(store.root)
    prompts = _prompts()
    p_uri = store.write_stage(1, "prompts_g0", prompts)
    limits = {"n": 4, "vocab_size": 1000, "max_prompt_length": 16, "max_response_length": 6}

    def job(stage: str, uri: str, schema: str | None) -> StageJob:
        return StageJob(root=root, step=1, stage=stage, input_uri=uri, timer=stage, schema=schema, **limits)

    roll = _rollout(model_dir)
    g_uri, m = roll.generate_stage(job("generate_g0", p_uri, "generate"), gen_step=1)
    assert m["perf/gen_tokens"] > 0 and "timing_s/generate_g0" in m
    want = roll.generate(prompts, gen_step=1)
    assert store.read_uri(g_uri).equals(want)
    assert store.manifest(1, "generate_g0")["file_columns"] == [
        "response_ids",
        "rollout_log_probs",
        "finish_reason",
        "weight_version",
        "gen_step",
    ]
    actor = ActorWorker(model_dir, ACTOR, pad_token_id=0, temperature=1.0, rollout_n=4, total_steps=5)
    o_uri, m = actor.log_prob_stage(job("old_log_prob", g_uri, None))  # no reward columns: not validated
    assert "actor/entropy" in m
    assert store.read_uri(o_uri).equals(actor.compute_log_prob(want))
    # a table that fails validation commits nothing
    bad = {**limits, "max_response_length": 2}
    with pytest.raises(SchemaError):
        roll.generate_stage(
            StageJob(
                root=root, step=1, stage="generate_g1", input_uri=p_uri, timer="g", schema="generate", **bad
            ),
            gen_step=1,
        )
    assert not store.is_committed(1, "generate_g1")
    store.close()
