"""dapo_core: everything that computes, with no Prefect, task or flow import (checked by `make lint`).

Layers, each importing only those listed before it:

- `masked`, `seeding` — masked tensor reductions and stable per-request seeds.
- `algo/` — the algorithm on tensors: advantages, KL, losses, rollout correction, dynamic sampling.
- `rewards/` — rule-based scoring, overlong shaping, the reward process pool.
- `config/` — the structured config (schema, cross-field checks, loading with overrides).
- `data/` — the batch contract (Arrow rows ⇄ tensors), pandera schemas, datasets and prompt sampling.
- `store/` — atomic files, the run store (ledger + stage files), checkpoints, the replay buffer.
- `metrics/` — step metrics, validation metrics, tracking backends.
- `stages` — table-level stage logic the driver runs (group filter on tables, advantage stage).
- `compute/` — models, rollout and training engines, workers, and the cluster that hosts them.
"""
