"""On GPU every role asks Ray for devices of its own; a cluster too small for that is refused up front, and
the refusal's fix, applied through the config loader, passes the same check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapo_core.compute.cluster import PlacementError
from dapo_core.config import load_config, typed
from flows.run_setup import check_gpu_count, gpu_demand

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _cfg(name: str, *overrides: str):
    return typed(load_config(CONFIGS / name, list(overrides)))


def test_the_recipe_layout_asks_for_its_gpus_twice_and_is_refused_on_its_own_node_count():
    cfg = _cfg("dapo_qwen2.5_32b.yaml")  # 16 nodes × 8 GPUs, fsdp2, vLLM TP 4, no KL: actor and rollout
    assert gpu_demand(cfg) == {"rollout": 128, "actor": 128}
    check_gpu_count(cfg, 256.0)
    with pytest.raises(PlacementError) as e:
        check_gpu_count(cfg, 128.0)
    text = str(e.value)
    assert "256 GPUs (rollout 128, actor 128)" in text and "has 128" in text
    assert "trainer.nnodes / trainer.n_gpus_per_node" in text
    world = int(re.search(r"at most (\d+)", text).group(1))
    assert world == 64
    check_gpu_count(_cfg("dapo_qwen2.5_32b.yaml", "trainer.n_gpus_per_node=4"), 128.0)  # the fix fits


def test_reference_and_critic_ranks_add_their_gpus_and_the_fix_counts_them():
    cfg = _cfg(
        "dapo_qwen2.5_32b.yaml",
        "trainer.nnodes=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    )
    assert gpu_demand(cfg) == {"rollout": 8, "actor": 8, "ref": 8}
    with pytest.raises(PlacementError, match=r"at most 2 \(a multiple of .*=2\)"):
        check_gpu_count(cfg, 8.0)  # 8 // 3 = 2 ranks per role, already a multiple of TP 2
    check_gpu_count(
        _cfg(
            "dapo_qwen2.5_32b.yaml",
            "trainer.nnodes=1",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        ),
        8.0,
    )


def test_one_process_training_roles_take_one_gpu_each():
    cfg = _cfg("dapo_qwen2.5_32b.yaml", "trainer.nnodes=1", "actor_rollout_ref.actor.strategy=deepspeed")
    assert gpu_demand(cfg) == {"rollout": 8, "actor": 1}
    with pytest.raises(PlacementError, match="at most 4"):
        check_gpu_count(cfg, 8.0)  # 8 - 1 = 7, rounded down to a multiple of TP 4
    with pytest.raises(PlacementError, match="add GPUs"):
        check_gpu_count(cfg, 4.0)  # 4 - 1 = 3 < one TP-4 replica
