"""The commit discipline shared by every stage task: skip if committed, else compute → validate → commit.

Three ways to commit a stage, all skipped when the stage is committed already:

- `worker_stage`: a worker reads its input from the run store by URI, computes, validates and commits the
  output itself (`dapo_core.store.jobs.StageJob`); only the URI and the metrics come back to the driver.
- `select_stage`: a stage whose rows are a selection of earlier stages' rows (dynamic-sampling filter, the
  assembled batch) is committed as row ids only, from the few columns the decision needs (memory-mapped).
- `run_stage`: the driver computes the table (prompts it drew, update markers, validation) and commits it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from prefect.cache_policies import NO_CACHE

from dapo_core.data.schemas import validate_stage
from dapo_core.errors import find_user_error
from dapo_core.store.jobs import StageJob
from tasks.faults import InjectedFault, injected_fault, worker_died
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
