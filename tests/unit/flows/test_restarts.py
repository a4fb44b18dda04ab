"""The restart budget's sliding window, which errors count as worker faults, and the paragraphs a restart and
a spent budget write."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from dapo_core.compute.rpc import WorkerHung
from flows.restarts import Restart, RestartBudget, Restarts, worker_fault
from tasks.faults import StageHung, WorkerDied, died_worker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_budget_counts_restarts_in_a_sliding_window():
    clock = Clock()
    budget = RestartBudget(2, window_s=60, clock=clock)
    assert budget.allows() and budget.in_window() == 0
    budget.spend()
    clock.now += 30
    budget.spend()
    assert not budget.allows() and budget.in_window() == 2
    with pytest.raises(RuntimeError, match="no restart left"):
        budget.spend()
    clock.now += 29.9  # the first restart is 59.9 s old: still in the window
    assert not budget.allows()
    clock.now += 0.1  # now 60 s old: out of it
    assert budget.allows() and budget.in_window() == 1
    budget.spend()
    assert budget.total == 3 and budget.in_window() == 2


def test_no_restarts_allowed_with_max_restarts_zero():
    assert not RestartBudget(0, window_s=3600).allows()


def test_worker_faults_are_found_through_wrappers_and_other_errors_are_not():
    died = WorkerDied("a worker process of run r died", stage="reward_g0", step=3, cause="killed")
    try:
        try:
            raise died
        except WorkerDied as inner:
            raise RuntimeError("task failed") from inner
    except RuntimeError as outer:
        wrapped = outer
    assert worker_fault(wrapped, 3) is died
    hung = worker_fault(WorkerHung("rollout", "push_from", 5.0), 2)
    assert isinstance(hung, StageHung) and hung.step == 2 and "push_from" in hung.cause
    dead = worker_fault(ActorDiedError(), 4)
    assert isinstance(dead, WorkerDied) and dead.place == "step 4"
    assert worker_fault(ValueError("bad data"), 1) is None


def _restarts(max_restarts: int) -> Restarts:
    trainer = SimpleNamespace(max_restarts=max_restarts, restart_window_s=3600.0)
    rt = SimpleNamespace(cfg=SimpleNamespace(trainer=trainer))
    return Restarts(rt, ui=None, log=None)  # type: ignore[arg-type]


def test_a_spent_budget_names_the_stage_and_step_of_every_restart():
    restarts = _restarts(2)
    hung = StageHung("x", stage="generate_g0", step=1, cause="no result within 5s")
    died = WorkerDied("y", stage="reward_g0", step=1, cause="killed")
    restarts.history = [Restart(hung, 1, None), Restart(died, 2, None)]
    last = WorkerDied(
        "a worker process of run r died during stage 'reward_g0' of step 1",
        stage="reward_g0",
        step=1,
        fix="f",
    )
    err = restarts.spent(last)
    assert isinstance(err, WorkerDied) and err.fix == "f"
    text = str(err)
    assert "restarted 2 time(s)" in text and "trainer.max_restarts=2" in text
    assert "hung at stage 'generate_g0' of step 1; died at stage 'reward_g0' of step 1" in text
    line = restarts.describe(Restart(died, 2, 4))
    assert line.startswith("restart 2 of 2") and "resuming from checkpoint step 4" in line
    assert restarts.metrics() == {"fault/restarts": 2.0}
    assert _restarts(0).metrics() == {}


def test_the_dead_worker_is_named_from_rays_message():
    message = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: _RankHost\n\tactor_id: 1f\n"
        "\tpid: 941\n\tname: dapo/run-1/actor/1\n\tnamespace: dapo\n\tip: 127.0.0.1"
    )
    assert died_worker(RuntimeError(message)) == "worker 'actor/1', pid 941: "
    assert died_worker(RuntimeError("The actor died unexpectedly before finishing this task.")) == ""
