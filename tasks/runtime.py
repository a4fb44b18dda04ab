"""The per-run objects tasks need (store, workers, tokenizer facts, config), registered by the flow under the run id.

Tasks receive the run id (a small, hashable value) and look the rest up here, so no batch or actor handle ever
becomes a Prefect task input.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from dapo_core.compute.cluster import Cluster
from dapo_core.store import RunStore

_RUNTIMES: dict[str, Runtime] = {}
_LOCK = threading.Lock()


@dataclass
class Runtime:
    """Everything a stage task of run `run_id` may use."""

    run_id: str
    cfg: Any  # DictConfig
    store: RunStore
    cluster: Cluster
    pad_token_id: int
    vocab_size: int
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Samples per prompt (actor_rollout_ref.rollout.n)."""
        return int(self.cfg.actor_rollout_ref.rollout.n)

    def worker(self, role: str):
        """The handle of a worker role (rollout, actor, ref, critic, reward)."""
        return self.cluster.get(role)


def register(rt: Runtime) -> None:
    """Make `rt` visible to the tasks of its run."""
    with _LOCK:
        _RUNTIMES[rt.run_id] = rt


def unregister(run_id: str) -> None:
    """Forget a run (at the end of the flow)."""
    with _LOCK:
        _RUNTIMES.pop(run_id, None)


def get(run_id: str) -> Runtime:
    """The runtime of `run_id` (RuntimeError if the flow did not register it in this process)."""
    with _LOCK:
        if run_id not in _RUNTIMES:
            raise RuntimeError(
                f"run {run_id!r} has no runtime in this process; tasks must run inside dapo-train"
            )
        return _RUNTIMES[run_id]
