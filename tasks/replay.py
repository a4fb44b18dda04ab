"""Stage tasks of the replay-buffer step order (`trainer.step_order=replay_buffer`, reference `trainer_base`).

Rollouts enter a `dapo_core.store.replay.ReplayBuffer` over the run store instead of going straight into the step:

- `draw_prompts` (stage `prompts_<tag>`) draws prompts, commits them, then registers each group in the ledger as
  `pending` with its rows as payload (Arrow IPC), so a prompt re-issued after a crash can be regenerated.
- `launch_generation` marks the groups `running` and *submits* generation to the rollout worker (a Ray ObjectRef,
  kept in the runtime, never a task input/output); `collect_generation` resolves it, commits `generate_<tag>` and
  `reward_<tag>` and adds the groups to the buffer (which stamps `min/max_global_steps` from `weight_version`).
- `regenerate_reissued` regenerates prompts the ledger still holds as pending/running that no generation of this
  process owns (re-issued by `RunStore.reissue_inflight` at resume).
- `sample_batch` (stage `batch`) samples `train_batch_size` groups oldest-first; `split_batch` (`batch_p<i>`) cuts
  it into `parameter_sync_step` equal parts; each part goes through the ordinary stage tasks of `tasks.compute` and
  `tasks.update` called with `part=i` (stage `<name>_p<i>`); `join_parts` commits the step's `advantage` table.

Every stage commits through `tasks.common.run_stage`, so a committed (step, stage) is skipped on retry or resume.
Ledger writes come after the stage they describe is committed, and each is idempotent (only uids the ledger does
not know are registered; only groups not yet finished are added), so a crash between the two duplicates nothing.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import NO_CACHE

from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory
from dapo_core.stages import apply_group_filter
from dapo_core.store.replay import ReplayBuffer
from tasks import runtime
from tasks.common import StageResult, run_stage

_OPTS = {"retries": 2, "retry_delay_seconds": 1, "cache_policy": NO_CACHE}
_BUFFER = "replay_buffer"
_INFLIGHT = "replay_inflight"  # {(step, tag): {"ref": ObjectRef | table, "uids": [...]}}
_DAPO_COUNTS = "_dapo_filtered_reward_counts"


# ---------------------------------------------------------------------------------------------- helpers
def filter_column(metric: str) -> str:
    """The reward column the buffer's DAPO filter reads for `algorithm.filter_groups.metric`."""
    return "reward" if metric in ("seq_reward", "seq_final_reward") else metric


def buffer(rt: runtime.Runtime) -> ReplayBuffer:
    """The run's replay buffer (created on first use from the config)."""
    if _BUFFER not in rt.extras:
        cfg = rt.cfg
        fg = cfg.algorithm.filter_groups
        rt.extras[_BUFFER] = ReplayBuffer(
            rt.store,
            train_batch_size=int(cfg.data.train_batch_size),
            n=rt.n,
            filter_groups_metric=filter_column(str(fg.metric)) if fg.enable else None,
            max_off_policy_threshold=int(cfg.trainer.max_off_policy_threshold),
            max_off_policy_strategy=str(cfg.trainer.max_off_policy_strategy),
        )
    return rt.extras[_BUFFER]


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _rows_of(table: pa.Table, uids: list[str]) -> pa.Table:
    return table.filter(pc.is_in(table.column("uid"), value_set=pa.array(uids, pa.string())))


def _uids(table: pa.Table) -> list[str]:
    return list(dict.fromkeys(table.column("uid").to_pylist()))


