"""The sections that turn rewards into a learning signal: `critic` (the value model of GAE), `algorithm`
(advantage estimator, KL in reward, dynamic sampling, rollout correction) and `reward_model` (rule-based
scoring and overlong shaping; its `overlong_buffer` is the reward manager's own `OverlongBufferConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_core.config.choices import BypassLossType, KlCtrlType, LossAggMode, Refill, RolloutIsLevel
from dapo_core.config.schema.actor_rollout_ref import OptimConfig
from dapo_core.rewards.manager import OverlongBufferConfig


@dataclass
class CriticModelConfig:
    """Memory switches of the value model (the backbone of `actor_rollout_ref.model` plus a value head)."""

    enable_gradient_checkpointing: bool | None = None
    """Recompute activations in backward (same gradients); null = the policy model's switch (verl: true)."""
    use_remove_padding: bool = False
    """Packed, padding-free value forwards and updates (same values as padded within float error)."""


@dataclass
class CriticConfig:
    """The value model (used by GAE only)."""

    enable: bool | None = None
    """Build a critic; null = only when `algorithm.adv_estimator` is gae."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Gradient checkpointing and packed forwards of the value model."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer: AdamW, the actor's warm-up then constant or cosine schedule (a step per update)."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic step; null = actor's."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Trajectories per critic forward/backward; null = whole mini-batch."""
    use_dynamic_bsz: bool | None = None
    """Form critic micro-batches by a token budget (loss normalisation unchanged); null = the actor's."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of a critic update micro-batch when `use_dynamic_bsz` (verl: 32768, twice the actor's)."""
    forward_max_token_len_per_gpu: int | None = None
    """Token budget of a value forward when `use_dynamic_bsz`; null = `ppo_max_token_len_per_gpu`."""
    ppo_epochs: int | None = None
    """Passes per batch; null = actor's."""
    cliprange_value: float = 0.5
    """Value clip range."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Value-loss aggregation (same five modes as the actor)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""


@dataclass
class KLCtrlConfig:
    """Controller of the in-reward KL coefficient."""

    type: KlCtrlType = "fixed"
    """fixed | adaptive."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient beta."""
    horizon: int = 10000
    """Adaptive controller horizon (> 0)."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose metric has zero spread."""

    enable: bool = False
    """Turn dynamic sampling on."""
    metric: str | None = "acc"
    """Value that must vary within a group: acc | score | seq_reward | seq_final_reward (verl: null)."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before giving up (0 = unlimited)."""
    refill: Refill = "fixed"
    """Refill sizing: fixed = gen_batch_size (reference) | adaptive = sized to the deficit (ours)."""
    surplus_budget: float = 0.005
    """refill=adaptive: expected kept groups thrown away per batch, as a share of train_batch_size."""


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling / rejection sampling against the rollout policy (verl YAML defaults)."""

    preset: str | None = None
    """Named preset (rollout_correction.PRESETS) setting this section's keys at load; null = as given."""
    rollout_is: RolloutIsLevel | None = None
    """IS level: null | token | sequence."""
    rollout_is_threshold: Any = 2.0
    """IS cap: a number (TIS upper) or a quoted "lower_upper" string (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Rescale IS weights to mean 1."""
    rollout_rs: str | None = None
    """Comma-separated rejection options (token_k1, seq_mean_k3, ...)."""
    rollout_rs_threshold: Any = None
    """Threshold per RS option (one shared or one per option, comma-separated)."""
    bypass_mode: bool = False
    """Use rollout log-probs as old log-probs (2 policies) instead of recomputing."""
    loss_type: BypassLossType = "ppo_clip"
    """Bypass-mode loss: ppo_clip | reinforce."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation, KL in reward, dynamic sampling and rollout correction."""

    adv_estimator: str = "grpo"
    """Advantage estimator (verl default gae; ours grpo)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std (false = Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """In-reward KL coefficient controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Training/inference mismatch correction."""


@dataclass
class RewardModelConfig:
    """Rule-based reward: the manager, its worker pool and overlong shaping."""

    reward_manager: str = "dapo"
    """Reward manager name. Not implemented yet (default only)."""
    num_workers: int = 1
    """Worker processes scoring responses in parallel (each sample under its own timeout; >= 1)."""
    timeout_s: float = 10.0
    """Seconds before one scoring call is abandoned (scored as a failure); > 0."""
    max_failure_rate: float = 0.5
    """Largest failed share (timeout, error, NaN) of a batch's rewards before the step stops; 1.0 = never."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping."""
