"""What a flow run shows of itself: task runs of attempts that died end Crashed; a quiet console.

A flow-run process killed mid-task (kill -9, a lost host) leaves the task runs it was running Running;
nobody reports their end. When a later attempt of the same training run starts (a Retry of the flow run, or a
new flow run with the same run id), `crash_orphaned_task_runs` marks those task runs Crashed with a message
naming the attempt that continues the run. It runs after the run store is opened (no other live process runs
this run then) and before the attempt starts a task. The flow runs that worked on a run are listed in
`runs/<run_id>/flow_runs.json`. A failure to reach the API is a warning: this is a view, never the run.
`quiet_task_run_console`: the flow-run process that `dapo deploy`'s runner starts shows what the CLI shows (no
line per finished task run; the UI keeps them).
"""

from __future__ import annotations

import logging
from datetime import datetime
from uuid import UUID

from dapo_core.store import RunStore

LOUD_ENVS = ("DAPO_WORKER_LOGS", "DAPO_TASK_LOGS")
"""Either set to 1: task-run log lines stay on the console."""

FLOW_RUNS_FILE = "flow_runs.json"
"""Run-store file listing the Prefect flow run ids that worked on the run (oldest first)."""


def crash_orphaned_task_runs(store: RunStore) -> int:
    """Mark Crashed every task run left Running or Pending by an earlier attempt of this run (earlier attempts
    of this flow run, and earlier flow runs recorded in `flow_runs.json`), and record this flow run there.
    Returns how many were marked (0 outside a flow run)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return 0
    me = ctx.flow_run
    earlier = [UUID(i) for i in store.read_json(FLOW_RUNS_FILE, default=[]) if i != str(me.id)]
    store.write_json(FLOW_RUNS_FILE, [*map(str, earlier), str(me.id)])
    if me.run_count <= 1 and not earlier:
        return 0
    note = (
        f"the process running it died; flow run '{me.name}' (attempt {me.run_count}, started "
        f"{datetime.now():%Y-%m-%d %H:%M:%S}) continues the run"
    )
    try:
        return _crash(me.id, earlier, note)
    except Exception as exc:
        logging.getLogger("dapo.ui_state").warning("could not mark orphaned task runs Crashed: %r", exc)
        return 0


def _crash(current: UUID, earlier: list[UUID], note: str) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterFlowRunId,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        started = client.read_flow_run(current).state  # this attempt's Running state
        since = started.timestamp if started is not None else None
        orphans = client.read_task_runs(
            task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[current, *earlier]),
                state=TaskRunFilterState(
                    type=TaskRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])
                ),
            )
        )
        n = 0
        for tr in orphans:
            stamp = tr.state.timestamp if tr.state is not None else None
            if tr.flow_run_id == current and since is not None and stamp is not None and stamp >= since:
                continue  # this attempt's own (none yet when called before the first task)
            client.set_task_run_state(tr.id, Crashed(message=note), force=True)
            n += 1
    return n


class _TaskRunInfoFilter(logging.Filter):
    """Drops task-run records below WARNING (Prefect's "Finished in state Completed()" line per task run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("prefect.task_runs")


def quiet_task_run_console() -> None:
    """Keep task runs' info lines off the console handlers of this process (the root logger's, which
    Prefect's `prefect.task_runs` records reach); they still reach the API, so the UI's task-run logs keep
    them. Warnings and errors stay. `DAPO_WORKER_LOGS=1` or `DAPO_TASK_LOGS=1` leaves the console as is."""
    import os

    if any(os.environ.get(v) == "1" for v in LOUD_ENVS):
        return
    import prefect.main  # noqa: F401  (configures Prefect's logging: the console handler exists afterwards)

    for h in logging.getLogger().handlers:
        is_console = isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        if is_console and not any(isinstance(f, _TaskRunInfoFilter) for f in h.filters):
            h.addFilter(_TaskRunInfoFilter())
