"""Workers as named Ray actors and in-process objects behind one interface."""

from __future__ import annotations

import functools

import pytest

from dapo_core.compute.cluster import Cluster, actor_name, chain, proxy, submit


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
        assert chain(a.weights, r.sync_weights) == 8  # worker to worker
        assert r.add(0) == 8
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
