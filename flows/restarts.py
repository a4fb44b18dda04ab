"""Automatic restarts of a training run after a worker died or hung (`trainer.max_restarts`).

A step that fails because a worker process died (`tasks.faults.WorkerDied`: killed, out of memory, crashed)
or made no progress for `trainer.stage_timeout_s` (`StageHung`) is not the end of the run while the budget
allows: the run's workers are killed and new ones started (`flows.run_setup.restart_workers`, waiting up to
`trainer.restart_wait_s` for room), then `restore` resumes from the latest checkpoint and the committed
stages, exactly as a new attempt of the run would, and the step loop goes on. `RestartBudget` allows at most
`trainer.max_restarts` restarts within any `trainer.restart_window_s` seconds; once it is spent, the fault's
paragraph ends the run, naming each earlier restart's stage and step.

Each restart is one log paragraph, a line in the Prefect UI's summary artifact and the cumulative metric
`fault/restarts` in every later metrics row (`Restarts.metrics`, present when `max_restarts > 0`). Any other
error ends the run as before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo_core.compute.rpc import WorkerHung
from flows.artifacts import RunArtifacts
from flows.run_setup import DriverState, TrainRun, restart_workers, restore
from tasks.faults import StageHung, WorkerDied, WorkerFault, dead_peer, died_worker


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds (a sliding window over `clock`)."""

    def __init__(
        self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = int(max_restarts)
        self.window_s = float(window_s)
        self.clock = clock
        self._times: deque[float] = deque()
        self.total = 0
        """Restarts spent since this budget was made."""

    def in_window(self) -> int:
        """Restarts spent within the last `window_s` seconds."""
        now = self.clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        return len(self._times)

    def allows(self) -> bool:
        """Whether one more restart fits now."""
        return self.in_window() < self.max_restarts

    def spend(self) -> int:
        """Record a restart now; returns how many the window holds with it."""
        if not self.allows():
            raise RuntimeError(f"no restart left: {self.max_restarts} within {self.window_s:g}s spent")
        self._times.append(self.clock())
        self.total += 1
        return len(self._times)


def worker_fault(exc: BaseException, step: int) -> WorkerFault | None:
    """The worker fault inside `exc`: a stage's `WorkerDied` / `StageHung`, or Ray's actor-died error or a
    `WorkerHung` raised outside a stage (a weight push, a checkpoint save) as one of step `step`; else
    None."""
    from ray.exceptions import RayActorError

    cur: BaseException | None = exc
    for _ in range(12):
        if cur is None:
            return None
        if isinstance(cur, WorkerFault):
            return cur
        if isinstance(cur, WorkerHung):
            what = f"a worker hung in step {step} ({cur})"
            return StageHung(what, step=step, cause=str(cur))
        if isinstance(cur, RayActorError):
            first = died_worker(cur) + (str(cur).strip().splitlines() or [type(cur).__name__])[0][:200]
            return WorkerDied(f"a worker process died in step {step} ({first})", step=step, cause=first)
        cur = cur.__cause__ or cur.__context__
    return None


@dataclass(frozen=True)
class Restart:
    """One automatic restart: the fault that caused it and the checkpoint the run resumed from."""

    fault: WorkerFault
    number: int
    """1 for the run's first restart in this flow run."""
    resumed_from: int | None
    """The checkpoint step the new workers started from (None: the start)."""


class Restarts:
    """The run's restart policy and history, for one flow run (`dapo_train` holds one)."""

    def __init__(self, rt: TrainRun, ui: RunArtifacts, log: Any) -> None:
        tr = rt.cfg.trainer
        self.budget = RestartBudget(tr.max_restarts, tr.restart_window_s)
        self.ui = ui
        self.log = log
        self.history: list[Restart] = []

    def metrics(self) -> dict[str, float]:
        """`fault/restarts` (restarts so far) when restarts are on, else nothing."""
        return {"fault/restarts": float(len(self.history))} if self.budget.max_restarts > 0 else {}

    def recover(self, rt: TrainRun, step: int, exc: BaseException) -> DriverState:
        """After `exc` ended step `step`: restart the run's workers and return the state `restore` resumes
        from, as often as the budget allows (a fault during the restart counts too). Raises `exc` when it is
        not a worker fault, and the fault's paragraph with the restart history once the budget is spent."""
        if not (self.budget.allows() or self.history):
            raise exc  # no restarts at all: the run ends as without this module
        fault = worker_fault(exc, step)
        if fault is None and (peer := dead_peer(exc, rt.cluster)) is not None:
            fault = worker_fault(peer, step)  # e.g. a weight push that lost a dead rank's collective
        if fault is None:
            raise exc  # not a worker fault
        while True:
            if not self.budget.allows():
                raise self.spent(fault) from exc
            self.budget.spend()
            try:
                last = rt.store.checkpoints.latest_step()
            except ValueError:
                last = None
            restart = Restart(fault, len(self.history) + 1, last)
            self.history.append(restart)
            line = self.describe(restart)
            self.log.warning("%s", line)
            self.ui.restart(step, line)
            try:
                restart_workers(rt)
                return restore(rt)
            except Exception as again:
                fault = worker_fault(again, step)  # the new workers died or hung too: another restart
                if fault is None and (peer := dead_peer(again, rt.cluster)) is not None:
                    fault = worker_fault(peer, step)
                if fault is None:
                    raise

    def describe(self, r: Restart) -> str:
        """The log paragraph of restart `r`."""
        since = "the start (no checkpoint)" if r.resumed_from is None else f"checkpoint step {r.resumed_from}"
        return (
            f"restart {r.number} of {self.budget.max_restarts} (trainer.max_restarts within "
            f"{self.budget.window_s:g}s): a worker {r.fault.kind} at {r.fault.place} ({r.fault.cause}); "
            f"killing the run's workers, starting new ones and resuming from {since} with the committed "
            f"stages replayed"
        )

    def spent(self, fault: WorkerFault) -> WorkerFault:
        """`fault`'s paragraph, ending the run, with the stage and step of each restart before it."""
        earlier = "; ".join(f"{r.fault.kind} at {r.fault.place}" for r in self.history)
        return fault.retold(
            f"{fault.what.rstrip('.')}. The run had restarted {len(self.history)} time(s) by itself "
            f"(trainer.max_restarts={self.budget.max_restarts} within {self.budget.window_s:g}s), after a "
            f"worker {earlier}; no restart is left"
        )
