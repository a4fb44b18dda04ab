"""The commit discipline shared by every stage task (skip if committed, else compute → validate → commit), and
the small table helpers the rollout-side tasks of both step orders share.

Three ways to commit a stage, all skipped when the stage is committed already:

- `worker_stage`: a worker reads its input from the run store by URI, computes, validates and commits the
  output itself (`dapo_core.store.jobs.StageJob`); only the URI and the metrics come back to the driver.
- `select_stage`: a stage whose rows are a selection of earlier stages' rows (dynamic-sampling filter, the
  assembled batch) is committed as row ids only, from the few columns the decision needs (memory-mapped).
- `run_stage`: the driver computes the table (prompts it drew, update markers, validation) and commits it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect.cache_policies import NO_CACHE

from dapo_core.compute.workers.rollout import generation_metrics as rollout_generation_metrics
from dapo_core.data import batch as B
from dapo_core.data.schemas import validate_stage
from dapo_core.errors import DapoUserError, find_user_error
from dapo_core.store.jobs import StageJob
from tasks.runtime import Runtime

StageResult = tuple[str, dict[str, float]]
"""What a stage task returns: the committed table's URI and the stage's metrics."""
StageOutput = tuple[pa.Table, dict[str, float]]
"""What a stage computes: its table and metrics."""


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the stage tasks: retry a failure unless it is a `DapoUserError` (bad data, a
    full disk, a dead worker, dynamic sampling exhausted...), which the same attempt would only hit again; the
    user gets its paragraph at once instead of after the retries."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is None or find_user_error(exc) is None


STAGE_TASK_OPTS: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": 1,
    "retry_condition_fn": retry_unless_user_error,
    "cache_policy": NO_CACHE,
}
"""Options of the stage tasks: two retries (none for user errors), never cached (the run store caches)."""

# Generation-batch (`_g0`, `_ga`, `_gr1`) and local-update (`_p0`) suffixes: one timer name per stage kind.
_STAGE_SUFFIX = re.compile(r"_(?:g[a-z]?\d*|p\d+)$")


def run_stage(
    rt: Runtime,
    step: int,
    stage: str,
    compute: Callable[[], StageOutput],
    *,
    schema: str | None = None,
    n: int | None = None,
    meta: dict | None = None,
    base: str | list[str] | None = None,
) -> StageResult:
    """Return the committed output of (step, stage) if it exists, else compute, validate against `schema`,
    commit (as a column delta over `base`, the URIs of the stages it was computed from: only what the stage
    adds is written, `dapo_core.store.stage_files`).

    The run store is the single source of truth: a retried task, a retried flow run or a resumed run skips
    work whose manifest is already written. Timing goes into the metrics as `timing_s/<stage>`.
    """
    done = _committed_or_fault(rt, step, stage)
    if done is not None:
        return done
    t0 = time.perf_counter()
    try:
        table, metrics = compute()
    except Exception as exc:
        died = worker_died(exc, rt, step, stage)
        if died is not None:
            raise died from exc
        raise
    if schema is not None:
        validate_stage(
            schema,
            table,
            n=n,
            vocab_size=rt.vocab_size,
            max_prompt_length=rt.cfg.data.max_prompt_length,
            max_response_length=rt.cfg.data.max_response_length,
        )
    metrics = dict(metrics)
    metrics[f"timing_s/{_timer(stage)}"] = time.perf_counter() - t0
    uri = rt.store.write_stage(step, stage, table, meta={**(meta or {}), "metrics": metrics}, base=base)
    return uri, metrics


def _timer(stage: str) -> str:
    return _STAGE_SUFFIX.sub("", stage)


def worker_stage(
    rt: Runtime,
    step: int,
    stage: str,
    call: Callable[[StageJob], StageResult],
    *,
    input_uri: str,
    schema: str | None = None,
    n: int | None = None,
    meta: dict | None = None,
) -> StageResult:
    """Return the committed output of (step, stage) if it exists, else hand a `StageJob` (read `input_uri`,
    compute, validate against `schema`, commit as a delta over the input) to a worker through `call`, e.g.
    `lambda job: rt.reward.score_stage(job)`, and return what it committed. No table passes through here."""
    done = _committed_or_fault(rt, step, stage)
    if done is not None:
        return done
    job = stage_job(rt, step, stage, input_uri=input_uri, schema=schema, n=n, meta=meta)
    try:
        uri, metrics = call(job)
    except Exception as exc:
        died = worker_died(exc, rt, step, stage)
        if died is not None:
            raise died from exc
        raise
    return uri, dict(metrics)


def stage_job(
    rt: Runtime,
    step: int,
    stage: str,
    *,
    input_uri: str,
    schema: str | None = None,
    n: int | None = None,
    meta: dict | None = None,
) -> StageJob:
    """The `StageJob` of (step, stage) over `input_uri` with the run's validation limits (what `worker_stage`
    hands a worker; the replay order submits one without waiting)."""
    return StageJob(
        root=str(rt.store.root),
        step=step,
        stage=stage,
        input_uri=input_uri,
        timer=_timer(stage),
        schema=schema,
        n=n,
        vocab_size=rt.vocab_size,
        max_prompt_length=rt.cfg.data.max_prompt_length,
        max_response_length=rt.cfg.data.max_response_length,
        meta=dict(meta or {}),
    )


def _committed_or_fault(rt: Runtime, step: int, stage: str) -> StageResult | None:
    """The committed output of (step, stage), or None when it is to be computed now; raises the fault
    `DAPO_FAULT` injects there (tests of retry and resume), which only a stage not yet committed can hit."""
    done = committed(rt, step, stage)
    if done is not None:
        return done
    fault = injected_fault(stage, step, rt.run_id)
    if fault is not None:
        raise InjectedFault(fault)
    return None


def select_stage(
    rt: Runtime,
    step: int,
    stage: str,
    base: list[str],
    compute: Callable[[], tuple[np.ndarray, dict[str, float]]],
) -> StageResult:
    """Return the committed output of (step, stage) if it exists, else commit the rows `compute()` selects
    (positions in the concatenated views of `base`, in order) as row ids only (`RunStore.write_selection`).

    The selected rows were validated when their stages were committed; what a selection can break is the
    group structure, so every uid must keep all `n` of its rows."""
    done = _committed_or_fault(rt, step, stage)
    if done is not None:
        return done
    t0 = time.perf_counter()
    positions, metrics = compute()
    metrics = {**metrics, f"timing_s/{_timer(stage)}": time.perf_counter() - t0}
    uri = rt.store.write_selection(step, stage, positions, base=base, meta={"metrics": metrics})
    return uri, metrics


def lengths_of(rt: Runtime, uris: list[str]) -> pa.Table:
    """`uid`, `sample_idx`, `prompt_ids` and `response_ids` lengths of the concatenated views at `uris` (list
    offsets only, memory-mapped: no token is read)."""
    return pa.concat_tables([rt.store.read_lengths(u, ["prompt_ids", "response_ids"]) for u in uris])


def check_whole_groups(table: pa.Table, n: int, where: str) -> None:
    """Raise when a uid of `table` (a selection) does not have exactly `n` rows."""
    counts = pc.value_counts(table.column("uid"))
    bad = [c["values"] for c in counts.to_pylist() if c["counts"] != n]
    if bad:
        raise ValueError(f"{where}: groups {bad[:5]} do not have n={n} rows after selection")


class WorkerDied(DapoUserError, RuntimeError):
    """A worker process (Ray actor) died in the middle of a stage: killed, out of memory, or crashed."""


def worker_died(exc: BaseException, rt: Runtime, step: int, stage: str) -> WorkerDied | None:
    """A `WorkerDied` paragraph (what died, where, how to resume) when `exc` is or wraps Ray's actor-died
    error, else None. What the stages committed before stays; a resume starts new workers."""
    from ray.exceptions import RayActorError

    cur: BaseException | None = exc
    for _ in range(10):
        if cur is None or isinstance(cur, RayActorError):
            break
        cur = cur.__cause__ or cur.__context__
    if not isinstance(cur, RayActorError):
        return None
    first = (str(cur).strip().splitlines() or [type(cur).__name__])[0][:200]
    try:
        last = rt.store.checkpoints.latest_step()
    except ValueError:
        last = None
    since = f"checkpoint step {last}" if last is not None else "the start (no checkpoint yet)"
    return WorkerDied(
        f"a worker process of run {rt.run_id} died during stage {stage!r} of step {step} (killed, out of "
        f"memory, or crashed: {first}); the stages committed before it are kept",
        fix=(
            f"find what stopped it (memory, a kill), then resume with the same command and "
            f"trainer.experiment_name={rt.run_id}: new workers start from {since} and committed stages are "
            f"replayed"
        ),
    )


class InjectedFault(RuntimeError):
    """The failure `DAPO_FAULT` asked for (tests of retry and resume)."""


def injected_fault(stage: str, step: int, run_id: str) -> str | None:
    """The message of the fault `DAPO_FAULT=<stage>:<step>[:<run_id pattern>]` injects into (stage, step), or
    None.

    A test switch, off and inert unless the variable is set: the stage of that step (and of the runs whose id
    matches the shell-style pattern, if given) fails before computing, on the first attempt of the Prefect
    flow run only (`flow_run.run_count <= 1`), so a Retry of the flow run in the UI continues past it. Stage
    names are the run store's (`update_actor`, `generate_g0`, ...)."""
    spec = os.environ.get("DAPO_FAULT", "")
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise ValueError(
            f"DAPO_FAULT={spec!r}: expected <stage>:<step>[:<run_id pattern>], e.g. update_actor:2 or "
            "update_actor:2:nightly-* — or unset it"
        )
    if parts[0] != stage or int(parts[1]) != step or (len(parts) == 3 and not fnmatch(run_id, parts[2])):
        return None
    from prefect.runtime import flow_run

    if flow_run.run_count > 1:
        return None
    return f"DAPO_FAULT={spec}: injected failure of stage {stage} at step {step} of run {run_id}"


