"""Two Ray nodes on this machine: a head (`ray start --head`) and a second node (`ray start --address`), each
advertising one custom resource; a tiny training joins them through `RAY_ADDRESS` with
`trainer.ray_resources` placing the rollout worker on the head, and a data-parallel actor group (FSDP2 over
gloo, `trainer.nnodes=2`, one rank per node) spanning both nodes. The run is SIGKILLed after its first
checkpoint and resumed with the same run id on the same cluster.

The nodes are `ray start --block` processes in their own sessions, with their own temp dirs and free ports,
and are stopped by killing exactly their sessions (every Ray process they started inherits the session, Ray's
worker processes included): `ray stop` would kill every Ray of this user on the machine, other tests' too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dapo_core.compute.host import QUIET_WORKER_ENV
from tests.helpers import wait_for
from tests.integration.conftest import kill_and_resume, tiny_overrides, train_cmd

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
WORKER_LINE = re.compile(r"^(?:\x1b\[[0-9;]*m)?\(\S+ pid=\d+", re.M)
"""A line Ray forwarded from a worker process: `(_RayHost pid=123, ip=…)`, after colour codes if any."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _session_pids(sid: int) -> list[int]:
    """Processes whose session id is `sid` (field 6 of /proc/<pid>/stat)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def _kill_sessions(sids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM every process of the sessions `sids`, then SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for sid in sids:
            for pid in _session_pids(sid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.time() + wait_s
        while time.time() < deadline and any(_session_pids(sid) for sid in sids):
            time.sleep(0.2)


class RayNode:
    """One `ray start --block` node in its own session, temp dir and ports."""

    def __init__(self, tmp: Path, name: str, env: dict, args: list[str]):
        self.log = tmp / f"{name}.log"
        node_args = [
            f"--temp-dir={tmp / name}",
            "--object-store-memory=200000000",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--node-manager-port={_free_port()}",
            f"--object-manager-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [RAY, "start", "--block", *args, *node_args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_started(self, timeout_s: float = 180.0) -> None:
        def started() -> bool:
            if "Ray runtime started" in self.log.read_text(errors="replace"):
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"ray node exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            return False

        try:
            wait_for(started, f"ray node {self.log.stem} to log 'Ray runtime started'", timeout_s, 0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log.read_text(errors='replace')[-3000:]}") from None

    @staticmethod
    def stop_all(nodes: list[RayNode]) -> None:
        _kill_sessions([node.proc.pid for node in nodes])
        for node in nodes:
            node.proc.wait(timeout=10)


@pytest.fixture
def two_nodes():
    """(RAY_ADDRESS, env) of a two-node cluster: the head offers `gen_node`, the second node `train_node`."""
    tmp = Path(
        tempfile.mkdtemp(prefix="dapo2n-", dir="/tmp")
    )  # short: Ray's socket paths have a length limit
    port = _free_port()
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",  # Ray 2.60 default for clusters; one token shared by nodes and driver
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    # a local Ray started earlier in this process set this to 0 (loopback only), which refuses a second node
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    for key in QUIET_WORKER_ENV:  # nodes as on a fresh machine: the driver cannot quiet them by its env
        env.pop(key, None)
    nodes: list[RayNode] = []
    try:
        head = RayNode(
            tmp,
            "head",
            env,
            [
                "--head",
                f"--port={port}",
                f"--ray-client-server-port={_free_port()}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                "--num-cpus=3",
                '--resources={"gen_node": 2}',  # room for the run's two rollout replicas (nnodes 2 x 1)
            ],
        )
        nodes.append(head)
        head.wait_started()
        address = f"127.0.0.1:{port}"
        second = RayNode(
            tmp, "second", env, [f"--address={address}", "--num-cpus=2", '--resources={"train_node": 1}']
        )
        nodes.append(second)
        second.wait_started()
        yield address, env
    finally:
        RayNode.stop_all(nodes)
        shutil.rmtree(tmp, ignore_errors=True)


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
        _kill_sessions([victim.pid], grace_s=0.0)
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
