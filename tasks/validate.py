"""Validation task: generate on the held-out prompts with the validation sampling settings, score, and compute
`val-core/…` / `val-aux/…` metrics (mean@k, best@k, maj@k, pass@k per data source)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.data import batch as B
from dapo_core.metrics.validation import validation_summary
from dapo_core.seeding import uid_factory
from tasks import runtime
from tasks.common import StageResult, retry_unless_user_error, run_stage


@task(
    name="validate",
    task_run_name="validate-step{step}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_condition_fn=retry_unless_user_error,
)
def validate(run_id: str, step: int, gen_step: int) -> StageResult:
    """Evaluate the current rollout weights on the validation set (committed as stage `val`)."""
    rt = runtime.get(run_id)
    vk = rt.cfg.actor_rollout_ref.rollout.val_kwargs

    def compute():
        uid_fn = uid_factory(rt.cfg.trainer.seed, "val", step)
        table = B.repeat_interleave_prompts(rt.val_prompts, vk.n, uid_fn=uid_fn)
        out = rt.rollout.generate(table, gen_step, True)
        out, _ = rt.reward.score(out)
        return out, validation_summary(out)

    return run_stage(rt, step, "val", compute)
