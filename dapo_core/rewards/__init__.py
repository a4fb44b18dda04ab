"""Rewards: rule-based scoring routed by ``data_source`` and DAPO's overlong reward shaping (``scoring``),
and the ``RewardManager`` that scores a batch in worker processes with per-sample timeouts (``manager``).
"""

from dapo_core.rewards import math_dapo
from dapo_core.rewards.manager import RewardManager, RewardResult
from dapo_core.rewards.scoring import MATH_DAPO_SOURCES, default_compute_score, overlong_penalty

__all__ = [
    "MATH_DAPO_SOURCES",
    "RewardManager",
    "RewardResult",
    "default_compute_score",
    "math_dapo",
    "overlong_penalty",
]
