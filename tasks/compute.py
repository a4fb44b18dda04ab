"""Compute-side stage tasks: old_log_prob, ref, values, advantage.

Each hands its worker a `StageJob` (`tasks.stage_commit.worker_stage`): the worker reads the input view from
the run store, computes, validates and commits the output itself; the driver sees the URI and the metrics. The
advantage stage has no model: its table function runs on the reward worker (`RewardWorker.transform_stage`).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any

import pyarrow as pa
from prefect import task

from dapo_core.stages import compute_advantage_table
from tasks import runtime
from tasks.stage_commit import STAGE_TASK_OPTS, StageResult, run_name, stage_name, worker_stage

_OPTS = STAGE_TASK_OPTS
_KL_COEF = "_kl_coef_after"
"""Metrics key that carries the in-reward KL coefficient back from the worker (not logged)."""


@task(name="old_log_prob", task_run_name=run_name("old_log_prob"), **_OPTS)
def old_log_prob(rt: runtime.Runtime, step: int, batch_uri: str, part: int | None = None) -> StageResult:
    """π_old log-probs (and entropy) recomputed by the actor with its current weights."""
    cfg = rt.cfg
    return worker_stage(
        rt,
        step,
        stage_name("old_log_prob", part),
        lambda job: rt.actor.log_prob_stage(job, entropy_agg_mode=cfg.actor_rollout_ref.actor.loss_agg_mode),
        input_uri=batch_uri,
        schema="old_log_prob",
        n=rt.n,
    )


@task(name="ref", task_run_name=run_name("ref"), **_OPTS)
def ref(rt: runtime.Runtime, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Reference-policy log-probs (only when a KL term is used)."""
    return worker_stage(
        rt,
        step,
        stage_name("ref", part),
        lambda job: runtime.need(rt.ref, "ref").ref_log_prob_stage(job),
        input_uri=in_uri,
        schema="ref",
        n=rt.n,
    )


@task(name="values", task_run_name=run_name("values"), **_OPTS)
def values(rt: runtime.Runtime, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Critic values per response token (only for GAE-style estimators)."""
    return worker_stage(
        rt,
        step,
        stage_name("values", part),
        lambda job: runtime.need(rt.critic, "critic").values_stage(job),
        input_uri=in_uri,
        schema="values",
        n=rt.n,
    )


def _advantage(table: pa.Table, kl_ctrl: Any, **kwargs: Any) -> tuple[pa.Table, dict[str, float]]:
    """`compute_advantage_table` with the controller's coefficient after the stage in the metrics (the worker
    updates its copy of the controller; the driver takes the value back)."""
    out, metrics = compute_advantage_table(table, kl_ctrl=kl_ctrl, **kwargs)
    return out, {**metrics, _KL_COEF: float(kl_ctrl.value)}


@task(name="advantage", task_run_name=run_name("advantage"), **_OPTS)
def advantage(rt: runtime.Runtime, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Token rewards (KL in reward), overlong filtering, rollout correction, and advantages by the configured
    estimator."""
    alg = rt.cfg.algorithm
    rc = alg.rollout_correction
    enabled = rc.rollout_is is not None or rc.rollout_rs is not None
    fn = partial(
        _advantage,
        kl_ctrl=rt.kl_ctrl,
        pad_token_id=rt.pad_token_id,
        adv_estimator=alg.adv_estimator,
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        use_kl_in_reward=alg.use_kl_in_reward,
        kl_penalty_kind=alg.kl_penalty,
        rollout_correction=asdict(rc) if enabled else None,
        mask_truncated_responses=rt.cfg.actor_rollout_ref.actor.mask_truncated_responses,
    )
    stage = stage_name("advantage", part)
    replayed = rt.store.is_committed(step, stage)  # a committed stage is replayed: the coefficient stays
    value_before = rt.kl_ctrl.value
    try:
        uri, metrics = worker_stage(
            rt,
            step,
            stage,
            lambda job: rt.reward.transform_stage(job, fn),
            input_uri=in_uri,
            schema="advantage",
            n=rt.n,
        )
    except BaseException:
        rt.kl_ctrl.value = value_before  # a retried attempt must not update the adaptive KL coefficient twice
        raise
    metrics = dict(metrics)
    coef = metrics.pop(_KL_COEF, None)
    if coef is not None and not replayed:
        rt.kl_ctrl.value = float(coef)
    return uri, metrics
