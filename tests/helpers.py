"""Small shared test data: the tiny model shapes the tests build (fast on one CPU thread)."""

from __future__ import annotations

from typing import Any

SMALL_MODEL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # vLLM's CPU attention needs head_dim >= 32
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""`actor_rollout_ref.model.tiny` keys of a two-layer model with 64 hidden units."""


def tiny_model_cfg(**overrides: Any) -> dict[str, Any]:
    """`SMALL_MODEL` with some keys replaced (e.g. `hidden_size=32` for the fastest tests)."""
    unknown = set(overrides) - set(SMALL_MODEL)
    if unknown:
        raise KeyError(f"not a tiny-model key: {sorted(unknown)}")
    return {**SMALL_MODEL, **overrides}
