"""Workers as named Ray actors and in-process objects behind one interface."""

from __future__ import annotations

import functools

import pytest

from dapo_core.compute.cluster import Cluster, WorkerSpec, actor_name
from dapo_core.compute.host import QUIET_WORKER_ENV
from dapo_core.compute.placement import PlacementError, check_feasible, checked_resources
from dapo_core.compute.rpc import proxy, submit


class Counter:
    def __init__(self, start: int = 0):
        self.value = start
        self.closed = False

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def weights(self) -> dict:
        return {"w": self.value}

    def sync_weights(self, named) -> int:
        self.value = named["w"]
        return self.value

    def close(self) -> None:
        self.closed = True

    def weight_version(self) -> int:  # what a rollout replica reports when it joins
        return 0


@pytest.mark.parametrize("use_ray", [False, True])
def test_workers_are_created_called_synced_and_shut_down(use_ray, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    cluster = Cluster("t1", use_ray=use_ray, num_cpus=4)
    try:
        a = proxy(cluster.create("actor", functools.partial(Counter, 5)), Counter)
        r = proxy(cluster.create("rollout", Counter), Counter)
        assert a.add(2) == 7
        # found by run id + role, from anywhere
        assert proxy(Cluster.lookup("t1", "actor"), Counter).add(1) == 8
        assert r.sync_weights(a.weights()) == 8
        assert r.add(0) == 8
        b, c = (
            proxy(h, Counter)
            for h in cluster.create_many(  # started together, handed back in order
                [
                    WorkerSpec("b", functools.partial(Counter, 1)),
                    WorkerSpec("c", functools.partial(Counter, 2)),
                ]
            )
        )
        assert (b.add(0), c.add(0)) == (1, 2)
        future = submit(a.add, 1)
        assert future.result() == 9
        with pytest.raises(AttributeError, match="has no method 'ad'"):
            a.ad(1)  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match="method of a worker proxy"):
            submit(Counter().add, 1)
        if use_ray:
            assert ray.get_actor(actor_name("t1", "actor"), namespace="dapo") is not None
    finally:
        cluster.shutdown()
    if use_ray:
        assert not ray.is_initialized()  # we started it, so we stopped it
    with pytest.raises((RuntimeError, ValueError)):
        Cluster.lookup("t1", "actor")


def test_a_worker_whose_constructor_fails_reports_the_error():
    cluster = Cluster("t2", use_ray=True, num_cpus=2)
    try:
        with pytest.raises(Exception, match="boom"):
            cluster.create("actor", functools.partial(_explode))
    finally:
        cluster.shutdown()


def _explode():
    raise ValueError("boom")


def test_placement_values_are_checked_with_the_key_and_the_fix():
    assert checked_resources("rollout", {"gen_node": 1}) == {"gen_node": 1.0}
    assert checked_resources("actor", None) == {}
    for bad, why in (
        ({"gen_node": 0}, "not > 0"),
        ({"gen_node": "x"}, "not a number"),
        ({"gen_node": 1.5}, "not a whole number"),
        ({"GPU": 1}, "built-in Ray resource"),
    ):
        with pytest.raises(PlacementError, match=why) as err:
            checked_resources("rollout", bad)
        assert "trainer.ray_resources.rollout" in str(err.value) and "Fix:" in str(err.value)


def test_a_placement_no_node_offers_is_refused_at_once_naming_the_key():
    nodes = [
        {"Alive": True, "NodeID": "ab" * 28, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0}}
    ]
    check_feasible("reward", {"CPU": 1.0}, nodes)  # fits
    with pytest.raises(PlacementError) as err:
        check_feasible("rollout", {"CPU": 1.0, "gen_node": 1.0}, nodes)
    text = str(err.value)
    assert "trainer.ray_resources.rollout" in text and "'gen_node'" in text and "10.0.0.1" in text
    assert "--resources" in text  # the fix: start a node that offers it
    nodes.append({"Alive": True, "NodeID": "cd" * 28, "Resources": {"CPU": 0.0, "gen_node": 1.0}})
    with pytest.raises(PlacementError, match="no single node"):  # the resource exists, but not with a CPU
        check_feasible("rollout", {"CPU": 1.0, "gen_node": 1.0}, nodes)
    nodes[1]["Resources"]["CPU"] = 1.0
    check_feasible("rollout", {"CPU": 1.0, "gen_node": 1.0}, nodes)