def precomputed(table: pa.Table, metrics: dict[str, float] | None = None) -> Callable[[], StageOutput]:
    """A `run_stage` compute function for a table that is already computed (committed as it is)."""
    return lambda: (table, metrics or {})


def committed(rt: Runtime, step: int, stage: str) -> StageResult | None:
    """The URI and metrics of (step, stage) if it is committed, else None."""
    if not rt.store.is_committed(step, stage):
        return None
    meta = rt.store.meta(step, stage) or {}
    return rt.store.stage_uri(step, stage), dict(meta.get("metrics", {}))


def stage_name(stage: str, part: int | None) -> str:
    """Run-store stage name: `stage`, or `stage_p<part>` for a local update's part (replay-buffer order)."""
    return stage if part is None else f"{stage}_p{part}"


def run_name(stage: str) -> Callable[[], str]:
    """A Prefect `task_run_name` callable: `<stage>-step<step>[-p<part>]` (the UI shows a step's timeline)."""

    def name() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters
        part = params.get("part")
        return f"{stage}-step{params.get('step')}" + ("" if part is None else f"-p{part}")

    return name


def filter_metric(rt: Runtime) -> str:
    """`algorithm.filter_groups.metric` (the config checks require it whenever dynamic sampling is on)."""
    metric = rt.cfg.algorithm.filter_groups.metric
    if metric is None:
        raise ValueError("algorithm.filter_groups.metric: required with filter_groups.enable — use acc")
    return metric


