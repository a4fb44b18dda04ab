"""How a stage fails on purpose or by accident: the `DAPO_FAULT` test switch (`injected_fault`) and the
one-paragraph `WorkerDied` error for a worker process that died mid-stage.
"""

from __future__ import annotations

import os
from fnmatch import fnmatch

from dapo_core.errors import DapoUserError
from tasks.runtime import Runtime


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
