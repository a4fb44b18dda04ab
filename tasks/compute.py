"""Compute-side stage tasks: old_log_prob, ref, values, advantage."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task

from dapo_core.algo.losses import agg_loss
from dapo_core.data import batch as B
from dapo_core.stages import compute_advantage_table
from tasks import runtime
from tasks.common import (
    STAGE_TASK_OPTS,
    StageResult,
    run_name,
    run_stage,
    stage_name,
)

_OPTS = STAGE_TASK_OPTS


@task(name="old_log_prob", task_run_name=run_name("old_log_prob"), **_OPTS)
def old_log_prob(run_id: str, step: int, batch_uri: str, part: int | None = None) -> StageResult:
    """π_old log-probs recomputed by the actor (decoupled mode), or the rollout's own (bypass mode)."""
    rt = runtime.get(run_id)
    cfg = rt.cfg

    def compute():
        table = rt.store.read_uri(batch_uri)
        if cfg.algorithm.rollout_correction.bypass_mode:
            return table.append_column("old_log_probs", table.column("rollout_log_probs")), {}
        out = rt.actor.compute_log_prob(table, True)
        t = B.to_padded(out, rt.pad_token_id, columns=["entropy"])
        ent = agg_loss(t["entropy"], t["response_mask"].float(), cfg.actor_rollout_ref.actor.loss_agg_mode)
        return out, {"actor/entropy": float(ent)}

    return run_stage(rt, step, stage_name("old_log_prob", part), compute, schema="old_log_prob", n=rt.n)


@task(name="ref", task_run_name=run_name("ref"), **_OPTS)
def ref(run_id: str, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Reference-policy log-probs (only when a KL term is used)."""
    rt = runtime.get(run_id)
    return run_stage(
        rt,
        step,
        stage_name("ref", part),
        lambda: (runtime.need(rt.ref, "ref").compute_ref_log_prob(rt.store.read_uri(in_uri)), {}),
        schema="ref",
        n=rt.n,
    )


@task(name="values", task_run_name=run_name("values"), **_OPTS)
def values(run_id: str, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Critic values per response token (only for GAE-style estimators)."""
    rt = runtime.get(run_id)
    return run_stage(
        rt,
        step,
        stage_name("values", part),
        lambda: (runtime.need(rt.critic, "critic").compute_values(rt.store.read_uri(in_uri)), {}),
        schema="values",
        n=rt.n,
    )


@task(name="advantage", task_run_name=run_name("advantage"), **_OPTS)
def advantage(run_id: str, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Token rewards (KL in reward), rollout correction, and advantages by the configured estimator."""
    rt = runtime.get(run_id)
    alg = rt.cfg.algorithm

    def compute():
        table = rt.store.read_uri(in_uri)
        rc = alg.rollout_correction
        enabled = rc.rollout_is is not None or rc.rollout_rs is not None
        return compute_advantage_table(
            table,
            pad_token_id=rt.pad_token_id,
            adv_estimator=alg.adv_estimator,
            gamma=alg.gamma,
            lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            use_kl_in_reward=alg.use_kl_in_reward,
            kl_ctrl=rt.kl_ctrl,
            kl_penalty_kind=alg.kl_penalty,
            rollout_correction=asdict(rc) if enabled else None,
        )

    value_before = rt.kl_ctrl.value
    try:
        return run_stage(rt, step, stage_name("advantage", part), compute, schema="advantage", n=rt.n)
    except BaseException:
        rt.kl_ctrl.value = value_before  # a retried attempt must not update the adaptive KL coefficient twice
        raise
