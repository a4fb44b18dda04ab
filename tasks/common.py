"""The commit discipline shared by every stage task: skip if committed, else compute → validate → commit."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pyarrow as pa

from dapo_core.data.schemas import validate_stage
from tasks.runtime import Runtime

StageResult = tuple[str, dict[str, float]]

# Generation-batch (`_g0`, `_ga`, `_gr1`) and local-update (`_p0`) suffixes: one timer name per stage kind.
_STAGE_SUFFIX = re.compile(r"_(?:g[a-z]?\d*|p\d+)$")


def run_stage(
    rt: Runtime,
    step: int,
    stage: str,
    compute: Callable[[], tuple[pa.Table, dict[str, float]]],
    *,
    schema: str | None = None,
    n: int | None = None,
    meta: dict | None = None,
) -> StageResult:
    """Return the committed output of (step, stage) if it exists, else compute, validate against `schema`, commit.

    The run store is the single source of truth: a retried task, a retried flow run or a resumed run skips work
    whose manifest is already written. Timing goes into the metrics as `timing_s/<stage>`.
    """
    if rt.store.is_committed(step, stage):
        m = rt.store.meta(step, stage) or {}
        return rt.store.stage_uri(step, stage), dict(m.get("metrics", {}))
    t0 = time.perf_counter()
    table, metrics = compute()
    if schema is not None:
        cfg = rt.cfg
        validate_stage(
            schema,
            table,
            n=n,
            vocab_size=rt.vocab_size,
            max_prompt_length=int(cfg.data.max_prompt_length),
            max_response_length=int(cfg.data.max_response_length),
        )
    metrics = dict(metrics)
    metrics[f"timing_s/{_STAGE_SUFFIX.sub('', stage)}"] = time.perf_counter() - t0
    uri = rt.store.write_stage(step, stage, table, meta={**(meta or {}), "metrics": metrics})
    return uri, metrics


def stage_name(stage: str, part: int | None) -> str:
    """Run-store stage name: `stage`, or `stage_p<part>` for a local update's part (replay-buffer order)."""
    return stage if part is None else f"{stage}_p{part}"


def run_name(stage: str):
    """A Prefect `task_run_name` callable: `<stage>-step<step>[-p<part>]`, so the UI shows a step's timeline."""

    def name() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters
        part = params.get("part")
        return f"{stage}-step{params.get('step')}" + ("" if part is None else f"-p{part}")

    return name
