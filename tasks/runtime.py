"""The per-run objects tasks need (store, workers, sampler, config): the flow builds one `Runtime` per run and
hands it to every task as its first argument.

Prefect walks this task input for upstream task results (there are none) and sends none of its values to the
server; batches and models stay in the run store and the workers, so only URIs, small metrics and this
in-process handle cross a task boundary. Every
field is typed: the workers are `dapo_core.compute.rpc.proxy` objects typed as their worker class, so
`rt.actor.update_actor_from(root, uri, step)` is checked against `ActorWorker.update_actor_from`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import pyarrow as pa

from dapo_core.algo.kl import AdaptiveKLController, FixedKLController
from dapo_core.compute.cluster import Cluster
from dapo_core.compute.replicas import PendingStage, RolloutReplicas
from dapo_core.compute.workers import ActorWorker, CriticWorker, RewardWorker
from dapo_core.config import DapoConfig
from dapo_core.data.datasets import PromptSampler
from dapo_core.store import RunStore
from dapo_core.store.jobs import StageJob
from dapo_core.store.replay import ReplayBuffer

W = TypeVar("W")


class ChunkSampler:
    """Draws any number of prompts from a one-prompt-per-batch PromptSampler (refills of any size)."""

    def __init__(self, sampler: PromptSampler) -> None:
        self.sampler = sampler

    def next_batch(self, size: int) -> pa.Table:
        """The next `size` prompts (crossing epoch boundaries as needed), drawn one by one and built as one
        table (the rows not tokenised yet in one tokenizer call): the same table as concatenating `size`
        `next_batch()` calls of the sampler."""
        if size < 1:
            raise ValueError(f"ChunkSampler.next_batch: size must be >= 1, got {size}")
        rows = np.concatenate([self.sampler.next_rows() for _ in range(size)])
        return self.sampler.batch_of(rows)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from."""
        return self.sampler.epoch

    def state_dict(self) -> dict:
        """The sampler position (stored with each prompt stage and in each checkpoint)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict`."""
        self.sampler.load_state_dict(state)


class ReferencePolicy(Protocol):
    """What serves the ref stage: a `RefWorker` (a model of its own), or with LoRA the `ActorWorker` (its
    adapters off)."""

    def ref_log_prob_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """Commit the `ref_log_probs` of the view at `job.input_uri`; returns (URI, metrics)."""
        ...


@dataclass
class Launch:
    """A generation submitted to the rollout worker and not collected yet (replay-buffer order)."""

    future: PendingStage
    """The URI and metrics of the generation stage the rollout replicas commit, once they have finished."""
    uids: list[str]
    """The prompt groups it generates."""


@dataclass(kw_only=True)
class Runtime:
    """Everything a stage task of run `run_id` may use."""

    run_id: str
    cfg: DapoConfig
    """The resolved run configuration."""
    store: RunStore
    """The run store `runs/<run_id>/` (stage files, ledger, checkpoints)."""
    cluster: Cluster
    """Owns the worker processes (shut down at the end of the run)."""
    pad_token_id: int
    """The tokenizer's padding id (tables ⇄ padded tensors)."""
    vocab_size: int
    """The tokenizer's vocabulary size (stage validation checks token ids against it)."""
    rollout: RolloutReplicas
    """Generates responses on its replicas (HF or vLLM engines); receives the actor's weights after each
    update."""
    actor: ActorWorker
    """The trained policy: old log-probs and the DAPO update."""
    reward: RewardWorker
    """Scores responses (math_dapo + overlong shaping)."""
    ref: ReferencePolicy | None = None
    """The frozen reference policy: only when a KL term needs it (`need_reference_policy`); with LoRA the
    actor itself, its adapters off (`need_ref_worker`)."""
    critic: CriticWorker | None = None
    """The value model: only for GAE-style estimators (`use_critic`)."""
    sampler: ChunkSampler
    """Training prompts (its position is checkpointed)."""
    val_prompts: pa.Table
    """The tokenised validation prompts, in file order."""
    kl_ctrl: FixedKLController | AdaptiveKLController
    """The in-reward KL coefficient (its value is checkpointed)."""
    replay_buffer: ReplayBuffer | None = None
    """Replay-buffer order: the buffer over the run store (created on first use by `tasks.replay.buffer`)."""
    launches: dict[tuple[int, str], Launch] = field(default_factory=dict)
    """Replay-buffer order: generations submitted and not collected yet, by (step, tag)."""

    @property
    def n(self) -> int:
        """Samples per prompt (actor_rollout_ref.rollout.n)."""
        return self.cfg.actor_rollout_ref.rollout.n


def need(worker: W | None, role: str) -> W:
    """`worker`, or a RuntimeError when this run did not build it (a stage called without its config)."""
    if worker is None:
        raise RuntimeError(
            f"this run has no '{role}' worker: the reference policy is built only for a KL term "
            f"(algorithm.use_kl_in_reward / actor.use_kl_loss), the critic only for critic.enable or "
            f"algorithm.adv_estimator=gae"
        )
    return worker
