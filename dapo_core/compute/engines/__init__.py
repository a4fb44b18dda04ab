"""Compute engines: rollout (generation) and training.

- `dapo_core.compute.engines.rollout`: `SamplingParams`, `Completion`, `RolloutEngine`, `make_rollout_engine`
  ("hf" → `hf_rollout.HFRolloutEngine`, "vllm" → `vllm_rollout`, imported only when asked for).
- `dapo_core.compute.engines.train`: `TrainEngine`, `make_train_engine` ("torch" → `torch_train`, "deepspeed"
  → `deepspeed_train`, imported only when asked for), `ppo_update`, shared log-prob / entropy / LR code.
"""

from dapo_core.compute.engines.ppo import ppo_update
from dapo_core.compute.engines.rollout import Completion, RolloutEngine, SamplingParams, make_rollout_engine
from dapo_core.compute.engines.train import TrainEngine, make_train_engine

__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "TrainEngine",
    "make_rollout_engine",
    "make_train_engine",
    "ppo_update",
]
