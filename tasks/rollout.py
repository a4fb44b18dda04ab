"""Rollout-side stage tasks: sample prompts, generate, and reward, which also filters the groups (dynamic
sampling) and assembles the step's batch once enough groups are kept."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
from prefect import task

from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory
from dapo_core.stages import apply_group_filter, filter_column, truncate_to_groups
from dapo_core.store.jobs import StageJob
from tasks import runtime
from tasks.stage_commit import (
    STAGE_TASK_OPTS,
    StageResult,
    committed,
    precomputed,
    run_stage,
    select_stage,
    worker_stage,
)
from tasks.tables import (
    balanced_order,
    check_whole_groups,
    filter_metric,
    lengths_of,
    rows_of,
    to_ipc,
    uids_of,
)

_OPTS = STAGE_TASK_OPTS


def draw_prompts(
    rt: runtime.Runtime, step: int, tag: str, num_prompts: int, replay: bool = False
) -> tuple[str, dict[str, float], pa.Table]:
    """Draw `num_prompts` prompts as stage `prompts_<tag>`, each repeated n times with a fresh uid; returns
    the stage's URI, metrics and table. Nothing is written to the ledger here (the callers register the
    groups).

    The sampler position after the draw is stored in the stage's manifest: a committed stage is reused and the
    position restored, so a retried or resumed step draws the same prompts and skips none."""
    sampler = rt.sampler
    stage = f"prompts_{tag}"
    done = committed(rt, step, stage)
    if done is not None:
        sampler.load_state_dict((rt.store.meta(step, stage) or {})["sampler_state"])
        uri, metrics = done
        return uri, metrics, rt.store.read_uri(uri)
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
    return uri, metrics, table


def _new_uids(rt: runtime.Runtime, table: pa.Table) -> tuple[list[str], list[str]]:
    """The group uids of a prompt table, split into (known to the ledger, new), each in table order."""
    uids = uids_of(table)
    known = rt.store.get_many(uids)
    return [u for u in uids if u in known], [u for u in uids if u not in known]


@task(name="sample_prompts", task_run_name="sample_prompts-step{step}-{tag}", **_OPTS)
def sample_prompts(
    rt: runtime.Runtime, step: int, tag: str, num_prompts: int, replay: bool = False
) -> StageResult:
    """Draw `num_prompts` prompts as stage `prompts_<tag>` (`draw_prompts`) and register their groups
    `pending` in the ledger. The replay-buffer order draws its prompts here; the synchronous order draws them
    inside its `generate` task.

    The ledger write follows the commit and registers only uids the ledger does not know, so a crash between
    the two duplicates nothing. The replay-buffer order (`replay=True`) keeps each group's rows as its ledger
    payload, from which a prompt re-issued after a crash is regenerated (`tasks.replay.regenerate_reissued`).
    """
    uri, metrics, table = draw_prompts(rt, step, tag, num_prompts, replay)
    _, new = _new_uids(rt, table)
    if new:
        payloads = [to_ipc(rows_of(table, [u])) for u in new] if replay else None
        rt.store.register_prompts(new, step, payloads)
    return uri, metrics


@task(name="generate", task_run_name="generate-step{step}-g{gen_idx}", **_OPTS)
def generate(rt: runtime.Runtime, step: int, gen_idx: int, gen_step: int, num_prompts: int) -> StageResult:
    """Draw `num_prompts` prompts (stage `prompts_g<gen_idx>`, `draw_prompts`) and sample n responses per
    prompt on the rollout replicas (each a share of whole groups; seeded by gen_step, uid, sample_idx).

    Drawing is part of this task (no task of its own: it is plumbing, and idempotent, so a retry of this task
    redraws nothing). The groups enter the ledger `running` in one transaction just before the generation
    starts (new uids are inserted, known ones re-tagged); when the generation is committed already (a
    replayed step), new uids are only registered `pending`, as a separate draw would have left them."""
    stage = f"generate_g{gen_idx}"
    prompts_uri, _, table = draw_prompts(rt, step, f"g{gen_idx}", num_prompts)
    known, new = _new_uids(rt, table)
    if new and rt.store.is_committed(step, stage):
        rt.store.register_prompts(new, step)

    def call(job: StageJob) -> StageResult:
        running = {"is_prompt": True, "status": "running", "global_steps": int(step)}
        rt.store.apply(puts=[(u, running) for u in new], merges={u: {"status": "running"} for u in known})
        return rt.rollout.generate_stage(job, gen_step)

    return worker_stage(rt, step, stage, call, input_uri=prompts_uri, schema="generate", n=rt.n)


class Scored(NamedTuple):
    """What the `reward` task returns."""

    uri: str
    """The scored generation (stage `reward_g<k>`)."""
    metrics: dict[str, float]
    """The scoring stage's metrics."""
    kept_uri: str
    """The groups kept by dynamic sampling (stage `kept_g<k>`; the scored stage itself without it)."""
    kept_metrics: dict[str, float]
    """`train/num_groups`, `train/num_kept_groups` and the filter's metrics (empty without the filter)."""
    batch: StageResult | None
    """The step's assembled batch (stage `batch`) once the kept groups cover what the step still needed."""


