"""Compute engines: rollout (generation) and training.

- `dapo_core.compute.engines.rollout`: `SamplingParams`, `Completion`, `RolloutEngine`, `make_rollout_engine`
  ("hf" → `hf_rollout.HFRolloutEngine`, "vllm" → `vllm_rollout`, imported only when asked for).
- `dapo_core.compute.engines.train`: `TrainEngine`, `make_train_engine` ("torch" → `torch_train`, "deepspeed"
  → `deepspeed_train`, imported only when asked for), shared log-prob / entropy / LR code; `ppo`:
  `ppo_update`, the PPO loop.

The package itself imports none of them: a process imports only the engines it uses.
"""
