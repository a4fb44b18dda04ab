"""Rollout-side stage tasks: sample prompts, generate, reward, filter groups (dynamic sampling), assemble the batch."""

from __future__ import annotations

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory
from dapo_core.stages import apply_group_filter, truncate_to_groups
from tasks import runtime
from tasks.common import StageResult, run_stage

_OPTS = {"retries": 2, "retry_delay_seconds": 1, "cache_policy": NO_CACHE}


@task(name="sample_prompts", task_run_name="sample_prompts-step{step}-g{gen_idx}", **_OPTS)
def sample_prompts(run_id: str, step: int, gen_idx: int, num_prompts: int) -> StageResult:
    """Draw `num_prompts` prompts, repeat each n times with a fresh uid, register them as pending in the ledger.

    The sampler position after the draw is stored in the stage's manifest, so a replayed step restores it.
    """
    rt = runtime.get(run_id)
    sampler = rt.extras["sampler"]
    stage = f"prompts_g{gen_idx}"
    if rt.store.is_committed(step, stage):
        meta = rt.store.meta(step, stage) or {}
        sampler.load_state_dict(meta["sampler_state"])
        return rt.store.stage_uri(step, stage), dict(meta.get("metrics", {}))
    before = sampler.state_dict()
    try:
        prompts = sampler.next_batch(num_prompts)
        uid_fn = uid_factory(rt.cfg.trainer.seed, "train", step, gen_idx)
        table = B.repeat_interleave_prompts(prompts, rt.n, uid_fn=uid_fn)
        uids = sorted(set(table.column("uid").to_pylist()))
        rt.store.put_many([(u, {"is_prompt": True, "status": "pending", "global_steps": step}) for u in uids])
        return run_stage(
            rt,
            step,
            stage,
            lambda: (table, {"train/epoch": float(sampler.epoch)}),
            meta={"sampler_state": sampler.state_dict()},
        )
    except BaseException:
        sampler.load_state_dict(before)  # a retry draws the same prompts (none skipped)
        raise


@task(name="generate", task_run_name="generate-step{step}-g{gen_idx}", **_OPTS)
def generate(run_id: str, step: int, gen_idx: int, gen_step: int, prompts_uri: str) -> StageResult:
    """Sample n responses per prompt on the rollout worker (seeded by gen_step, uid, sample_idx)."""
    rt = runtime.get(run_id)

    def compute():
        table = rt.store.read_uri(prompts_uri)
        uids = sorted(set(table.column("uid").to_pylist()))
        rt.store.update_tags(uids, status="running")
        out = rt.worker("rollout").call("generate", table, gen_step)
        lens = B.response_lengths(out)
        return out, {
            "response_length/gen_mean": float(sum(lens) / max(len(lens), 1)),
            "perf/gen_tokens": float(sum(lens)),
        }

    return run_stage(rt, step, f"generate_g{gen_idx}", compute, schema="generate", n=rt.n)


@task(name="reward", task_run_name="reward-step{step}-g{gen_idx}", **_OPTS)
def reward(run_id: str, step: int, gen_idx: int, gen_uri: str) -> StageResult:
    """Score every trajectory (math_dapo + overlong shaping); finished prompts are marked in the ledger."""
    rt = runtime.get(run_id)

    def compute():
        table = rt.store.read_uri(gen_uri)
        out, metrics = rt.worker("reward").call("score", table)
        uids = table.column("uid").to_pylist()
        samples = table.column("sample_idx").to_pylist()
        rt.store.put_many(
            [
                (f"{u}_{s}", {"is_prompt": False, "status": "finished", "global_steps": step})
                for u, s in zip(uids, samples)
            ]
        )
        rt.store.update_tags(sorted(set(uids)), status="finished")
        return out, metrics

    return run_stage(rt, step, f"reward_g{gen_idx}", compute, schema="reward", n=rt.n)


@task(name="filter_groups", task_run_name="filter_groups-step{step}-g{gen_idx}", **_OPTS)
def filter_groups(run_id: str, step: int, gen_idx: int, reward_uri: str) -> StageResult:
    """Dynamic sampling: keep the groups whose metric varies (reference §6.1 steps 7–8)."""
    rt = runtime.get(run_id)

    def compute():
        table = rt.store.read_uri(reward_uri)
        outcome = apply_group_filter(table, str(rt.cfg.algorithm.filter_groups.metric))
        return outcome.kept, {
            **outcome.metrics,
            "train/num_groups": float(outcome.num_groups),
            "train/num_kept_groups": float(outcome.num_kept_groups),
        }

    return run_stage(rt, step, f"kept_g{gen_idx}", compute)


@task(name="assemble_batch", task_run_name="assemble_batch-step{step}", **_OPTS)
def assemble_batch(run_id: str, step: int, kept_uris: list[str], num_gen_batches: int) -> StageResult:
    """Concatenate kept groups, truncate to train_batch_size·n (surplus discarded, §6.1 step 10), balance."""
    rt = runtime.get(run_id)

    def compute():
        tables = [rt.store.read_uri(u) for u in kept_uris]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        table, dropped = truncate_to_groups(table, int(rt.cfg.data.train_batch_size), rt.n)
        if bool(rt.cfg.trainer.balance_batch):
            table = B.balance_batch(table, dp_size=int(rt.extras.get("dp_size", 1)))
        return table, {
            "train/num_gen_batches": float(num_gen_batches),
            "train/discarded_surplus_groups": float(dropped),
        }

    return run_stage(rt, step, "batch", compute, schema="reward", n=rt.n)
