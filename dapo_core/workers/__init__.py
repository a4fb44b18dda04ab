"""Workers: plain classes that hold models and do the heavy work, taking and returning Arrow tables.

They run in-process or inside Ray actors (`dapo_core.cluster`); nothing here knows about Prefect or Ray.
"""
from dapo_core.workers.actor import ActorWorker, RefWorker
from dapo_core.workers.critic import CriticWorker
from dapo_core.workers.reward import RewardWorker
from dapo_core.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "RefWorker", "RewardWorker", "RolloutWorker"]
