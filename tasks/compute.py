"""Compute-side stage tasks: old_log_prob, ref, values, advantage."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.algo.losses import agg_loss
from dapo_core.data import batch as B
from dapo_core.stages import compute_advantage_table
from tasks import runtime
from tasks.common import StageResult, run_name, run_stage, stage_name

_OPTS = {"retries": 2, "retry_delay_seconds": 1, "cache_policy": NO_CACHE}


@task(name="old_log_prob", task_run_name=run_name("old_log_prob"), **_OPTS)
def old_log_prob(run_id: str, step: int, batch_uri: str, part: int | None = None) -> StageResult:
    """π_old log-probs recomputed by the actor (decoupled mode), or the rollout's own (bypass mode)."""
    rt = runtime.get(run_id)
    cfg = rt.cfg

    def compute():
        table = rt.store.read_uri(batch_uri)
        if bool(cfg.algorithm.rollout_correction.bypass_mode):
            return table.append_column("old_log_probs", table.column("rollout_log_probs")), {}
        out = rt.worker("actor").call("compute_log_prob", table, True)
        t = B.to_padded(out, rt.pad_token_id, columns=["entropy"])
        ent = agg_loss(
            t["entropy"], t["response_mask"].float(), str(cfg.actor_rollout_ref.actor.loss_agg_mode)
        )
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
        lambda: (rt.worker("ref").call("compute_ref_log_prob", rt.store.read_uri(in_uri)), {}),
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
        lambda: (rt.worker("critic").call("compute_values", rt.store.read_uri(in_uri)), {}),
        schema="values",
        n=rt.n,
    )


@task(name="advantage", task_run_name=run_name("advantage"), **_OPTS)
def advantage(run_id: str, step: int, in_uri: str, part: int | None = None) -> StageResult:
    """Token rewards (KL in reward), rollout correction, and advantages by the configured estimator."""
    rt = runtime.get(run_id)
    alg = rt.cfg.algorithm

    def compute():
        from omegaconf import OmegaConf

        table = rt.store.read_uri(in_uri)
        rc = OmegaConf.to_container(alg.rollout_correction, resolve=True)
        enabled = rc.get("rollout_is") is not None or rc.get("rollout_rs") is not None
        out, metrics = compute_advantage_table(
            table,
            pad_token_id=rt.pad_token_id,
            adv_estimator=str(alg.adv_estimator),
            gamma=float(alg.gamma),
            lam=float(alg.lam),
            norm_adv_by_std_in_grpo=bool(alg.norm_adv_by_std_in_grpo),
            use_kl_in_reward=bool(alg.use_kl_in_reward),
            kl_ctrl=rt.extras.get("kl_ctrl"),
            kl_penalty_kind=str(alg.kl_penalty),
            rollout_correction=rc if enabled else None,
        )
        return out, metrics

    kl_ctrl = rt.extras.get("kl_ctrl")
    value_before = getattr(kl_ctrl, "value", None)
    try:
        return run_stage(rt, step, stage_name("advantage", part), compute, schema="advantage", n=rt.n)
    except BaseException:
        if value_before is not None:  # a retried attempt must not update the adaptive KL coefficient twice
            kl_ctrl.value = value_before
        raise
