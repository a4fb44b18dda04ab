"""A Ray node lost under a run: a cluster of a head and a second node on this machine (`ray start`), the
second offering custom resource `train_node`; a tiny training joins it through `RAY_ADDRESS` and places its
reward worker there with `trainer.ray_resources.reward`. A node is lost (every process of it stopped at once,
as a machine gone from the network, then SIGKILLed once the head declared it dead) while the worker scores a
step, twice: with no other node offering `train_node` the run restarts by itself, says that it waits for
capacity, and goes on once such a node joins; with one in the cluster already, the restart places the worker
there at once, without waiting.

The nodes are `tests.integration.ray_nodes.RayNode`s: `ray start --block` processes in their own sessions,
temp dirs and free ports, stopped by killing exactly their sessions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import ROOT, tiny_overrides, train_cmd
from tests.integration.ray_nodes import RayNode, kill_sessions, node_env, ray_nodes, session_pids, start_head

pytestmark = pytest.mark.slow

HEALTH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
"""The head notices a lost node within seconds (Ray's defaults take about half a minute)."""

NICENESS = {"RAY_worker_niceness": "0"}
"""The nodes run their worker processes at the driver's priority, as `dapo train`'s local Ray does (Ray's
default, nice 15, starves them beside other work on a loaded machine)."""

LOST = "node_lost"
"""The run id; its reward worker hangs in step 2 on the second node and in step 3 on the third
(`DAPO_FAULT`)."""

WAITS = re.compile(
    r"the restart of run node_lost waits up to \d+s more \(trainer.restart_wait_s\) for capacity: .*"
)


def _freeze(sid: int) -> list[int]:
    """SIGSTOP every process of the session `sid` (a node: its raylet, agents and workers) until all are
    stopped; their pids. A lost machine: nothing of it answers, and no connection to it closes, so the head's
    health check (`HEALTH`), not a closed socket, tells the cluster the node and its workers are gone, before
    the driver hears of the dead worker."""
    stopped: set[int] = set()
    while pids := set(session_pids(sid)) - stopped:  # a process may start another while we stop them
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= pids
    return sorted(stopped)


def _placement(run: Path) -> dict[tuple[str, int], str]:
    """(role, rank) -> node id, from the run's workers.json."""
    workers = json.loads((run / "workers.json").read_text())["workers"]
    return {(w["role"], w["rank"]): w["node_id"] for w in workers}


@pytest.mark.timeout(900)
def test_a_lost_node_s_worker_waits_for_capacity_or_moves_to_a_node_that_fits(tiny_assets):
    """Run `LOST` places its reward worker by `trainer.ray_resources.reward` on the second node, which is
    lost (`_freeze`) while the worker scores step 2: the run restarts by itself, says that the reward worker
    waits for a node offering `train_node`, and once a third node offering it joins, goes on there. While the
    worker scores step 3 there, a fourth such node joins and the third is lost: the restart places the worker
    on the fourth at once, without a word of waiting, and the run finishes."""
    env = node_env(**HEALTH, **NICENESS)
    run = tiny_assets / "runs" / LOST
    overrides = tiny_overrides(
        tiny_assets,
        **{
            "trainer.experiment_name": LOST,
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 3,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.enable": "false",
            "trainer.ray_resources.reward": "{train_node: 1}",
            "trainer.max_restarts": 2,
            "trainer.restart_wait_s": 240,
        },
    )
    with ray_nodes("dapolost-") as (tmp, nodes):
        address = start_head(tmp, nodes, env)
        second = RayNode(
            tmp,
            "second",
            {**env, "DAPO_FAULT": f"hang@reward_g0:2:{LOST}"},  # its workers hang in step 2's scoring
            [f"--address={address}", "--num-cpus=2", '--resources={"train_node": 1}'],
        )
        nodes.append(second)
        second.wait_started()
        log = tmp / f"{LOST}.log"
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
            frozen = _freeze(second.proc.pid)  # the node is lost: nothing of it answers any more
            said = wait_for(
                lambda: WAITS.search(log.read_text(errors="replace")),
                "the restart to say what it waits for",
                120,
                0.5,
                alive=victim,
            )
            for pid in frozen:  # declared dead by the head: its processes go for good
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            node_args = [f"--address={address}", "--num-cpus=2", '--resources={"train_node": 1}']
            third = RayNode(tmp, "third", {**env, "DAPO_FAULT": f"hang@reward_g0:3:{LOST}"}, node_args)
            nodes.append(third)
            third.wait_started()
            wait_for(
                (run / "faults" / "hang@reward_g0#0:3.done").exists,
                "the reward worker to hang in step 3 on the third node",
                300,
                0.2,
                alive=victim,
            )
            fourth = RayNode(tmp, "fourth", env, node_args)  # joins while the worker hangs
            nodes.append(fourth)
            fourth.wait_started()
            middle = _placement(run)
            lost_again_at = time.time()
            frozen = _freeze(third.proc.pid)
            wait_for(
                lambda: "restart 2 of 2" in log.read_text(errors="replace"),
                "the second restart",
                120,
                0.5,
                alive=victim,
            )
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert victim.wait(timeout=300) == 0, log.read_text(errors="replace")[-4000:]
        finally:
            if victim.poll() is None:
                kill_sessions([victim.pid], grace_s=0.0)
                victim.wait()
        text = log.read_text(errors="replace")
    wait = said.group(0)
    assert re.search(r"worker 'reward' asks for (CPU=1, )?train_node=1 ", wait), wait
    assert "no node of the cluster offers resource(s) 'train_node'" in wait, wait
    restart = re.search(r"restart 1 of 2 .*a worker died at stage 'reward_g0' of step 2 .*", text)
    assert restart and "resuming from checkpoint step 1" in restart.group(0), text[-4000:]
    restart = re.search(r"restart 2 of 2 .*a worker died at stage 'reward_g0' of step 3 .*", text)
    assert restart and "resuming from checkpoint step 2" in restart.group(0), text[-4000:]
    assert len(WAITS.findall(text)) == 1, text[-4000:]  # the second restart found room at once
    after = _placement(run)  # workers.json of the last restart
    assert middle[("reward", 0)] not in set(before.values()), (before, middle)  # on the third node
    assert after[("reward", 0)] not in set(before.values()) | {middle[("reward", 0)]}, (middle, after)
    assert (run / "ckpt" / "latest").read_text().strip() == "3"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fault/restarts"]) for r in rows] == [(1, 0.0), (2, 1.0), (3, 2.0)]
    for what, since, step in (("waiting", killed_at, 2), ("moving", lost_again_at, 3)):
        manifests = run.glob(f"step_{step:06d}/*.manifest.json")
        commits = [t for p in manifests if (t := p.stat().st_mtime) > since]
        print(f"node lost ({what}): {min(commits) - since:.1f} s from the loss to the next commit")
