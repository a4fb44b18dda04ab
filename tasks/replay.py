"""Stage tasks of the replay-buffer step order (`trainer.step_order=replay_buffer`, reference `trainer_base`).

Rollouts enter a `dapo_core.store.replay.ReplayBuffer` over the run store instead of going straight into
the step. `tasks.rollout.sample_prompts(..., replay=True)` registers each drawn group in the ledger as
`pending`; `launch_generation` marks them `running` and submits a `StageJob` to the rollout worker (a
`Future` in `Runtime.launches`), which commits `generate_<tag>` itself; `collect_generation` waits for it,
has the reward worker commit `reward_<tag>` and adds the groups to the buffer (`replay_add`);
`regenerate_reissued` regenerates what `RunStore.reissue_inflight` re-issued at resume; `sample_batch`
(stage `batch`) samples `train_batch_size` groups oldest-first, `split_batch` cuts it into
`parameter_sync_step` parts run through `tasks.compute` / `tasks.update` with `part=i`, and `join_parts`
commits the step's `advantage` selection.

Every stage commits through `tasks.stage_commit`, so a committed (step, stage) is skipped on retry or resume;
ledger writes follow the stage they describe and are idempotent. More in
docs/ARCHITECTURE.md (The step orders).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from prefect import task

from dapo_core.config import off_policy_threshold
from dapo_core.data import batch as B
from dapo_core.stages import apply_group_filter, filter_column
from dapo_core.store.replay import ReplayBuffer
from tasks import runtime
from tasks.faults import InjectedFault, injected_fault, worker_died
from tasks.stage_commit import (
    STAGE_TASK_OPTS,
    committed,
    precomputed,
    run_stage,
    select_stage,
    stage_job,
    worker_stage,
)
from tasks.tables import (
    balanced_order,
    check_whole_groups,
    filter_metric,
    from_ipc,
    lengths_of,
    rows_of,
    uids_of,
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
            max_off_policy_threshold=off_policy_threshold(cfg),
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
def launch_generation(rt: runtime.Runtime, step: int, tag: str, gen_step: int, prompts_uri: str) -> int:
    """Submit generation of the groups of `prompts_uri` that are still in flight in the ledger
    (pending/running) to the rollout worker, without waiting; returns the number of groups submitted (0:
    nothing left to do). The worker reads the prompts and commits `generate_<tag>` itself."""
    stage = f"generate_{tag}"
    if rt.store.is_committed(step, stage):
        return 0  # collect_generation reuses the committed output
    uids = rt.store.read_uri(prompts_uri, verify=False, columns=["uid"]).column("uid").to_pylist()
    groups = list(dict.fromkeys(uids))
    tags = rt.store.get_many(groups)
    todo = [u for u in groups if tags.get(u, {}).get("status") in ("pending", "running")]
    if not todo:
        return 0
    input_uri = prompts_uri
    if len(todo) < len(groups):  # only these rows are generated: a row selection of the prompts
        wanted = set(todo)
        rows = np.asarray([i for i, u in enumerate(uids) if u in wanted], dtype=np.int64)
        input_uri, _ = select_stage(rt, step, f"prompts_{tag}_todo", [prompts_uri], lambda: (rows, {}))
    fault = injected_fault(stage, step, rt.run_id)
    if fault is not None:
        raise InjectedFault(fault)
    # the gen_step tag lets a re-issued prompt be regenerated with the same seeds (regenerate_reissued)
    rt.store.update_tags(todo, status="running", gen_step=gen_step)
    job = stage_job(rt, step, stage, input_uri=input_uri, schema="generate", n=rt.n)
    rt.launches[(step, tag)] = runtime.Launch(rt.rollout.submit_generate_stage(job, gen_step), todo)
    return len(todo)


def pending_launches(rt: runtime.Runtime) -> list[tuple[int, str]]:
    """(step, tag) of the generations submitted and not yet collected (oldest first)."""
    return sorted(rt.launches)


@task(name="replay_collect_generation", task_run_name="collect_generation-step{step}-{tag}", **_OPTS)
def collect_generation(rt: runtime.Runtime, step: int, tag: str) -> dict[str, float]:
    """Wait for the generation launched as (step, tag) (the rollout worker commits `generate_<tag>`), have the
    reward worker commit `reward_<tag>`, and add the groups that are not finished yet to the replay buffer
    (stamped with their `weight_version`). Only uids and the filter metric are read here."""
    stage = f"generate_{tag}"
    launch = rt.launches.get((step, tag))
    if launch is None and not rt.store.is_committed(step, stage):
        return {}
    if launch is not None:
        try:
            gen_uri, metrics = launch.future.result()
        except Exception as exc:
            died = worker_died(exc, rt, step, stage)
            if died is not None:
                raise died from exc
            raise
        rt.launches.pop((step, tag), None)
    else:
        done = committed(rt, step, stage)
        assert done is not None  # checked above
        gen_uri, metrics = done
    reward_uri, m = worker_stage(
        rt, step, f"reward_{tag}", rt.reward.score_stage, input_uri=gen_uri, schema="reward", n=rt.n
    )
    metrics = {**metrics, **m}
    uids = uids_of(rt.store.read_uri(reward_uri, verify=False, columns=["uid"]))
    tags = rt.store.get_many(uids)
    todo = [
        u
        for u in uids
        if tags.get(u, {}).get("status") != "finished" and tags.get(u, {}).get("consumed_step") is None
    ]
    if todo:
        buffer(rt).add_stage(reward_uri, step, uids=todo)
        if rt.cfg.algorithm.filter_groups.enable:
            metric = filter_metric(rt)
            part = rt.store.read_uri(reward_uri, verify=False, columns=["uid", filter_column(metric)])
            outcome = apply_group_filter(rows_of(part, todo), metric)
            metrics["train/num_groups"] = float(outcome.num_groups)
            metrics["train/num_kept_groups"] = float(outcome.num_kept_groups)
    metrics["train/added_groups"] = float(len(todo))
    return metrics


@task(name="replay_regenerate_reissued", task_run_name="regenerate_reissued-step{step}", **_OPTS)
def regenerate_reissued(rt: runtime.Runtime, step: int, fallback_gen_step: int) -> int:
    """Regenerate the prompts left pending/running in the ledger that no generation of this process owns (the
    ones `RunStore.reissue_inflight` re-issued at resume) from their payloads, each with the `gen_step` it was
    launched with (same seeds; `fallback_gen_step` if it never was). Returns the number of groups."""
    owned = {u for launch in rt.launches.values() for u in launch.uids}
    items = [
        (k, t)
        for k, t in rt.store.items("train", is_prompt=True)
        if t.get("status") in ("pending", "running") and k not in owned
    ]
    if not items:
        return 0
    # Tags after those an earlier attempt at this step used (whose files stay: a replay_add selection or a
    # batch may be built on them).
    first = _next_regen_index(rt, step)
    by_gen_step: dict[int, list[pa.Table]] = {}
    for key, tags in items:
        _, payload = rt.store.get(key)
        if payload is None:
            raise RuntimeError(
                f"prompt {key} of run {rt.run_id} is in flight in the ledger but has no payload to "
                "regenerate it from; draw replay-order prompts with "
                "tasks.rollout.sample_prompts(replay=True)"
            )
        by_gen_step.setdefault(int(tags.get("gen_step", fallback_gen_step)), []).append(from_ipc(payload))
    for j, (gen_step, tables) in enumerate(sorted(by_gen_step.items()), start=first):
        table = pa.concat_tables(tables, promote_options="default")
        uri, _ = run_stage(rt, step, f"prompts_gr{j}", precomputed(table))
        launch_generation.fn(rt, step, f"gr{j}", gen_step, uri)
        collect_generation.fn(rt, step, f"gr{j}")
    return len(items)


def _next_regen_index(rt: runtime.Runtime, step: int) -> int:
    """The first `gr<j>` tag of `step` that no file of an earlier attempt uses (committed or not)."""
    used = [-1]
    d = rt.store.step_dir(step)
    if d.is_dir():
        for p in d.iterdir():
            for prefix in ("prompts_gr", "generate_gr", "reward_gr"):
                if p.name.startswith(prefix):
                    digits = p.name[len(prefix) :].split(".")[0].split("_")[0]
                    if digits.isdigit():
                        used.append(int(digits))
    return max(used) + 1


# ---------------------------------------------------------------------------------------------- trainer side
@task(name="replay_sample_batch", task_run_name="sample_batch-step{step}", **_OPTS)
def sample_batch(rt: runtime.Runtime, step: int) -> tuple[str | None, dict[str, float]]:
    """Take `train_batch_size` groups oldest-first (evicting DAPO-filtered, stale and failed groups) as stage
    `batch` (a row selection over their `replay_add` files; nothing is read); returns `(None, metrics)` with
    `refill_needed` (prompts) / `must_wait` when it is short."""
    done = committed(rt, step, "batch")
    if done is not None:
        return done
    buf = buffer(rt)
    latest = rt.store.checkpoints.latest_step()
    if latest is not None:
        buf.release(min(latest, step - 1))  # consumed groups a checkpoint covers are never replayed
    selection, raw = buf.sample_selection(step)
    metrics = _scalar_metrics(raw)
    if selection is None:
        metrics["must_wait"] = float(bool(raw.get("must_wait")))
        return None, metrics
    metrics.pop("refill_needed", None)
    # rows of validated stages: committed as row ids and positions over the replay_add files
    return select_stage(rt, step, "batch", selection.bases, lambda: (selection.positions, metrics))


@task(name="replay_split_batch", task_run_name="split_batch-step{step}", **_OPTS)
def split_batch(rt: runtime.Runtime, step: int, batch_uri: str, parts: int) -> list[str]:
    """Cut the sampled batch into `parts` equal slices of whole groups (`batch_p<i>`), each balanced."""
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
def join_parts(rt: runtime.Runtime, step: int, uris: list[str]) -> str:
    """The step's `advantage` table: the parts' advantage tables concatenated (for step metrics)."""
    total = sum(rt.store.manifest(*rt.store.ref_of(u))["rows"] for u in uris)
    return select_stage(rt, step, "advantage", uris, lambda: (np.arange(total, dtype=np.int64), {}))[0]
