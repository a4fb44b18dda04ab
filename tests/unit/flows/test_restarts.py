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


def _node(node_id: str, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": resources}


def test_a_restart_waits_for_a_node_that_fits_and_says_what_it_waits_for(caplog):
    from dapo_core.compute.cluster import start_when_placed
    from dapo_core.compute.placement import check_feasible

    clock = Clock()
    cluster = [_node("head", CPU=3.0)]  # the node that offered train_node is gone
    tries: list[float] = []
    cleaned: list[int] = []

    def start(left_s: float) -> str:
        tries.append(left_s)
        check_feasible("reward", {"CPU": 1.0, "train_node": 1.0}, cluster)
        return "started"

    def sleep(s: float) -> None:
        clock.now += s
        if clock.now >= 1030:  # a node offering it joins after 30 s
            cluster[:] = [_node("head", CPU=3.0), _node("third", CPU=2.0, train_node=1.0)]

    caplog.set_level("WARNING")
    out = start_when_placed(
        start,
        90,
        what="the restart of run r",
        nodes=lambda: list(cluster),
        clean_up=lambda: cleaned.append(1),
        clock=clock,
        sleep=sleep,
    )
    assert out == "started" and tries == [90, 60] and cleaned == [1]
    [said] = [r.getMessage() for r in caplog.records]  # one paragraph, not one per poll
    assert said.startswith("the restart of run r waits up to 90s more (trainer.restart_wait_s) for capacity")
    assert "worker 'reward' asks for CPU=1, train_node=1" in said and "no node of the cluster offers" in said


def test_a_restart_that_finds_no_room_in_time_ends_with_one_paragraph():
    from dapo_core.compute.cluster import start_when_placed
    from dapo_core.compute.placement import PlacementError, check_feasible

    clock = Clock()

    def sleep(s: float) -> None:
        clock.now += s

    def start(left_s: float) -> None:
        check_feasible("reward", {"CPU": 1.0, "train_node": 1.0}, [_node("head", CPU=3.0)])

    with pytest.raises(PlacementError) as err:
        start_when_placed(start, 20, what="the restart of run r", nodes=list, clock=clock, sleep=sleep)
    text = str(err.value)
    assert clock.now == 1020
    assert text.startswith(
        "the restart of run r found no room for its workers within trainer.restart_wait_s=20s"
    )
    assert "worker 'reward' asks for CPU=1, train_node=1" in text and "the run ends here" in text
    assert "resume with the same command and run id" in text


def test_a_ranks_error_while_a_peer_of_the_run_is_dead_is_that_peers_death():
    from ray.exceptions import RayTaskError

    from tasks.faults import dead_peer, worker_died

    message = "The actor died unexpectedly.\n\tpid: 77\n\tname: dapo/r/actor/1\n\tnamespace: dapo"
    peer = ActorDiedError()
    peer.error_msg = message  # what str() shows
    gloo = RayTaskError("call", "trace", RuntimeError("gloo: Connection reset by peer"))
    cluster = SimpleNamespace(dead_workers=lambda: [peer])
    checkpoints = SimpleNamespace(latest_step=lambda: 1)
    rt = SimpleNamespace(run_id="r", cluster=cluster, store=SimpleNamespace(checkpoints=checkpoints))
    assert dead_peer(gloo, cluster) is peer  # type: ignore[arg-type]
    assert dead_peer(ValueError("bad data"), cluster) is None  # type: ignore[arg-type]  # not a worker's
    fault = worker_died(gloo, rt, 2, "update_actor")  # type: ignore[arg-type]
    assert isinstance(fault, WorkerDied) and fault.place == "stage 'update_actor' of step 2"
    assert fault.cause.startswith("worker 'actor/1', pid 77: ")
    alive = SimpleNamespace(dead_workers=list)
    assert dead_peer(gloo, alive) is None  # type: ignore[arg-type]  # a real error of the rank itself