def test_real_ray_refuses_an_unsatisfiable_worker_quickly_and_workers_are_quiet(monkeypatch):
    """A local Ray has no custom resources: asking for one fails in seconds (not after start_timeout_s);
    a created worker records its node and runs with the quiet settings unless DAPO_WORKER_LOGS=1."""
    import time

    import ray

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    for key in QUIET_WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    cluster = Cluster("t3", use_ray=True, num_cpus=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(PlacementError, match=r"trainer\.ray_resources\.rollout"):
            cluster.create("rollout", Counter, resources={"gen_node": 1})
        assert time.monotonic() - t0 < 30
        quiet = proxy(cluster.create("actor", _EnvProbe), _EnvProbe)
        assert quiet.env("TQDM_DISABLE") == "1" and quiet.env("TRANSFORMERS_VERBOSITY") == "error"
        assert cluster.placement["actor"]["node_id"] == ray.get_runtime_context().get_node_id()
        monkeypatch.setenv("DAPO_WORKER_LOGS", "1")
        loud = proxy(cluster.create("reward", _EnvProbe), _EnvProbe)
        assert loud.env("TQDM_DISABLE") is None
    finally:
        cluster.shutdown()


class _EnvProbe:
    def env(self, key: str) -> str | None:
        import os

        return os.environ.get(key)


def test_replicas_left_by_a_crashed_driver_make_room_and_a_cluster_too_small_is_refused(monkeypatch):
    """A resumed run's replicas replace the ones its dead driver left (their CPUs are freed while it waits),
    and more replicas than the cluster can ever hold are refused in one paragraph after the grace period."""
    from dapo_core.compute import replicas as R
    from dapo_core.errors import DapoUserError

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster("t4", use_ray=True, num_cpus=2)
    layout = R.ReplicaLayout(count=2, tensor_parallel=1, num_gpus=0.0, engine_opts={})
    try:
        R.create_replicas(cluster, lambda threads, devices: Counter, layout, max_new_tokens=4)
        # the same run again, its first replicas still alive and holding both CPUs: they are replaced
        again = R.create_replicas(cluster, lambda threads, devices: Counter, layout, max_new_tokens=4)
        assert len(again.workers_info()) == 2
        monkeypatch.setattr(R, "LEFTOVER_GRACE_S", 2.0)
        three = R.ReplicaLayout(count=3, tensor_parallel=1, num_gpus=0.0, engine_opts={})
        with pytest.raises(DapoUserError, match=r"3 rollout replicas need CPU=3.*trainer\.n_gpus_per_node"):
            R.create_replicas(cluster, lambda threads, devices: Counter, three, max_new_tokens=4)
    finally:
        cluster.shutdown()


JOINED_DRIVER = """
import os, signal, sys, threading, time
from dapo_core.compute.cluster import Cluster
from dapo_core.errors import StopRequested

class Sleeper:
    def nap(self, s):
        time.sleep(s)
        return s

cluster = Cluster("joined", address=sys.argv[1])
try:
    handle = cluster.create("sleeper", Sleeper)
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    try:
        handle.wait(handle.submit("nap", 60))
    except StopRequested:
        print(f"stopped after {time.monotonic() - t0:.1f} s")
finally:
    cluster.shutdown()
"""


@pytest.mark.timeout(300)
def test_a_driver_that_joined_a_cluster_stops_at_sigterm_with_stop_requested(tmp_path):
    """`ray.init(address=...)` installs a SIGTERM handler that calls `sys.exit` wherever the driver is; the
    Cluster replaces it when joining as when starting Ray, so a stop signal ends the wait on a worker with
    `StopRequested` (the run then stops cleanly) instead of exiting mid-stage."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.integration.ray_nodes import node_env, ray_nodes, start_head

    env = node_env()
    with ray_nodes("dapojoin-") as (tmp, nodes):
        address = start_head(tmp, nodes, env, num_cpus=1)
        script = tmp_path / "driver.py"
        script.write_text(JOINED_DRIVER)
        done = subprocess.run(
            [sys.executable, str(script), address],
            env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert done.returncode == 0 and "stopped after" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert float(done.stdout.split("stopped after ")[1].split()[0]) < 30  # at a poll, not after the nap
