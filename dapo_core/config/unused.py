"""Config keys that no code reads, in one place, each with its reason.

Every key of the schema is either read by the code (dapo_core/, tasks/, flows/) or listed here:

- `NOT_IMPLEMENTED`: verl keys whose feature does not exist here yet. Such a key is accepted only at its
  default, which is what the code does; any other value is a load-time `ConfigError` naming the key
  (`not_implemented_problems`). (The memory features — gradient checkpointing, token-budget micro-batches,
  packed forwards — are honoured: dapo_core/compute/microbatch.py.)
- `NO_OPS`: keys accepted with any valid value and deliberately ignored, kept so that verl configs load.

`tests/unit/test_config_keys.py` walks every leaf of the schema and fails when one is neither read nor listed
here (and when an entry here is not a schema key); `configs/dapo.yaml` marks each listed key.
"""

from __future__ import annotations

import functools
from typing import Any

from dapo_core.config.schema import DapoConfig

__all__ = ["NOT_IMPLEMENTED", "NO_OPS", "default_value", "not_implemented_problems"]

NOT_IMPLEMENTED: dict[str, str] = {
    "data.prompt_key": "prompts are read from the `prompt` column",
    "data.reward_fn_key": "rows are routed to their scoring function by the `data_source` column",
    "actor_rollout_ref.actor.checkpoint.save_contents": (
        "a checkpoint always holds model, optimizer, extra and hf_model"
    ),
    "actor_rollout_ref.actor.checkpoint.load_contents": "resume always restores model, optimizer and extra",
    "reward_model.reward_manager": (
        "the one reward manager is verl's dapo manager; with overlong_buffer.enable=false it scores as "
        "verl's naive one"
    ),
    "trainer.max_critic_ckpt_to_keep": (
        "actor and critic share each checkpoint folder: trainer.max_actor_ckpt_to_keep prunes both"
    ),
}
"""Keys accepted only at their schema default (key -> what the code does instead / why)."""

NO_OPS: dict[str, str] = {
    "data.val_batch_size": "deprecated in verl too: the whole validation set goes to the engine as one batch",
    "actor_rollout_ref.rollout.calculate_log_probs": (
        "the engines always return the sampled tokens' log-probs; as in verl, rollout correction still "
        "requires true"
    ),
    "reward_model.overlong_buffer.log": (
        "`overlong_reward` and `overlong` are always written (verl writes them only when true)"
    ),
    "trainer.project_name": (
        "names the project in verl's trackers (wandb, ...); our sinks write under runs/<run_id>/"
    ),
}
"""Keys accepted with any valid value and ignored on purpose (key -> reason)."""


@functools.cache
def _defaults() -> DapoConfig:
    """The schema defaults (one instance, never mutated)."""
    return DapoConfig()


def default_value(key: str) -> Any:
    """The schema default of a dotted key (lists as lists)."""
    node: Any = _defaults()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def not_implemented_problems(c: DapoConfig) -> list[str]:
    """A 'key: problem — fix' line for every `NOT_IMPLEMENTED` key of the loaded config `c` that is not at
    its default."""
    problems = []
    for key, reason in NOT_IMPLEMENTED.items():
        value: Any = c
        for part in key.split("."):
            value = getattr(value, part)
        default = default_value(key)
        if value != default:
            problems.append(
                f"{key}: {value!r} is not implemented yet ({reason}) — remove the key or set it to its "
                f"default {default!r}."
            )
    return problems
