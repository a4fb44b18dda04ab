"""Torch threads per worker process: the cores shared among the workers that compute at once."""

import pytest

from dapo_core.compute.cluster import worker_threads
from dapo_core.errors import DapoUserError


def test_sync_order_gives_the_busy_worker_every_core() -> None:
    assert worker_threads(1, "cpu", environ={}, cores=8) == 8


def test_replay_order_splits_the_cores_between_generation_and_update() -> None:
    assert worker_threads(2, "cpu", environ={}, cores=8) == 4
    assert worker_threads(2, "cpu", environ={}, cores=1) == 1


def test_omp_num_threads_caps_the_share() -> None:
    assert worker_threads(1, "cpu", environ={"OMP_NUM_THREADS": "2"}, cores=8) == 2
    assert worker_threads(2, "cpu", environ={"OMP_NUM_THREADS": "16"}, cores=8) == 4


def test_env_override_wins_and_gpu_workers_keep_one_thread() -> None:
    assert (
        worker_threads(1, "cpu", environ={"DAPO_WORKER_THREADS": "3", "OMP_NUM_THREADS": "1"}, cores=8) == 3
    )
    assert worker_threads(1, "cuda", environ={}, cores=64) == 1


def test_bad_override_names_the_variable_and_the_fix() -> None:
    with pytest.raises(DapoUserError, match=r"DAPO_WORKER_THREADS='two'.*Fix: set DAPO_WORKER_THREADS"):
        worker_threads(1, "cpu", environ={"DAPO_WORKER_THREADS": "two"}, cores=2)


def test_default_uses_this_process_affinity() -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    assert worker_threads(1, "cpu", environ={}) == cores
