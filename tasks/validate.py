"""Validation task: generate on the held-out prompts with the validation sampling settings, score, and compute
`val-core/…` / `val-aux/…` metrics (mean@k, best@k, maj@k, pass@k per data source).

Validation is a worker job like the training stages, in three committed stages of the step:

1. `val_prompts`: the distinct held-out prompts (the driver loaded and fingerprinted them when the run opened;
   it writes them once per validation, not repeated);
2. `val_generate`: the rollout replicas read them, repeat each `val_kwargs.n` times (uids seeded by the run's
   seed and the step), generate their shares (whole prompts) with the validation sampling settings, validate
   and commit (`dapo_core.compute.replicas`);
3. `val`: the reward worker reads that, scores it, validates it and computes the metrics
   (`dapo_core.metrics.validation.validation_summary`) next to the data, and commits.

Only the URIs and the metrics dict come back to the driver; no generated or scored table passes through it.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import runtime
from tasks.stage_commit import (
    StageResult,
    committed,
    precomputed,
    retry_unless_user_error,
    run_stage,
    worker_stage,
)

VAL_STAGES = ("val_prompts", "val_generate", "val")
"""The run-store stages one validation commits, in order (`val` holds the scored rows and the metrics)."""


@task(
    name="validate",
    task_run_name="validate-step{step}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_condition_fn=retry_unless_user_error,
)
def validate(rt: runtime.Runtime, step: int, gen_step: int) -> StageResult:
    """Evaluate the current rollout weights on the validation set (committed as stage `val`); returns its URI
    and the validation metrics, with `timing_s/val` the time of the three stages together."""
    done = committed(rt, step, "val")  # also a run validated before validation had its own stages
    if done is not None:
        return done
    n = rt.cfg.actor_rollout_ref.rollout.val_kwargs.n
    p_uri, p_m = run_stage(rt, step, "val_prompts", precomputed(rt.val_prompts))
    g_uri, g_m = worker_stage(
        rt,
        step,
        "val_generate",
        lambda job: rt.rollout.validation_stage(job, gen_step, n=n, uid_seed=rt.cfg.trainer.seed),
        input_uri=p_uri,
        schema="generate",
        n=n,
    )
    uri, metrics = worker_stage(
        rt, step, "val", rt.reward.validation_stage, input_uri=g_uri, schema="reward", n=n
    )
    total = sum(m.get(f"timing_s/{s}", 0.0) for m, s in zip((p_m, g_m, metrics), VAL_STAGES, strict=True))
    return uri, {**metrics, "timing_s/val": total}
