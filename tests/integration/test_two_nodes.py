"""Two Ray nodes on this machine: a head (`ray start --head`) and a second node (`ray start --address`), each
advertising one custom resource; a tiny training joins them through `RAY_ADDRESS` with
`trainer.ray_resources` placing the rollout worker on the head, and a data-parallel actor group (FSDP2 over
gloo, `trainer.nnodes=2`, one rank per node) spanning both nodes. The run is SIGKILLed after its first
checkpoint and resumed with the same run id on the same cluster. Then the second node is lost (its raylet and
workers SIGKILLed) under a run whose reward worker needs a resource only that node offered: the run restarts
by itself, says that it waits for capacity, and goes on once a node offering it joins.

The nodes are `tests.integration.ray_nodes.RayNode`s: `ray start --block` processes in their own sessions,
temp dirs and free ports, stopped by killing exactly their sessions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import ROOT, kill_and_resume, tiny_overrides, train_cmd
from tests.integration.ray_nodes import RayNode, kill_sessions, node_env, ray_nodes, session_pids, start_head

pytestmark = pytest.mark.slow

WORKER_LINE = re.compile(r"^(?:\x1b\[[0-9;]*m)?\(\S+ pid=\d+", re.M)
"""A line Ray forwarded from a worker process: `(_RayHost pid=123, ip=…)`, after colour codes if any."""


HEALTH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
"""The head notices a lost node within seconds (Ray's defaults take about half a minute)."""

LOST = "node_lost"
"""The run id of the node-loss test; its reward worker hangs in step 2 on the second node (`DAPO_FAULT`)."""


@pytest.fixture(scope="module")
def two_nodes():
    """(RAY_ADDRESS, env, temp dir, node list, second node) of a two-node cluster: the head offers
    `gen_node`, the second node `train_node`; the second node's workers hang in run `LOST`'s step-2
    scoring."""
    env = node_env(**HEALTH)
    with ray_nodes("dapo2n-") as (tmp, nodes):
        # room for the run's two rollout replicas (nnodes 2 x 1)
        address = start_head(tmp, nodes, env, '--resources={"gen_node": 2}')
        second = RayNode(
            tmp,
            "second",
            {**env, "DAPO_FAULT": f"hang@reward_g0:2:{LOST}"},
            [f"--address={address}", "--num-cpus=2", '--resources={"train_node": 1}'],
        )
        nodes.append(second)
        second.wait_started()
        yield address, env, tmp, nodes, second


def _placement(run: Path) -> dict[tuple[str, int], str]:
    """(role, rank) -> node id, from the run's workers.json."""
    workers = json.loads((run / "workers.json").read_text())["workers"]
    return {(w["role"], w["rank"]): w["node_id"] for w in workers}


@pytest.mark.timeout(900)
def test_rollout_on_its_node_and_an_actor_group_across_both_and_the_run_resumes(tiny_assets, two_nodes):
    address, env, *_ = two_nodes
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


WAITS = re.compile(
    r"the restart of run node_lost waits up to \d+s more \(trainer.restart_wait_s\) for capacity: .*"
)


@pytest.mark.timeout(900)
def test_a_lost_node_s_worker_waits_for_capacity_and_the_run_goes_on(tiny_assets, two_nodes):
    """Run `LOST` places its reward worker by `trainer.ray_resources.reward` on the second node, which is
    lost (raylet and workers SIGKILLed) while the worker scores step 2: the run restarts by itself, says that
    the reward worker waits for a node offering `train_node`, and once a third node offering it joins, goes
    on there and finishes. Runs last in this module: the second node stays lost."""
    address, env, tmp, nodes, second = two_nodes
    run = tiny_assets / "runs" / LOST
    log = tmp / f"{LOST}.log"
    overrides = tiny_overrides(
        tiny_assets,
        **{
            "trainer.experiment_name": LOST,
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.enable": "false",
            "trainer.ray_resources.reward": "{train_node: 1}",
            "trainer.max_restarts": 1,
            "trainer.restart_wait_s": 240,
        },
    )
    with log.open("w") as out:
        victim = subprocess.Popen(
            train_cmd(overrides),
            env={**env, "RAY_ADDRESS": address},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        hung = run / "faults" / "hang@reward_g0#0:2.done"
        wait_for(
            hung.exists, "the reward worker to hang in step 2 on the second node", 300, 0.2, alive=victim
        )
        before = _placement(run)
        killed_at = time.time()
        for pid in session_pids(second.proc.pid):  # the node is lost: its raylet and workers, at once
            os.kill(pid, signal.SIGKILL)
        said = wait_for(
            lambda: WAITS.search(log.read_text(errors="replace")),
            "the restart to say what it waits for",
            120,
            0.5,
            alive=victim,
        )
        third = RayNode(
            tmp, "third", env, [f"--address={address}", "--num-cpus=2", '--resources={"train_node": 1}']
        )
        nodes.append(third)
        third.wait_started()
        assert victim.wait(timeout=300) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if victim.poll() is None:
            kill_sessions([victim.pid], grace_s=0.0)
            victim.wait()
    text = log.read_text(errors="replace")
    wait = said.group(0)
    assert re.search(r"worker 'reward' asks for (CPU=1, )?train_node=1 ", wait), wait
    assert "no node of the cluster offers resource(s) 'train_node'" in wait, wait
    restart = re.search(r"restart 1 of 1 .*a worker died at stage 'reward_g0' of step 2 .*", text)
    assert restart and "resuming from checkpoint step 1" in restart.group(0), text[-4000:]
    after = _placement(run)  # workers.json of the restart: the reward worker is on the new node
    assert after[("reward", 0)] not in set(before.values()), (before, after)
    assert (run / "ckpt" / "latest").read_text().strip() == "2"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fault/restarts"]) for r in rows] == [(1, 0.0), (2, 1.0)]
    commits = [t for p in run.glob("step_*/*.manifest.json") if (t := p.stat().st_mtime) > killed_at]
    print(f"node lost: {min(commits) - killed_at:.1f} s from the kill to the next commit")
