"""Stage tasks of the replay-buffer step order (`trainer.step_order=replay_buffer`, reference `trainer_base`).

Rollouts enter a `dapo_core.store.replay.ReplayBuffer` over the run store instead of going straight into the
step:

- `tasks.rollout.sample_prompts(..., replay=True)` (stage `prompts_<tag>`) draws prompts, commits them, then
  registers each group in the ledger as `pending` with its rows as payload (Arrow IPC), so a prompt re-issued
  after a crash can be regenerated.
- `launch_generation` marks the groups `running` and *submits* generation to the rollout worker (a `Future`,
  kept in `Runtime.launches`, never a task input/output); `collect_generation` resolves it, commits
  `generate_<tag>` and `reward_<tag>` and adds the groups to the buffer (which stamps `min/max_global_steps`
  from `weight_version`).
- `regenerate_reissued` regenerates prompts the ledger still holds as pending/running that no generation of
  this process owns (re-issued by `RunStore.reissue_inflight` at resume).
- `sample_batch` (stage `batch`) samples `train_batch_size` groups oldest-first; `split_batch` (`batch_p<i>`)
  cuts it into `parameter_sync_step` equal parts; each part goes through the ordinary stage tasks of
  `tasks.compute` and `tasks.update` called with `part=i` (stage `<name>_p<i>`); `join_parts` commits the
  step's `advantage` table.

Every stage commits through `tasks.common.run_stage`, so a committed (step, stage) is skipped on retry or
resume. Ledger writes come after the stage they describe is committed, and each is idempotent (only uids the
ledger does not know are registered; only groups not yet finished are added), so a crash between the two
duplicates nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from prefect import task

from dapo_core.compute.cluster import submit
from dapo_core.data import batch as B
from dapo_core.stages import apply_group_filter, filter_column
from dapo_core.store.replay import ReplayBuffer
from tasks import runtime
from tasks.common import (
    STAGE_TASK_OPTS,
    balanced_order,
    check_whole_groups,
    committed,
    filter_metric,
    from_ipc,
    generation_metrics,
    lengths_of,
    precomputed,
    rows_of,
    run_stage,
    select_stage,
    uids_of,
    worker_stage,
)

_OPTS = STAGE_TASK_OPTS
_DAPO_COUNTS = "_dapo_filtered_reward_counts"


# ---------------------------------------------------------------------------------------------- helpers
def buffer(rt: runtime.Runtime) -> ReplayBuffer:
    """The run's replay buffer (created on first use from the config)."""
    if rt.replay_buffer is None:
        cfg = rt.cfg
        rt.replay_buffer = ReplayBuffer(
            rt.store,
            train_batch_size=cfg.data.train_batch_size,
            n=rt.n,
            filter_groups_metric=filter_column(filter_metric(rt))
            if cfg.algorithm.filter_groups.enable
            else None,
            max_off_policy_threshold=cfg.trainer.max_off_policy_threshold,
            max_off_policy_strategy=cfg.trainer.max_off_policy_strategy,
        )
    return rt.replay_buffer


