"""Rollout off-policy correction: IS weights, rejection sampling and the presets (`config`), the
correction itself (`core`) and its diagnostics (`metrics`).
"""

from dapo_core.algo.rollout_correction.core import (
    SAFETY_BOUND,
    SUPPORTED_LOSS_TYPES,
    SUPPORTED_ROLLOUT_IS_LEVELS,
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    RolloutCorrection,
    apply_rollout_correction,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    parse_is_threshold,
    parse_rs_options,
)

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_LOSS_TYPES",
    "SUPPORTED_ROLLOUT_IS_LEVELS",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "RolloutCorrection",
    "apply_rollout_correction",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "parse_is_threshold",
    "parse_rs_options",
]
