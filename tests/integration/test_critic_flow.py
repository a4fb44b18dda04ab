"""A short GAE run through the real flow with the critic's memory features and lr schedule switched on, and a
validation that the workers commit themselves (in-process workers, ephemeral Prefect)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_core.config import load_config, to_yaml
from dapo_core.store import RunStore
from tests.integration.conftest import CONFIG, tiny_overrides


def test_gae_flow_with_critic_memory_features_schedule_and_worker_validation(tiny_assets):
    from flows.dapo_train import dapo_train

    overrides = {
        "trainer.experiment_name": "critic-mem",
        "trainer.use_ray": "false",
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 2,
        "trainer.test_freq": 2,
        "trainer.val_before_train": "false",
        "actor_rollout_ref.rollout.val_kwargs.n": 2,
        "algorithm.filter_groups.enable": "false",
        "algorithm.adv_estimator": "gae",
        "critic.model.enable_gradient_checkpointing": "true",
        "critic.model.use_remove_padding": "true",
        "critic.use_dynamic_bsz": "true",
        "critic.ppo_max_token_len_per_gpu": 128,
        "critic.forward_max_token_len_per_gpu": 256,
        "critic.optim.lr": 1e-3,
        "critic.optim.lr_warmup_steps": 2,
        "critic.optim.betas": "[0.8,0.95]",
    }
    cfg = load_config(CONFIG, tiny_overrides(tiny_assets, **overrides))
    out = dapo_train(to_yaml(cfg), "critic-mem")
    run = Path(out["run_dir"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # warm-up over 2 steps: lr 0 at the first update, half at the second
    assert [r["critic/lr"] for r in rows[:2]] == pytest.approx([0.0, 5e-4])
    assert all("critic/vf_loss" in r for r in rows[:2])
    assert any(k.startswith("val-core/synthetic_arith/acc/mean@2") for k in rows[1])
    with RunStore(run) as store:
        assert {"val_prompts", "val_generate", "val", "values", "update_critic"} <= set(
            store.committed_stages(2)
        )
        val = store.read_stage(2, "val")
        assert val.num_rows == 2 * store.read_stage(2, "val_prompts").num_rows
    assert (run / "ckpt" / "step_2" / "critic" / "critic.tensors").exists()