def balanced_order(rt: Runtime, lengths: pa.Table) -> np.ndarray:
    """The row order for equal per-rank token loads (`B.balance_order`, one training process) of a batch with
    these `prompt_ids`/`response_ids` lengths (`lengths_of`); the identity unless `trainer.balance_batch`."""
    if not rt.cfg.trainer.balance_batch:
        return np.arange(lengths.num_rows, dtype=np.int64)
    seqlens = lengths.column("prompt_ids").to_numpy().astype(np.int64) + lengths.column(
        "response_ids"
    ).to_numpy().astype(np.int64)
    return B.balance_order(seqlens, dp_size=1)


def uids_of(table: pa.Table) -> list[str]:
    """The group uids of `table`, in order of first appearance."""
    return list(dict.fromkeys(table.column("uid").to_pylist()))


def rows_of(table: pa.Table, uids: list[str]) -> pa.Table:
    """The rows of `table` whose uid is in `uids` (table order)."""
    return table.filter(pc.is_in(table.column("uid"), value_set=pa.array(uids, pa.string())))


def to_ipc(table: pa.Table) -> bytes:
    """`table` as Arrow IPC stream bytes (a ledger payload)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    """The table `to_ipc` wrote."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def generation_metrics(out: pa.Table) -> dict[str, float]:
    """Mean response length and generated tokens of a generation batch (the rollout worker's function)."""
    return rollout_generation_metrics(out)
