"""Two Ray nodes on this machine: a head (`ray start --head`) and a second node (`ray start --address`), each
advertising one custom resource; a tiny training joins them through `RAY_ADDRESS` with
`trainer.ray_resources` placing the rollout worker on the head, and a data-parallel actor group (FSDP2 over
gloo, `trainer.nnodes=2`, one rank per node) spanning both nodes. The run is SIGKILLed after its first
checkpoint and resumed with the same run id on the same cluster. (Losing a node under a run:
`test_lost_node.py`.)

The nodes are `tests.integration.ray_nodes.RayNode`s: `ray start --block` processes in their own sessions,
temp dirs and free ports, stopped by killing exactly their sessions.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import kill_and_resume, tiny_overrides, train_cmd
from tests.integration.ray_nodes import RayNode, kill_sessions, node_env, ray_nodes, start_head

pytestmark = pytest.mark.slow

WORKER_LINE = re.compile(r"^(?:\x1b\[[0-9;]*m)?\(\S+ pid=\d+", re.M)
"""A line Ray forwarded from a worker process: `(_RayHost pid=123, ip=…)`, after colour codes if any."""

NICENESS = {"RAY_worker_niceness": "0"}
"""The nodes run their worker processes at the driver's priority, as `dapo train`'s local Ray does (Ray's
default, nice 15, starves them beside other work on a loaded machine)."""


@pytest.fixture
def two_nodes():
    """(RAY_ADDRESS, env) of a two-node cluster: the head offers `gen_node`, the second node `train_node`."""
    env = node_env(**NICENESS)
    with ray_nodes("dapo2n-") as (tmp, nodes):
        # room for the run's two rollout replicas (nnodes 2 x 1)
        address = start_head(tmp, nodes, env, '--resources={"gen_node": 2}')
        second = RayNode(
            tmp, "second", env, [f"--address={address}", "--num-cpus=2", '--resources={"train_node": 1}']
        )
        nodes.append(second)
        second.wait_started()
        yield address, env


def _placement(run: Path) -> dict[tuple[str, int], str]:
    """(role, rank) -> node id, from the run's workers.json."""
    workers = json.loads((run / "workers.json").read_text())["workers"]
    return {(w["role"], w["rank"]): w["node_id"] for w in workers}


@pytest.mark.timeout(900)
def test_rollout_on_its_node_and_an_actor_group_across_both_and_the_run_resumes(tiny_assets, two_nodes):
    address, env = two_nodes
    env = {**env, "RAY_ADDRESS": address}
    run = tiny_assets / "runs" / "two_nodes"
    overrides = tiny_overrides(
        tiny_assets,
        **{
            "trainer.experiment_name": "two_nodes",
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.enable": "false",
            "trainer.ray_resources.rollout": "{gen_node: 1}",
            "actor_rollout_ref.actor.strategy": "fsdp2",
            "trainer.nnodes": 2,
            "trainer.n_gpus_per_node": 1,
        },
    )
    placed: dict = {}

    def kill_driver_and_all(victim: subprocess.Popen) -> None:
        placed.update(_placement(run))  # where the first attempt's workers were
        kill_sessions([victim.pid], grace_s=0.0)
        victim.wait()

    def killed_after_checkpoint_1(run: Path) -> None:
        assert (run / "ckpt" / "latest").read_text().strip() == "1"
        first = placed
        assert first[("actor", 0)] != first[("actor", 1)], first  # the group spans both nodes
        # two replicas (nnodes x n_gpus_per_node = 2), both on the node that offers gen_node
        assert first[("rollout", 0)] == first[("rollout", 1)] in (first[("actor", 0)], first[("actor", 1)]), (
            first
        )

    # first attempt: killed (SIGKILL, driver and all) once step 2 has started, after checkpoint 1; second
    # attempt: the same run id resumes from checkpoint 1 on the same cluster and finishes
    done = kill_and_resume(
        train_cmd(overrides),
        run,
        "step_000002/generate_g0.manifest.json",
        env=env,
        kill=kill_driver_and_all,
        after_kill=killed_after_checkpoint_1,
    )
    first = placed
    second = _placement(run)
    assert second[("actor", 0)] != second[("actor", 1)], second
    # placed by resource, not by chance: the rollout is on the node that offers gen_node, both times
    assert second[("rollout", 0)] == second[("rollout", 1)] == first[("rollout", 0)]
    assert sorted(p.name for p in (run / "ckpt" / "step_2" / "actor").glob("model.rank*")) == [
        "model.rank0.safetensors",
        "model.rank1.safetensors",
    ]
    assert (run / "ckpt" / "latest").read_text().strip() == "2"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # workers on both nodes were quiet (DAPO_WORKER_LOGS unset): no line forwarded from a worker process
    assert not WORKER_LINE.search(done.stdout + done.stderr), done.stderr[-3000:]
