"""How a stage fails on purpose or by accident: the `DAPO_FAULT` test switch's driver side (`injected_fault`;
the grammar and the worker side are `dapo_core.compute.faults`) and the one-paragraph `WorkerFault`s, a
worker process that died (`WorkerDied`) or stopped making progress (`StageHung`) mid-stage.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dapo_core.compute.faults import FAULT_ENV, faults_from_env
from dapo_core.compute.rpc import WorkerHung
from dapo_core.errors import DapoUserError
from tasks.runtime import Runtime

if TYPE_CHECKING:
    from dapo_core.compute.cluster import Cluster


class WorkerFault(DapoUserError, RuntimeError):
    """A worker process failed the run mid-stage (it died, or it hung); `stage` and `step` say where (empty
    and 0 outside a stage), `cause` is what was seen (which worker, when known, and the first line)."""

    kind = "failed"
    """How it failed, in the log's words ("died", "hung")."""

    def __init__(
        self, what: str = "", *args: object, stage: str = "", step: int = 0, cause: str = "", **kw: str
    ) -> None:
        super().__init__(what, *args, **kw)
        self.stage = stage
        self.step = step
        self.cause = cause

    @property
    def place(self) -> str:
        """Where it happened: `stage 'generate_g0' of step 2` (or `step 2`)."""
        return f"stage {self.stage!r} of step {self.step}" if self.stage else f"step {self.step}"

    def retold(self, what: str) -> WorkerFault:
        """The same fault with `what` in place of its first part (the fix kept)."""
        return type(self)(
            what, stage=self.stage, step=self.step, cause=self.cause, where=self.where, fix=self.fix
        )


class WorkerDied(WorkerFault):
    """A worker process (Ray actor) died in the middle of a stage: killed, out of memory, or crashed."""

    kind = "died"


class StageHung(WorkerFault):
    """A worker made no progress on a stage for `trainer.stage_timeout_s` (a hung collective, a rank stuck in
    I/O): handled as a death."""

    kind = "hung"


def worker_died(exc: BaseException, rt: Runtime, step: int, stage: str) -> WorkerFault | None:
    """A `WorkerDied` (Ray's actor-died error, or a worker's error while another of the run's workers is
    dead: `dead_peer`) or `StageHung` (`WorkerHung`, a call past `trainer.stage_timeout_s`) paragraph — what
    failed, where, how to resume — when `exc` is or wraps one, else None (also when it wraps a `WorkerFault`
    already, which is raised as it is). What the stages committed before stays; a restart or a resume
    starts new workers."""
    from ray.exceptions import RayActorError

    cur: BaseException | None = exc
    for _ in range(10):
        if cur is None or isinstance(cur, (RayActorError, WorkerHung, WorkerFault)):
            break
        cur = cur.__cause__ or cur.__context__
    if isinstance(cur, WorkerFault):
        return None
    if not isinstance(cur, (RayActorError, WorkerHung)):
        cur = dead_peer(exc, rt.cluster)
        if cur is None:
            return None
    first = (str(cur).strip().splitlines() or [type(cur).__name__])[0][:200]
    if isinstance(cur, WorkerHung):
        cause = f"worker '{cur.role}' did not return from {cur.method} within {cur.timeout_s:g}s"
        what = (
            f"a worker process of run {rt.run_id} hung during stage {stage!r} of step {step} ({cause}, "
            f"trainer.stage_timeout_s); the stages committed before it are kept"
        )
        return StageHung(what, stage=stage, step=step, cause=cause, fix=_fix(rt, "what it waited for"))
    what = (
        f"a worker process of run {rt.run_id} died during stage {stage!r} of step {step} (killed, out of "
        f"memory, or crashed: {died_worker(cur)}{first}); the stages committed before it are kept"
    )
    fix = _fix(rt, "what stopped it (memory, a kill)")
    return WorkerDied(what, stage=stage, step=step, cause=died_worker(cur) + first, fix=fix)


def dead_peer(exc: BaseException, cluster: Cluster) -> BaseException | None:
    """When `exc` is an error a Ray worker raised (a rank whose collective lost its peer: gloo's "Connection
    reset by peer") and one of the run's workers is dead, that worker's actor-died error; else None."""
    from ray.exceptions import RayError

    cur: BaseException | None = exc
    for _ in range(10):
        if cur is None or isinstance(cur, RayError):
            break
        cur = cur.__cause__ or cur.__context__
    if not isinstance(cur, RayError):
        return None
    dead = cluster.dead_workers()
    return dead[0] if dead else None


_ACTOR_NAME = re.compile(r"^\s*name:\s*dapo/[^/\s]+/(\S+)\s*$", re.M)
_ACTOR_PID = re.compile(r"^\s*pid:\s*(\d+)\s*$", re.M)


def died_worker(exc: BaseException) -> str:
    """`worker '<role>', pid <n>: ` from Ray's actor-died message when it names one of our actors (a group's
    rank as `<role>/<rank>`), else ""."""
    text = str(exc)
    name, pid = _ACTOR_NAME.search(text), _ACTOR_PID.search(text)
    if name is None:
        return ""
    return f"worker '{name.group(1)}'" + (f", pid {pid.group(1)}" if pid else "") + ": "


def _fix(rt: Runtime, find: str) -> str:
    try:
        last = rt.store.checkpoints.latest_step()
    except ValueError:
        last = None
    since = f"checkpoint step {last}" if last is not None else "the start (no checkpoint yet)"
    return (
        f"find {find}, then resume with the same command and trainer.experiment_name={rt.run_id}: new "
        f"workers start from {since} and committed stages are replayed"
    )


class InjectedFault(RuntimeError):
    """The failure `DAPO_FAULT` asked for (tests of retry and resume)."""


def injected_fault(stage: str, step: int, run_id: str) -> str | None:
    """The message of the `fail` fault `DAPO_FAULT` injects into (stage, step) of run `run_id`, or None.

    A test switch, off and inert unless the variable is set (grammar: `dapo_core.compute.faults`, e.g.
    `update_actor:2` or `update_actor:2:nightly-*`): the stage fails before computing, on the first attempt
    of the Prefect flow run only (`flow_run.run_count <= 1`), so a Retry of the flow run in the UI continues
    past it. The worker actions (`kill@...`, `hang@...`) act in the worker (`fault_point`), not here."""
    faults = [f for f in faults_from_env() if not f.in_worker and f.matches(stage, step, run_id)]
    if not faults:
        return None
    from prefect.runtime import flow_run

    if flow_run.run_count > 1:
        return None
    return f"{FAULT_ENV}={faults[0]}: injected failure of stage {stage} at step {step} of run {run_id}"
