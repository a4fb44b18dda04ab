"""Update-side stage tasks: update_critic, update_actor, sync_weights, checkpoint.

The updates hand the worker the batch's URI (the worker reads it from the run store) and commit a one-row
marker with the update's metrics; the checkpoint task then applies step-data retention
(`dapo_core.store.retention`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.algo.losses import PiOld
from dapo_core.config import runs_ahead
from dapo_core.store.replay import referenced_steps
from dapo_core.store.retention import apply_retention
from tasks import runtime
from tasks.stage_commit import StageResult, retry_unless_user_error, run_name, run_stage, stage_name

# No retries for the updates: a failure may come after an optimizer step, and a retry would apply it twice.
_OPTS: dict[str, Any] = {"cache_policy": NO_CACHE}


def _marker(step: int, part: int | None) -> pa.Table:
    return pa.table({"step": pa.array([step], type=pa.int64()), "part": pa.array([part], type=pa.int64())})


@task(name="update_critic", task_run_name=run_name("update_critic"), **_OPTS)
def update_critic(rt: runtime.Runtime, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Clipped value-loss updates of the critic."""
    return run_stage(
        rt,
        step,
        stage_name("update_critic", part),
        lambda: (
            _marker(step, part),
            runtime.need(rt.critic, "critic").update_critic_from(str(rt.store.root), in_uri, step),
        ),
    )


@task(name="update_actor", task_run_name=run_name("update_actor"), **_OPTS)
def update_actor(
    rt: runtime.Runtime, step: int, in_uri: str, part: int | None = None, pi_old: PiOld = "old_log_probs"
) -> StageResult:
    """The DAPO policy update (PPO mini-batches/epochs with the configured loss) with π_old from `pi_old`
    (`flows.learn.pi_old_source`); not retried automatically, since a half-applied update cannot be undone —
    the flow resumes from the last checkpoint instead. The new weights reach the rollout worker in the
    `sync_weights` stage that follows."""
    return run_stage(
        rt,
        step,
        stage_name("update_actor", part),
        lambda: (
            _marker(step, part),
            rt.actor.update_actor_from(str(rt.store.root), in_uri, step, pi_old),
        ),
    )


@task(
    name="sync_weights",
    task_run_name="sync_weights-step{step}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_condition_fn=retry_unless_user_error,
)
def sync_weights(rt: runtime.Runtime, step: int, weight_version: int) -> dict[str, float]:
    """Push the actor's weights to the rollout worker as `weight_version`; returns the push's metrics
    (`timing_s/sync_weights` and the transport's `weight_sync/*`). Every order calls it once per step after
    the step's updates. It commits nothing: a resumed step pushes again, and the push is idempotent (the
    same weights under the same version), so retrying it is safe."""
    t0 = time.perf_counter()
    push_weights(rt, weight_version)
    return {**rt.rollout.last_push, "timing_s/sync_weights": time.perf_counter() - t0}


def push_weights(rt: runtime.Runtime, weight_version: int) -> None:
    """Stream the actor's weights into every rollout replica and stamp them `weight_version` (with Ray the
    tensors go from the actor's ranks to the replicas in buckets, never through the driver or the object
    store; `RolloutReplicas.push_from`); each replica confirms the version, else no replica generates."""
    ro = rt.cfg.actor_rollout_ref.rollout
    rt.rollout.push_from(
        rt.actor,
        weight_version,
        transport=ro.weight_transport,
        bucket_bytes=int(ro.update_weights_bucket_megabytes) << 20,
        actor_where=sorted(
            (w for w in rt.cluster.workers if w.get("role") == "actor"), key=lambda w: int(w.get("rank", 0))
        ),
    )


@task(
    name="checkpoint",
    task_run_name="checkpoint-step{step}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_condition_fn=retry_unless_user_error,
)
def checkpoint(rt: runtime.Runtime, step: int, driver_state: dict) -> str:
    """Write ckpt/step_<step>/ (actor [+critic] states, driver state) atomically; `latest` is written last."""
    ckpts = rt.store.checkpoints

    def write(tmp_dir: Path) -> None:
        rt.actor.save_checkpoint(os.path.join(tmp_dir, "actor"))
        if rt.critic is not None:
            rt.critic.save_checkpoint(os.path.join(tmp_dir, "critic"))
        with open(os.path.join(tmp_dir, "driver_state.json"), "w") as f:
            json.dump(driver_state, f, indent=1, sort_keys=True)

    # overwrite: a retry after a save that completed, or a run resumed (resume_path) from before its latest
    # checkpoint, writes this step again; the state being saved is the driver's current one either way
    path = ckpts.save(step, write, {"step": step, "run_id": rt.run_id}, overwrite=True)
    tr = rt.cfg.trainer
    if tr.max_actor_ckpt_to_keep:
        ckpts.keep_last(tr.max_actor_ckpt_to_keep)
    deleted = apply_retention(rt.store, step, tr.keep_rollouts_every, replay_pins(rt))
    if deleted:
        print(
            f"retention: deleted the step data of steps {_span(deleted)} (covered by checkpoint {step}; "
            f"trainer.keep_rollouts_every={tr.keep_rollouts_every})"
        )
    return str(path)


def replay_pins(rt: runtime.Runtime) -> set[int]:
    """Steps whose files the replay buffer still needs (its groups' `replay_add` files); none in the sync
    order."""
    if not runs_ahead(rt.cfg):
        return set()
    return referenced_steps(rt.store)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 2 else ", ".join(map(str, steps))
