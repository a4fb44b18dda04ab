"""Workers: plain classes that hold models and do the heavy work, taking and returning Arrow tables.

They run in-process or inside Ray actors (`dapo_core.compute.cluster`); nothing here knows about Prefect or
Ray.
"""

from dapo_core.compute.workers.actor import ActorWorker, RefWorker
from dapo_core.compute.workers.critic import CriticWorker
from dapo_core.compute.workers.reward import RewardWorker
from dapo_core.compute.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "RefWorker", "RewardWorker", "RolloutWorker"]