def _scalar_metrics(metrics: dict[str, Any], prefix: str = "training") -> dict[str, float]:
    """Buffer metrics as scalars: the DAPO reward-count dict becomes
    `<prefix>/filter_groups/reward_counts/<v>`."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k == _DAPO_COUNTS:
            for value, count in dict(v).items():
                out[f"{prefix}/filter_groups/reward_counts/{value}"] = float(count)
        elif k != "must_wait" and isinstance(v, (int, float)):
            out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------------- rollout side
@task(name="replay_launch_generation", task_run_name="launch_generation-step{step}-{tag}", **_OPTS)
def launch_generation(run_id: str, step: int, tag: str, gen_step: int, prompts_uri: str) -> int:
    """Submit generation of the groups of `prompts_uri` that are still in flight in the ledger
    (pending/running) to the rollout worker, without waiting; returns the number of groups submitted (0:
    nothing left to do)."""
    rt = runtime.get(run_id)
    if rt.store.is_committed(step, f"generate_{tag}"):
        return 0  # collect_generation reuses the committed output
    table = rt.store.read_uri(prompts_uri)
    uids = uids_of(table)
    tags = rt.store.get_many(uids)
    todo = [u for u in uids if tags.get(u, {}).get("status") in ("pending", "running")]
    if not todo:
        return 0
    table = rows_of(table, todo) if len(todo) < len(uids) else table
    # the gen_step tag lets a re-issued prompt be regenerated with the same seeds (regenerate_reissued)
    rt.store.update_tags(todo, status="running", gen_step=gen_step)
    rt.launches[(step, tag)] = runtime.Launch(submit(rt.rollout.generate, table, gen_step), todo)
    return len(todo)


def pending_launches(run_id: str) -> list[tuple[int, str]]:
    """(step, tag) of the generations submitted and not yet collected (oldest first)."""
    return sorted(runtime.get(run_id).launches)


@task(name="replay_collect_generation", task_run_name="collect_generation-step{step}-{tag}", **_OPTS)
def collect_generation(run_id: str, step: int, tag: str) -> dict[str, float]:
    """Resolve the generation launched as (step, tag), commit `generate_<tag>` and `reward_<tag>`, and add the
    groups that are not finished yet to the replay buffer (stamped with their `weight_version`)."""
    rt = runtime.get(run_id)
    launch = rt.launches.get((step, tag))
    if launch is None and not rt.store.is_committed(step, f"generate_{tag}"):
        return {}

    def generate() -> tuple[pa.Table, dict[str, float]]:
        assert launch is not None  # without a launch the stage is committed and not computed again
        out = launch.future.result()
        return out, generation_metrics(out)

    prompts = f"prompts_{tag}"
    base = rt.store.stage_uri(step, prompts) if rt.store.is_committed(step, prompts) else None
    gen_uri, metrics = run_stage(rt, step, f"generate_{tag}", generate, schema="generate", n=rt.n, base=base)
    rt.launches.pop((step, tag), None)
    reward_uri, m = worker_stage(
        rt, step, f"reward_{tag}", rt.reward.score_stage, input_uri=gen_uri, schema="reward", n=rt.n
    )
    metrics = {**metrics, **m}
    table = rt.store.read_uri(reward_uri)
    tags = rt.store.get_many(uids_of(table))
    todo = [
        u
        for u in uids_of(table)
        if tags.get(u, {}).get("status") != "finished" and tags.get(u, {}).get("consumed_step") is None
    ]
    if todo:
        part = rows_of(table, todo)
        buffer(rt).add_groups(part, step)
        if rt.cfg.algorithm.filter_groups.enable:
            outcome = apply_group_filter(part, filter_metric(rt))
            metrics["train/num_groups"] = float(outcome.num_groups)
            metrics["train/num_kept_groups"] = float(outcome.num_kept_groups)
    metrics["train/added_groups"] = float(len(todo))
    return metrics


@task(name="replay_regenerate_reissued", task_run_name="regenerate_reissued-step{step}", **_OPTS)
def regenerate_reissued(run_id: str, step: int, fallback_gen_step: int) -> int:
    """Regenerate the prompts left pending/running in the ledger that no generation of this process owns (the
    ones `RunStore.reissue_inflight` re-issued at resume) from their payloads, each with the `gen_step` it was
    launched with (same seeds; `fallback_gen_step` if it never was). Returns the number of groups."""
    rt = runtime.get(run_id)
    owned = {u for launch in rt.launches.values() for u in launch.uids}
    items = [
        (k, t)
        for k, t in rt.store.items("train", is_prompt=True)
        if t.get("status") in ("pending", "running") and k not in owned
    ]
    if not items:
        return 0
    for stage in rt.store.committed_stages(step):  # left by an earlier attempt at this step
        if stage.startswith(("prompts_gr", "generate_gr", "reward_gr")):
            rt.store.delete_stage(step, stage)
    by_gen_step: dict[int, list[pa.Table]] = {}
    for key, tags in items:
        _, payload = rt.store.get(key)
        if payload is None:
            raise RuntimeError(
                f"prompt {key} of run {run_id} is in flight in the ledger but has no payload to regenerate "
                f"it from; draw replay-order prompts with tasks.rollout.sample_prompts(replay=True)"
            )
        by_gen_step.setdefault(int(tags.get("gen_step", fallback_gen_step)), []).append(from_ipc(payload))
    for j, (gen_step, tables) in enumerate(sorted(by_gen_step.items())):
        table = pa.concat_tables(tables, promote_options="default")
        uri, _ = run_stage(rt, step, f"prompts_gr{j}", precomputed(table))
        launch_generation.fn(run_id, step, f"gr{j}", gen_step, uri)
        collect_generation.fn(run_id, step, f"gr{j}")
    return len(items)


# ---------------------------------------------------------------------------------------------- trainer side
@task(name="replay_sample_batch", task_run_name="sample_batch-step{step}", **_OPTS)
def sample_batch(run_id: str, step: int) -> tuple[str | None, dict[str, float]]:
    """Take `train_batch_size` groups oldest-first (evicting DAPO-filtered, stale and failed groups) as stage
    `batch`; returns `(None, metrics)` with `refill_needed` (prompts) / `must_wait` when it is short."""
    rt = runtime.get(run_id)
    done = committed(rt, step, "batch")
    if done is not None:
        return done
    buf = buffer(rt)
    latest = rt.store.checkpoints.latest_step()
    if latest is not None:
        buf.release(min(latest, step - 1))  # consumed groups a checkpoint covers are never replayed
    table, raw = buf.sample(step)
    metrics = _scalar_metrics(raw)
    if table is None:
        metrics["must_wait"] = float(bool(raw.get("must_wait")))
        return None, metrics
    metrics.pop("refill_needed", None)
    return run_stage(rt, step, "batch", precomputed(table, metrics), schema="reward", n=rt.n)


@task(name="replay_split_batch", task_run_name="split_batch-step{step}", **_OPTS)
def split_batch(run_id: str, step: int, batch_uri: str, parts: int) -> list[str]:
    """Cut the sampled batch into `parts` equal slices of whole groups (`batch_p<i>`), each balanced."""
    rt = runtime.get(run_id)
    lengths = lengths_of(rt, [batch_uri])
    if lengths.num_rows % (parts * rt.n):
        raise ValueError(
            f"step {step}: batch of {lengths.num_rows // rt.n} groups does not split into "
            f"trainer.parameter_sync_step={parts} equal parts; choose a divisor of data.train_batch_size"
        )
    uris, start = [], 0
    for i, part in enumerate(B.chunk(lengths, parts)):
        first = start

        def rows(
            part: pa.Table = part, first: int = first, i: int = i
        ) -> tuple[np.ndarray, dict[str, float]]:
            check_whole_groups(part, rt.n, f"step {step}: part {i} of the batch")
            return first + balanced_order(rt, part), {}

        uris.append(select_stage(rt, step, f"batch_p{i}", [batch_uri], rows)[0])
        start += part.num_rows
    return uris


@task(name="replay_join_parts", task_run_name="join_parts-step{step}", **_OPTS)
def join_parts(run_id: str, step: int, uris: list[str]) -> str:
    """The step's `advantage` table: the parts' advantage tables concatenated (for step metrics)."""
    rt = runtime.get(run_id)
    total = sum(rt.store.manifest(*rt.store.ref_of(u))["rows"] for u in uris)
    return select_stage(rt, step, "advantage", uris, lambda: (np.arange(total, dtype=np.int64), {}))[0]