def _scalar_metrics(metrics: dict[str, Any], prefix: str = "training") -> dict[str, float]:
    """Buffer metrics as scalars: the DAPO reward-count dict becomes `<prefix>/filter_groups/reward_counts/<v>`."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k == _DAPO_COUNTS:
            for value, count in dict(v).items():
                out[f"{prefix}/filter_groups/reward_counts/{value}"] = float(count)
        elif k != "must_wait" and isinstance(v, (int, float)):
            out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------------- rollout side
@task(name="replay_draw_prompts", task_run_name="draw_prompts-step{step}-{tag}", **_OPTS)
def draw_prompts(run_id: str, step: int, tag: str, num_prompts: int) -> StageResult:
    """Draw `num_prompts` prompts (n rows each, fresh uids) as stage `prompts_<tag>`, then register the groups
    `pending` in the ledger with their rows as payload. A committed stage is reused (sampler position restored)."""
    rt = runtime.get(run_id)
    sampler = rt.extras["sampler"]
    stage = f"prompts_{tag}"
    if rt.store.is_committed(step, stage):
        meta = rt.store.meta(step, stage) or {}
        sampler.load_state_dict(meta["sampler_state"])
        uri, metrics = rt.store.stage_uri(step, stage), dict(meta.get("metrics", {}))
    else:
        uid_fn = uid_factory(rt.cfg.trainer.seed, "train", step, tag)  # reproducible: same uids, same seeds
        before = sampler.state_dict()
        try:
            table = B.repeat_interleave_prompts(sampler.next_batch(int(num_prompts)), rt.n, uid_fn=uid_fn)
            uri, metrics = run_stage(
                rt,
                step,
                stage,
                lambda: (table, {"train/epoch": float(sampler.epoch)}),
                meta={"sampler_state": sampler.state_dict()},
            )
        except BaseException:
            sampler.load_state_dict(before)  # a retry draws the same prompts (none skipped)
            raise
    table = rt.store.read_uri(uri)
    known = rt.store.get_many(_uids(table))
    new = [u for u in _uids(table) if u not in known]
    if new:
        buffer(rt).register_prompts(new, step, payloads=[_ipc(_rows_of(table, [u])) for u in new])
    return uri, metrics


@task(name="replay_launch_generation", task_run_name="launch_generation-step{step}-{tag}", **_OPTS)
def launch_generation(run_id: str, step: int, tag: str, gen_step: int, prompts_uri: str) -> int:
    """Submit generation of the groups of `prompts_uri` that are still in flight in the ledger (pending/running)
    to the rollout worker, without waiting; returns the number of groups submitted (0: nothing left to do)."""
    rt = runtime.get(run_id)
    if rt.store.is_committed(step, f"generate_{tag}"):
        return 0  # collect_generation reuses the committed output
    table = rt.store.read_uri(prompts_uri)
    uids = _uids(table)
    tags = rt.store.get_many(uids)
    todo = [u for u in uids if tags.get(u, {}).get("status") in ("pending", "running")]
    if not todo:
        return 0
    table = _rows_of(table, todo) if len(todo) < len(uids) else table
    # the gen_step tag lets a re-issued prompt be regenerated with the same seeds (regenerate_reissued)
    rt.store.update_tags(todo, status="running", gen_step=int(gen_step))
    ref = rt.worker("rollout").submit("generate", table, gen_step)
    rt.extras.setdefault(_INFLIGHT, {})[(step, tag)] = {"ref": ref, "uids": todo}
    return len(todo)


def pending_launches(run_id: str) -> list[tuple[int, str]]:
    """(step, tag) of the generations submitted and not yet collected (oldest first)."""
    return sorted(runtime.get(run_id).extras.get(_INFLIGHT, {}))


@task(name="replay_collect_generation", task_run_name="collect_generation-step{step}-{tag}", **_OPTS)
def collect_generation(run_id: str, step: int, tag: str) -> dict[str, float]:
    """Resolve the generation launched as (step, tag), commit `generate_<tag>` and `reward_<tag>`, and add the
    groups that are not finished yet to the replay buffer (stamped with their `weight_version`)."""
    rt = runtime.get(run_id)
    inflight = rt.extras.setdefault(_INFLIGHT, {})
    entry = inflight.get((step, tag))
    if entry is None and not rt.store.is_committed(step, f"generate_{tag}"):
        return {}
    handle = rt.worker("rollout")

    def generate():
        out = handle.wait(entry["ref"])
        lens = B.response_lengths(out)
        return out, {
            "response_length/gen_mean": float(sum(lens) / max(len(lens), 1)),
            "perf/gen_tokens": float(sum(lens)),
        }

    gen_uri, metrics = run_stage(rt, step, f"generate_{tag}", generate, schema="generate", n=rt.n)
    inflight.pop((step, tag), None)

    def score():
        out, m = rt.worker("reward").call("score", rt.store.read_uri(gen_uri))
        return out, m

    reward_uri, m = run_stage(rt, step, f"reward_{tag}", score, schema="reward", n=rt.n)
    metrics = {**metrics, **m}
    table = rt.store.read_uri(reward_uri)
    tags = rt.store.get_many(_uids(table))
    todo = [
        u
        for u in _uids(table)
        if tags.get(u, {}).get("status") != "finished" and tags.get(u, {}).get("consumed_step") is None
    ]
    if todo:
        part = _rows_of(table, todo)
        buffer(rt).add_groups(part, step)
        fg = rt.cfg.algorithm.filter_groups
        if fg.enable:
            outcome = apply_group_filter(part, str(fg.metric))
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
    owned = {u for e in rt.extras.get(_INFLIGHT, {}).values() for u in e["uids"]}
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
                f"prompt {key} of run {run_id} is in flight in the ledger but has no payload to "
                f"regenerate it from; register prompts with ReplayBuffer.register_prompts(payloads=)"
            )
        by_gen_step.setdefault(int(tags.get("gen_step", fallback_gen_step)), []).append(_from_ipc(payload))
    for j, (gen_step, tables) in enumerate(sorted(by_gen_step.items())):
        table = pa.concat_tables(tables, promote_options="default")
        uri, _ = run_stage(rt, step, f"prompts_gr{j}", lambda table=table: (table, {}))
        launch_generation.fn(run_id, step, f"gr{j}", gen_step, uri)
        collect_generation.fn(run_id, step, f"gr{j}")
    return len(items)


# ---------------------------------------------------------------------------------------------- trainer side
@task(name="replay_sample_batch", task_run_name="sample_batch-step{step}", **_OPTS)
def sample_batch(run_id: str, step: int) -> tuple[str | None, dict[str, float]]:
    """Take `train_batch_size` groups oldest-first (evicting DAPO-filtered, stale and failed groups) as stage
    `batch`; returns `(None, metrics)` with `refill_needed` (prompts) / `must_wait` when the buffer is short."""
    rt = runtime.get(run_id)
    if rt.store.is_committed(step, "batch"):
        return rt.store.stage_uri(step, "batch"), dict(
            (rt.store.meta(step, "batch") or {}).get("metrics", {})
        )
    buf = buffer(rt)
    latest = rt.extras["checkpoints"].latest_step()
    if latest is not None:
        buf.release(min(int(latest), step - 1))  # consumed groups a checkpoint covers are never replayed
    table, raw = buf.sample(step)
    metrics = _scalar_metrics(raw)
    if table is None:
        metrics["must_wait"] = float(bool(raw.get("must_wait")))
        return None, metrics
    metrics.pop("refill_needed", None)
    return run_stage(rt, step, "batch", lambda: (table, metrics), schema="reward", n=rt.n)


@task(name="replay_split_batch", task_run_name="split_batch-step{step}", **_OPTS)
def split_batch(run_id: str, step: int, batch_uri: str, parts: int) -> list[str]:
    """Cut the sampled batch into `parts` equal slices of whole groups (`batch_p<i>`), each balanced."""
    rt = runtime.get(run_id)
    table = rt.store.read_uri(batch_uri)
    if table.num_rows % (parts * rt.n):
        raise ValueError(
            f"step {step}: batch of {table.num_rows // rt.n} groups does not split into "
            f"trainer.parameter_sync_step={parts} equal parts; choose a divisor of data.train_batch_size"
        )
    uris = []
    for i, part in enumerate(B.chunk(table, parts)):
        if bool(rt.cfg.trainer.balance_batch):
            part = B.balance_batch(part, dp_size=int(rt.extras.get("dp_size", 1)))
        uris.append(
            run_stage(rt, step, f"batch_p{i}", lambda part=part: (part, {}), schema="reward", n=rt.n)[0]
        )
    return uris


@task(name="replay_join_parts", task_run_name="join_parts-step{step}", **_OPTS)
def join_parts(run_id: str, step: int, uris: list[str]) -> str:
    """The step's `advantage` table: the parts' advantage tables concatenated (for step metrics)."""
    rt = runtime.get(run_id)
    return run_stage(rt, step, "advantage", lambda: (B.concat([rt.store.read_uri(u) for u in uris]), {}))[0]
