"""The dapo-train flow with an exactly on-policy update (one mini-batch, one epoch): the old_log_prob stage is
skipped, logged as such, and the trained weights match a run that computes π_old separately."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml
from tests.integration.conftest import CONFIG, tiny_overrides

pytestmark = pytest.mark.slow
STEPS = 2


def _run(root: Path, name: str, skip: bool) -> Path:
    from flows.dapo_train import dapo_train

    extra = {
        "trainer.experiment_name": name,
        "trainer.use_ray": "false",
        "trainer.total_training_steps": STEPS,
        "trainer.save_freq": STEPS,
        "trainer.test_freq": -1,
        "trainer.val_before_train": "false",
        "algorithm.filter_groups.enable": "false",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,  # = data.train_batch_size: one optimizer step
        "actor_rollout_ref.actor.skip_old_log_prob_when_on_policy": str(skip).lower(),
    }
    out = dapo_train(to_yaml(load_config(CONFIG, tiny_overrides(root, **extra))), name)
    return Path(out["run_dir"])


def test_on_policy_run_skips_old_log_prob_and_trains_the_same_weights(tiny_assets):
    skipped, separate = _run(tiny_assets, "onp_skip", True), _run(tiny_assets, "onp_separate", False)
    for step in range(1, STEPS + 1):
        d = f"step_{step:06d}"
        assert not (skipped / d / "old_log_prob.manifest.json").exists()
        assert (separate / d / "old_log_prob.manifest.json").exists()
        assert (skipped / d / "update_actor.manifest.json").exists()
    rows = {
        run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (skipped, separate)
    }
    for a, b in zip(rows[skipped], rows[separate], strict=True):
        assert a["actor/old_log_prob_skipped"] == 1.0 and a["timing_s/old_log_prob"] == 0.0
        assert "actor/old_log_prob_skipped" not in b and b["timing_s/old_log_prob"] > 0
        assert a["actor/entropy"] == pytest.approx(b["actor/entropy"], rel=1e-5)
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-5, abs=1e-7)
    wa = load_file(str(skipped / "ckpt" / f"step_{STEPS}" / "actor" / "model.safetensors"))
    wb = load_file(str(separate / "ckpt" / f"step_{STEPS}" / "actor" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5, msg=k)
