"""On GPU, fsdp2 runs share every GPU among the roles (the colocated pool) and the other engines give every
role devices of its own; a cluster too small for the layout is refused up front, and the refusal's fix,
applied through the config loader, passes the same check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapo_core.compute.placement import PlacementError
from dapo_core.compute.pools import pool_layout, same_nodes
from dapo_core.config import load_config, need_ref_worker, need_reference_policy, typed
from dapo_core.errors import DapoUserError
from flows.roles import check_gpu_count, colocated, gpu_demand

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _cfg(name: str, *overrides: str):
    return typed(load_config(CONFIGS / name, list(overrides)))


def test_the_recipe_layout_is_colocated_and_fits_its_own_node_count():
    cfg = _cfg("dapo_qwen2.5_32b.yaml")  # 16 nodes × 8 GPUs, fsdp2, vLLM TP 4
    assert colocated(cfg, "cuda") and not colocated(cfg, "cpu")
    assert gpu_demand(cfg) == {"pool": 128}
    check_gpu_count(cfg, 128.0)
    with pytest.raises(PlacementError) as e:
        check_gpu_count(cfg, 64.0)
    text = str(e.value)
    assert "128 GPUs" in text and "has 64" in text and "trainer.nnodes / trainer.n_gpus_per_node" in text
    world = int(re.search(r"at most (\d+)", text).group(1))
    assert world == 64
    check_gpu_count(_cfg("dapo_qwen2.5_32b.yaml", "trainer.n_gpus_per_node=4"), 64.0)  # the fix fits


def test_the_replay_buffer_order_is_refused_on_a_colocated_pool_and_its_fix_passes():
    cfg = _cfg("dapo_qwen2.5_32b.yaml", "trainer.step_order=replay_buffer")
    with pytest.raises(PlacementError, match=r"trainer\.step_order=sync with fsdp2"):
        check_gpu_count(cfg, 128.0)
    fixed = _cfg(
        "dapo_qwen2.5_32b.yaml",
        "trainer.step_order=replay_buffer",
        "trainer.nnodes=1",
        "actor_rollout_ref.actor.strategy=torch",
    )
    check_gpu_count(fixed, 9.0)


def test_one_process_training_roles_take_one_gpu_each():
    cfg = _cfg("dapo_qwen2.5_32b.yaml", "trainer.nnodes=1", "actor_rollout_ref.actor.strategy=deepspeed")
    assert gpu_demand(cfg) == {"rollout": 8, "actor": 1}
    with pytest.raises(PlacementError, match="at most 4"):
        check_gpu_count(cfg, 8.0)  # 8 - 1 = 7, rounded down to a multiple of TP 4
    with pytest.raises(PlacementError, match="add GPUs"):
        check_gpu_count(cfg, 4.0)  # 4 - 1 = 3 < one TP-4 replica
    kl = _cfg(
        "dapo_qwen2.5_32b.yaml",
        "trainer.nnodes=1",
        "actor_rollout_ref.actor.strategy=torch",
        "actor_rollout_ref.actor.use_kl_loss=true",
    )
    assert gpu_demand(kl) == {"rollout": 8, "actor": 1, "ref": 1}
    check_gpu_count(kl, 10.0)


def test_a_lora_actor_is_its_own_reference_so_no_ref_gpu_is_asked_for():
    kl = (
        "trainer.nnodes=1",
        "actor_rollout_ref.actor.strategy=torch",
        "actor_rollout_ref.actor.use_kl_loss=true",
    )
    lora = _cfg("dapo_qwen2.5_32b.yaml", *kl, "actor_rollout_ref.model.lora_rank=64")
    assert need_reference_policy(lora) and not need_ref_worker(lora)
    assert gpu_demand(lora) == {"rollout": 8, "actor": 1}


def test_the_pool_shares_each_gpu_among_the_roles_and_keeps_a_replica_on_one_node():
    lay = pool_layout(2, 8, training_roles=2, tp=4)  # actor + ref, and the rollout shard
    assert (lay.world, lay.shares, lay.replicas) == (16, 3, 4)
    assert abs(lay.fraction * lay.shares - 1.0) < 1e-12
    assert lay.replica_bundles(3) == [12, 13, 14, 15]
    with pytest.raises(DapoUserError, match=r"does not divide trainer\.n_gpus_per_node=6"):
        pool_layout(2, 6, training_roles=1, tp=4)


def test_colocated_roles_must_ask_for_the_same_nodes():
    assert same_nodes({"actor": {"gpu_node": 1}, "ref": None, "rollout": {"gpu_node": 1}}) == {
        "gpu_node": 1.0
    }
    assert same_nodes({"actor": None, "rollout": None}) == {}
    with pytest.raises(DapoUserError, match=r"trainer\.ray_resources asks for different nodes per role"):
        same_nodes({"actor": {"train_node": 1}, "rollout": {"gen_node": 1}})
