"""Workers: plain classes that hold models and do the heavy work, taking and returning Arrow tables.

They run in-process or inside Ray actors (`dapo_core.compute.cluster`); nothing here knows about Prefect or
Ray. Each class is imported from its module on first use (`__getattr__`), so a Ray worker process imports
only its own role's code: the reward worker, which holds no model, starts without torch's training stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapo_core.compute.workers.actor import ActorWorker, RefWorker
    from dapo_core.compute.workers.critic import CriticWorker
    from dapo_core.compute.workers.reward import RewardWorker
    from dapo_core.compute.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "RefWorker", "RewardWorker", "RolloutWorker"]

_MODULE = {
    "ActorWorker": "actor",
    "RefWorker": "actor",
    "CriticWorker": "critic",
    "RewardWorker": "reward",
    "RolloutWorker": "rollout",
}
"""The module of this package that defines each worker class."""


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)