@task(name="reward", task_run_name="reward-step{step}-g{gen_idx}", **_OPTS)
def reward(
    rt: runtime.Runtime,
    step: int,
    gen_idx: int,
    gen_uri: str,
    kept_before: list[str] | None = None,
    groups_missing: int | None = None,
) -> Scored:
    """Score every trajectory (math_dapo + overlong shaping); the trajectories are recorded and their prompts
    marked finished in the ledger in one transaction. A replayed (committed) stage records them too when the
    ledger lacks them (a run killed between the stage's commit and that transaction: the resume re-issued
    those prompts).

    Then, in the same task (plumbing, no task of its own; a retry skips each stage already committed):
    dynamic sampling keeps the groups whose metric varies (`filter_kept`, stage `kept_g<k>`), and once the
    kept groups cover `groups_missing` (default: the whole `train_batch_size`) the step's batch is assembled
    from `kept_before` (the step's earlier kept selections) and these (`assemble`, stage `batch`). Without
    dynamic sampling every group is kept and the batch is assembled at once."""
    scored = False

    def call(job: StageJob) -> StageResult:
        nonlocal scored
        out = rt.reward.score_stage(job)
        scored = True
        _record_finished(rt, step, gen_uri)
        return out

    uri, metrics = worker_stage(
        rt, step, f"reward_g{gen_idx}", call, input_uri=gen_uri, schema="reward", n=rt.n
    )
    if not scored:
        _record_finished(rt, step, gen_uri, only_missing=True)
    before = list(kept_before or [])
    if not rt.cfg.algorithm.filter_groups.enable:
        return Scored(uri, metrics, uri, {}, assemble(rt, step, [*before, uri], gen_idx + 1))
    kept_uri, kept_metrics = filter_kept(rt, step, gen_idx, uri)
    missing = rt.cfg.data.train_batch_size if groups_missing is None else groups_missing
    batch = None
    if kept_metrics["train/num_kept_groups"] >= missing:
        batch = assemble(rt, step, [*before, kept_uri], gen_idx + 1)
    return Scored(uri, metrics, kept_uri, kept_metrics, batch)


def _record_finished(rt: runtime.Runtime, step: int, gen_uri: str, only_missing: bool = False) -> None:
    """Put the trajectories of the generation at `gen_uri` (`<uid>_<sample_idx>`, finished) and mark their
    prompts finished, in one ledger transaction; with `only_missing`, only when a trajectory is missing or a
    prompt is not finished."""
    ids = rt.store.read_uri(gen_uri, verify=False, columns=["uid", "sample_idx"])
    uids = ids.column("uid").to_pylist()
    keys = [f"{u}_{s}" for u, s in zip(uids, ids.column("sample_idx").to_pylist(), strict=True)]
    prompts = sorted(set(uids))
    if only_missing:
        tags = rt.store.get_many([*prompts, *keys])
        if all(k in tags for k in keys) and all(tags.get(u, {}).get("status") == "finished" for u in prompts):
            return
    finished = {"is_prompt": False, "status": "finished", "global_steps": step}
    rt.store.apply(puts=[(k, finished) for k in keys], merges={u: {"status": "finished"} for u in prompts})


def filter_kept(rt: runtime.Runtime, step: int, gen_idx: int, reward_uri: str) -> StageResult:
    """Dynamic sampling: keep the groups whose metric varies (docs/REFERENCE.md §6.1 steps 7–8), committed as
    the row selection `kept_g<gen_idx>` of the scored stage at `reward_uri`."""

    def compute() -> tuple[np.ndarray, dict[str, float]]:
        metric = filter_metric(rt)
        table = rt.store.read_uri(reward_uri, verify=False, columns=["uid", filter_column(metric)])
        table = table.append_column("_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        outcome = apply_group_filter(table, metric)
        return outcome.kept.column("_row").to_numpy(), {
            **outcome.metrics,
            "train/num_groups": float(outcome.num_groups),
            "train/num_kept_groups": float(outcome.num_kept_groups),
        }

    return select_stage(rt, step, f"kept_g{gen_idx}", [reward_uri], compute)


def assemble(rt: runtime.Runtime, step: int, kept_uris: list[str], num_gen_batches: int) -> StageResult:
    """Concatenate kept groups, truncate to train_batch_size·n (surplus discarded, §6.1 step 10), balance;
    committed as stage `batch` (a row selection)."""

    def compute() -> tuple[np.ndarray, dict[str, float]]:
        table, dropped = truncate_to_groups(lengths_of(rt, kept_uris), rt.cfg.data.train_batch_size, rt.n)
        check_whole_groups(table, rt.n, f"step {step}: assembled batch")
        return balanced_order(rt, table), {
            "train/num_gen_batches": float(num_gen_batches),
            "train/discarded_surplus_groups": float(dropped),
        }

    return select_stage(rt, step, "batch", kept_uris, compute)
