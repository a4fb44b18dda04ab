"""Torch threads per worker process: `trainer.num_threads`, or (0) the cores shared among the workers that
compute at once; never the environment."""

import pytest

from dapo_core.compute.host import worker_threads
from dapo_core.errors import DapoUserError


def test_the_config_value_wins_whatever_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("DAPO_WORKER_THREADS", "5")
    assert worker_threads(1, 1, "cpu", cores=8) == 1
    assert worker_threads(3, 2, "cpu", cores=8) == 3


def test_zero_gives_the_busy_worker_every_core_in_sync_order() -> None:
    assert worker_threads(0, 1, "cpu", cores=8) == 8


def test_zero_splits_the_cores_between_generation_and_update_in_replay_order() -> None:
    assert worker_threads(0, 2, "cpu", cores=8) == 4
    assert worker_threads(0, 2, "cpu", cores=1) == 1


def test_gpu_workers_keep_one_thread() -> None:
    assert worker_threads(0, 1, "cuda", cores=64) == 1
    assert worker_threads(4, 1, "cuda", cores=64) == 1


def test_a_negative_value_names_the_key_and_the_fix() -> None:
    with pytest.raises(DapoUserError, match=r"trainer.num_threads=-1.*Fix: set it to 1"):
        worker_threads(-1, 1, "cpu", cores=2)


def test_zero_uses_this_process_affinity() -> None:
    import os

    assert worker_threads(0, 1, "cpu") == len(os.sched_getaffinity(0))
