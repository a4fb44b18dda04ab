"""The configuration schema: a tree of dataclasses, one per section, turned into an OmegaConf structured
config. Loading, overrides and validation live in `dapo_core.config.loading` (which re-exports these).

Key paths follow verl (`actor_rollout_ref.actor.clip_ratio_high`, `algorithm.filter_groups.enable`, ...), so
a verl DAPO script's overrides work here unchanged where the key exists. Every field carries a one-line
docstring (read by `dapo_core.config.loading.field_docs`; `configs/dapo.yaml` mirrors the defaults).
Defaults follow the reference (verl NEWEST `ppo_trainer.yaml` + the DAPO recipe's `dapo_trainer.yaml`), so
the base config is *not* DAPO; the DAPO configs (`configs/tiny_cpu.yaml`, `configs/dapo_*_qwen2.5_32b.yaml`)
switch it on. A field whose default differs from verl's on purpose says so in its docstring. A field with a
closed set of values is typed by its `Literal` in `dapo_core.config.choices`.

One module per part of the tree: `data`, `actor_rollout_ref` (model, actor, rollout, reference),
`algorithm` (critic, algorithm, reward model) and `trainer` (trainer, eval); `DapoConfig`, the root, is
here. `algorithm.rollout_correction` is validated by the algo layer into
`dapo_core.algo.rollout_correction.RolloutCorrection`. Keys that no code reads are listed, with their
reasons, in `dapo_core.config.unused`. More in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_core.config.schema.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    CheckpointConfig,
    DeepSpeedConfig,
    FSDPConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RolloutConfig,
    SftConfig,
    TinyModelConfig,
    ValKwargsConfig,
)
from dapo_core.config.schema.algorithm import (
    AlgorithmConfig,
    CriticConfig,
    CriticModelConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
)
from dapo_core.config.schema.data import (
    DataConfig,
    HistorySamplerConfig,
    SourceFilesConfig,
    SyntheticDataConfig,
)
from dapo_core.config.schema.trainer import EvalConfig, RayResourcesConfig, TrainerConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CriticModelConfig",
    "DapoConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "EvalConfig",
    "FSDPConfig",
    "FilterGroupsConfig",
    "HistorySamplerConfig",
    "KLCtrlConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RayResourcesConfig",
    "RefConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SftConfig",
    "SourceFilesConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "ValKwargsConfig",
]


@dataclass
class DapoConfig:
    """The whole configuration (verl key paths)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batch sizes."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Model, actor, rollout and reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage, KL, dynamic sampling, rollout correction."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward scoring."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Step loop and infrastructure."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Offline evaluation."""
