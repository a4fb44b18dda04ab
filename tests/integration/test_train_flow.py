"""The real dapo-train flow (real Prefect, Ray or in-process workers, real run store) on a tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml, typed
from dapo_core.stages import DynamicSamplingExhausted
from tests.integration.conftest import (
    CONFIG,
    SHORT_RUN,
    kill_and_resume,
    tiny_overrides,
    train_cmd,
)

pytestmark = pytest.mark.slow


def _cfg(root, **extra):
    return load_config(CONFIG, tiny_overrides(root, **extra))


def test_flow_runs_steps_on_ray_and_commits_every_stage(tiny_assets):
    from flows.dapo_train import dapo_train

    cfg = _cfg(
        tiny_assets,
        **{
            "trainer.experiment_name": "ray2",
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 2,
            "trainer.test_freq": 2,
            "algorithm.filter_groups.enable": "false",
        },
    )
    out = dapo_train(to_yaml(cfg), "ray2")
    assert out["train_step"] == 2 and out["gen_step"] == 2
    run = Path(out["run_dir"])
    for step in (1, 2):
        for stage in (
            "prompts_g0",
            "generate_g0",
            "reward_g0",
            "batch",
            "old_log_prob",
            "advantage",
            "update_actor",
        ):
            assert (run / f"step_{step:06d}" / f"{stage}.manifest.json").exists(), (step, stage)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # validation before training, then two steps
    assert "actor/pg_loss" in rows[1] and "critic/score/mean" in rows[1] and "actor/grad_norm" in rows[2]
    assert "timing_s/adv" in rows[1] and "timing_per_token_ms/adv" in rows[1]  # docs/REFERENCE.md §7.2
    assert rows[1]["timing_s/sync_weights"] > 0 and rows[2]["timing_s/sync_weights"] > 0  # the push
    assert any(k.startswith("val-core/synthetic_arith/acc/mean@") for k in rows[2])
    assert (run / "ckpt" / "latest").read_text().strip() == "2"
    assert (run / "curves.png").stat().st_size > 1000
    # the sampled weights moved: trajectories of step 2 were generated after one update
    from dapo_core.store import RunStore

    store = RunStore(run)
    assert set(store.read_stage(2, "generate_g0").column("weight_version").to_pylist()) == {1}
    assert store.count("train", is_prompt=True, status="finished") == 2 * 8


def test_dynamic_sampling_gives_up_with_the_reference_error(tiny_assets):
    """A model whose groups never vary (random init: every answer wrong) exhausts max_num_gen_batches."""
    from dapo_core.compute.models import build_tiny_model
    from flows.dapo_train import dapo_train

    rand = build_tiny_model(
        tiny_assets / "models" / "random",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
        },
        seed=3,
    )
    cfg = _cfg(
        tiny_assets,
        **{
            "trainer.experiment_name": "exhaust",
            "trainer.use_ray": "false",
            "actor_rollout_ref.model.path": str(rand),
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.max_num_gen_batches": 2,
        },
    )
    with pytest.raises(DynamicSamplingExhausted, match=r"num_gen_batches=2 >= max_num_gen_batches=2"):
        dapo_train(to_yaml(cfg), "exhaust")
    run = tiny_assets / "runs" / "exhaust"
    # both generation batches were committed (nothing generated is lost) and no training stage ran
    assert (run / "step_000001" / "reward_g1.manifest.json").exists()
    assert not (run / "step_000001" / "update_actor.manifest.json").exists()


def _weights(run: Path, step: int) -> dict:
    return load_file(str(run / "ckpt" / f"step_{step}" / "actor" / "model.safetensors"))


@pytest.mark.timeout(900)
def test_killed_and_resumed_run_ends_bitwise_equal(tiny_assets, short_reference):
    """SIGKILL the training process inside step 3, start it again with the same run id: final weights are
    equal bit for bit to an uninterrupted run (CPU, one thread). The killed run has the default retention
    (`keep_rollouts_every=0`: only the step folders after its latest checkpoint are kept); the uninterrupted
    one kept everything."""
    from dapo_core.store import RunStore

    def killed_inside_step_3(run: Path) -> None:
        assert (run / "ckpt" / "latest").read_text().strip() == "2"
        with RunStore(run) as store:
            assert store.steps() == [3]  # steps 1 and 2 went after checkpoints 1 and 2

    extra = {**SHORT_RUN, "trainer.experiment_name": "resumed", "trainer.keep_rollouts_every": 0}
    run = tiny_assets / "runs" / "resumed"
    kill_and_resume(
        train_cmd(tiny_overrides(tiny_assets, **extra)),
        run,
        "step_000003/generate_g0.manifest.json",
        after_kill=killed_inside_step_3,
        reference=short_reference,
    )
    with RunStore(run) as store:
        assert store.steps() == []  # step 3 is covered by the final checkpoint
    with RunStore(short_reference) as store:
        assert store.steps() == [1, 2, 3]


def test_every_optional_stage_runs_gae_critic_kl_and_rollout_correction(tiny_assets):
    """ref, values, update_critic, KL in reward (adaptive controller), KL loss and IS + rejection sampling."""
    from flows.dapo_train import dapo_train

    cfg = _cfg(
        tiny_assets,
        **{
            "trainer.experiment_name": "full",
            "trainer.use_ray": "false",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 2,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.enable": "false",
            "algorithm.adv_estimator": "gae",
            "actor_rollout_ref.actor.use_kl_loss": "true",
            "actor_rollout_ref.actor.kl_loss_coef": 0.01,
            "algorithm.use_kl_in_reward": "true",
            "algorithm.kl_ctrl.type": "adaptive",
            "algorithm.kl_ctrl.kl_coef": 0.01,
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0",
            # the memory features, wired through flows/run_setup.py to actor, ref and critic
            "actor_rollout_ref.model.enable_gradient_checkpointing": "true",
            "actor_rollout_ref.model.use_remove_padding": "true",
            "actor_rollout_ref.actor.use_dynamic_bsz": "true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 256,
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 256,
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "true",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 256,
        },
    )
    out = dapo_train(to_yaml(cfg), "full")
    run = Path(out["run_dir"])
    for stage in ("ref", "values", "update_critic", "advantage", "update_actor"):
        assert (run / "step_000002" / f"{stage}.manifest.json").exists(), stage
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.01)
    assert rows[1]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.01)  # the adaptive controller moved
    assert "critic/vf_loss" in rows[1] and "actor/kl_loss" in rows[1] and "critic/vf_explained_var" in rows[1]
    assert "rollout_corr/rollout_is_mean" in rows[1] and "rollout_corr/rollout_rs_masked_fraction" in rows[1]
    assert (run / "ckpt" / "step_2" / "critic" / "critic.tensors").exists()


def test_deepspeed_strategy_trains_in_a_ray_actor(tiny_assets):
    from flows.dapo_train import dapo_train

    cfg = _cfg(
        tiny_assets,
        **{
            "trainer.experiment_name": "ds",
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 1,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.enable": "false",
            "actor_rollout_ref.actor.strategy": "deepspeed",
            "actor_rollout_ref.actor.deepspeed.zero_stage": 2,
        },
    )
    out = dapo_train(to_yaml(cfg), "ds")
    ckpt = Path(out["run_dir"]) / "ckpt" / "step_1" / "actor"
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "model.safetensors").exists()


def test_failed_open_run_leaves_no_workers_and_retried_draw_skips_no_prompt(tiny_assets, monkeypatch):
    """open_run failing after the workers started shuts them down; a prompt draw that fails after the sampler
    moved (ledger write) is retried with the same prompts."""
    import flows.run_setup as rs
    from dapo_core.compute.cluster import _LOCAL_REGISTRY
    from dapo_core.compute.models import load_tokenizer
    from flows.run_inputs import default_model_path, read_table, train_sampler
    from tasks.rollout import sample_prompts
    from tasks.runtime import ChunkSampler

    cfg = typed(_cfg(tiny_assets, **{"trainer.experiment_name": "openfail", "trainer.use_ray": "false"}))

    class BoomError(RuntimeError):
        pass

    def boom(*a, **k):
        raise BoomError("progress display failed")

    with monkeypatch.context() as mp:
        mp.setattr(rs, "StepProgress", boom)
        with pytest.raises(BoomError):
            rs.open_run(cfg, "openfail")
    assert not [key for key in _LOCAL_REGISTRY if key[0] == "openfail"]  # every in-process worker was closed

    rt = rs.open_run(cfg, "openfail")
    try:
        fresh = ChunkSampler(  # the configured sampler, untouched
            train_sampler(cfg, read_table(cfg.data.train_files), load_tokenizer(default_model_path(cfg)))
        )
        expected = fresh.next_batch(3).column("prompt_id").to_pylist()
        original = rt.store.register_prompts
        calls = []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise OSError("disk hiccup")
            return original(*args, **kwargs)

        monkeypatch.setattr(rt.store, "register_prompts", flaky)
        with pytest.raises(OSError, match="disk hiccup"):
            sample_prompts.fn(rt, 1, "g0", 3)
        uri, _ = sample_prompts.fn(rt, 1, "g0", 3)
        got = rt.store.read_uri(uri).column("prompt_id").to_pylist()
        assert list(dict.fromkeys(got)) == expected
    finally:
        rs.close_run(rt)


def test_resume_path_loads_the_named_checkpoint_and_may_rewrite_the_latest(tiny_assets):
    """resume_from_path of another run loads that run's checkpoint; resuming a run from before its latest
    checkpoint re-saves the later steps (no 'exists and is the latest' error); both end bitwise equal."""
    from flows.dapo_train import dapo_train

    common = {
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 1,
        "trainer.test_freq": -1,
        "trainer.val_before_train": "false",
        "trainer.use_ray": "false",
        "algorithm.filter_groups.enable": "false",
    }
    src = _cfg(tiny_assets, **common, **{"trainer.experiment_name": "rp_src"})
    dapo_train(to_yaml(src), "rp_src")
    src_run = tiny_assets / "runs" / "rp_src"
    step1 = src_run / "ckpt" / "step_1"
    again = _cfg(
        tiny_assets,
        **common,
        **{
            "trainer.experiment_name": "rp_src",
            "trainer.resume_mode": "resume_path",
            "trainer.resume_from_path": str(step1),
        },
    )
    out = dapo_train(to_yaml(again), "rp_src")
    assert out["train_step"] == 2 and out["gen_step"] == 2
    assert list((src_run / "ckpt").glob("abandoned-*/step_2"))  # the left branch is kept aside, never loaded
    assert (src_run / "ckpt" / "latest").read_text().strip() == "2"
    other = _cfg(
        tiny_assets,
        **common,
        **{
            "trainer.experiment_name": "rp_dst",
            "trainer.resume_mode": "resume_path",
            "trainer.resume_from_path": str(step1),
        },
    )
    out = dapo_train(to_yaml(other), "rp_dst")
    assert out["train_step"] == 2 and out["gen_step"] == 2
    dst_run = tiny_assets / "runs" / "rp_dst"
    assert not (dst_run / "step_000001").exists()  # started from the other run's step 1
    a, b = _weights(src_run, 2), _weights(dst_run, 2)
    for k in a:
        assert (a[k] == b[k]).all(), k
