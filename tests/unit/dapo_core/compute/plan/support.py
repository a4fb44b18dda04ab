"""Shared by the plan tests: the configs and the overrides that put the 32B config on the one-process
DeepSpeed engine, a small model, LoRA keys, and the recipe's fsdp2 layout."""

from __future__ import annotations

from pathlib import Path

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[5]
CONFIGS = ROOT / "configs"


BIG_32B = ["dapo_qwen2.5_32b.yaml", "dapo_wo_ds_qwen2.5_32b.yaml", "dapo_early_qwen2.5_32b.yaml"]
DS = [  # the one-process DeepSpeed engine (ZeRO-3, both offloads, bf16) on the 32B config's data and lengths
    "trainer.nnodes=1",
    "actor_rollout_ref.actor.strategy=deepspeed",
    "actor_rollout_ref.actor.deepspeed.zero_stage=3",
    "actor_rollout_ref.actor.deepspeed.offload_optimizer=true",
    "actor_rollout_ref.actor.deepspeed.offload_param=true",
    "actor_rollout_ref.actor.deepspeed.bf16=true",
]
MIXED = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def fsdp2(cfg, nnodes=16):
    """The recipe's layout on a typed config: the fsdp2 actor over nnodes × 8 GPUs."""
    cfg.actor_rollout_ref.actor.strategy = "fsdp2"
    cfg.trainer.nnodes = nnodes
    return cfg


VERL_LORA = [  # verl's LoRA keys as a verl script sets them
    "actor_rollout_ref.model.lora_rank=64",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules=all-linear",
]
SMALL = [*DS, "actor_rollout_ref.model.path=Qwen2.5-0.5B"]
