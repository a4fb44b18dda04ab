"""Rollout-side stage tasks: sample prompts, generate, reward, filter groups (dynamic sampling), assemble."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory
from dapo_core.stages import apply_group_filter, truncate_to_groups
from tasks import runtime
from tasks.common import (
    STAGE_TASK_OPTS,
    StageResult,
    balanced,
    committed,
    filter_metric,
    generation_metrics,
    precomputed,
    rows_of,
    run_stage,
    to_ipc,
    uids_of,
)

_OPTS = STAGE_TASK_OPTS


@task(name="sample_prompts", task_run_name="sample_prompts-step{step}-{tag}", **_OPTS)
def sample_prompts(run_id: str, step: int, tag: str, num_prompts: int, replay: bool = False) -> StageResult:
    """Draw `num_prompts` prompts as stage `prompts_<tag>`, each repeated n times with a fresh uid, and
    register their groups `pending` in the ledger. Both step orders draw their prompts here.

    The sampler position after the draw is stored in the stage's manifest: a committed stage is reused and the
    position restored, so a retried or resumed step draws the same prompts and skips none. The ledger write
    follows the commit and registers only uids the ledger does not know, so a crash between the two duplicates
    nothing. The replay-buffer order (`replay=True`) keeps each group's rows as its ledger payload, from which
    a prompt re-issued after a crash is regenerated (`tasks.replay.regenerate_reissued`).
    """
    rt = runtime.get(run_id)
    sampler = rt.sampler
    stage = f"prompts_{tag}"
    done = committed(rt, step, stage)
    if done is not None:
        sampler.load_state_dict((rt.store.meta(step, stage) or {})["sampler_state"])
        uri, metrics = done
        table = rt.store.read_uri(uri)
    else:
        # uids are seeded by (seed, step, generation batch) — the batch's index in the sync order ("g3" → 3),
        # its tag in the replay order — so a re-run samples the same tokens (sampling seeds derive from uids)
        uid_fn = uid_factory(rt.cfg.trainer.seed, "train", step, tag if replay else int(tag[1:]))
        before = sampler.state_dict()
        try:
            table = B.repeat_interleave_prompts(sampler.next_batch(num_prompts), rt.n, uid_fn=uid_fn)
            metrics = {"train/epoch": float(sampler.epoch)}
            meta = {"sampler_state": sampler.state_dict()}
            uri, metrics = run_stage(rt, step, stage, precomputed(table, metrics), meta=meta)
        except BaseException:
            sampler.load_state_dict(before)  # a retry draws the same prompts (none skipped)
            raise
    uids = uids_of(table)
    known = rt.store.get_many(uids)
    new = [u for u in uids if u not in known]
    if new:
        payloads = [to_ipc(rows_of(table, [u])) for u in new] if replay else None
        rt.store.register_prompts(new, step, payloads)
    return uri, metrics


@task(name="generate", task_run_name="generate-step{step}-g{gen_idx}", **_OPTS)
def generate(run_id: str, step: int, gen_idx: int, gen_step: int, prompts_uri: str) -> StageResult:
    """Sample n responses per prompt on the rollout worker (seeded by gen_step, uid, sample_idx)."""
    rt = runtime.get(run_id)

    def compute():
        table = rt.store.read_uri(prompts_uri)
        uids = sorted(set(table.column("uid").to_pylist()))
        rt.store.update_tags(uids, status="running")
        out = rt.rollout.generate(table, gen_step)
        return out, generation_metrics(out)

    return run_stage(rt, step, f"generate_g{gen_idx}", compute, schema="generate", n=rt.n)


@task(name="reward", task_run_name="reward-step{step}-g{gen_idx}", **_OPTS)
def reward(run_id: str, step: int, gen_idx: int, gen_uri: str) -> StageResult:
    """Score every trajectory (math_dapo + overlong shaping); finished prompts are marked in the ledger."""
    rt = runtime.get(run_id)

    def compute():
        table = rt.store.read_uri(gen_uri)
        out, metrics = rt.reward.score(table)
        uids = table.column("uid").to_pylist()
        samples = table.column("sample_idx").to_pylist()
        rt.store.put_many(
            [
                (f"{u}_{s}", {"is_prompt": False, "status": "finished", "global_steps": step})
                for u, s in zip(uids, samples, strict=True)
            ]
        )
        rt.store.update_tags(sorted(set(uids)), status="finished")
        return out, metrics

    return run_stage(rt, step, f"reward_g{gen_idx}", compute, schema="reward", n=rt.n)


@task(name="filter_groups", task_run_name="filter_groups-step{step}-g{gen_idx}", **_OPTS)
def filter_groups(run_id: str, step: int, gen_idx: int, reward_uri: str) -> StageResult:
    """Dynamic sampling: keep the groups whose metric varies (docs/REFERENCE.md §6.1 steps 7–8)."""
    rt = runtime.get(run_id)

    def compute():
        table = rt.store.read_uri(reward_uri)
        outcome = apply_group_filter(table, filter_metric(rt))
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
        table, dropped = truncate_to_groups(table, rt.cfg.data.train_batch_size, rt.n)
        return balanced(rt, table), {
            "train/num_gen_batches": float(num_gen_batches),
            "train/discarded_surplus_groups": float(dropped),
        }

    return run_stage(rt, step, "batch", compute, schema="reward", n=rt.n)
