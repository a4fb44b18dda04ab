"""Shared storage is checked before any model loads: a two-node cluster on this machine whose second raylet
runs in a mount namespace of its own (`unshare -m`) with an empty tmpfs over the runs folder's parent, so it
cannot see the run folder the driver creates. `dapo train` on that cluster is refused with one paragraph
naming that node, the path and the fix, before any worker starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.integration.conftest import ROOT, tiny_overrides, train_cmd
from tests.integration.ray_nodes import RayNode, node_env, ray_nodes, start_head

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1) for -m"
    ),
]

REFUSED = re.compile(r"Ray node ([0-9a-f]{16,}) \((\S+)\) (.*?): every node must see the run folder")


@pytest.mark.timeout(300)
def test_a_node_that_cannot_see_the_run_folder_is_refused_before_any_worker(tiny_assets, tmp_path):
    shared = tmp_path / "shared"  # the runs folder's parent, hidden from the second node
    shared.mkdir()
    env = node_env()
    hide = ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"']
    with ray_nodes("dapofs-") as (tmp, nodes):
        address = start_head(tmp, nodes, env)
        join = [f"--address={address}", "--num-cpus=2"]
        hidden = RayNode(tmp, "hidden", env, join, wrap=[*hide, str(shared)])
        nodes.append(hidden)
        hidden.wait_started()
        overrides = tiny_overrides(
            tiny_assets,
            **{
                "trainer.runs_dir": str(shared / "runs"),
                "trainer.experiment_name": "hidden",
                "trainer.use_ray": "true",
                "trainer.total_training_steps": 1,
                "trainer.test_freq": -1,
                "trainer.val_before_train": "false",
            },
        )
        done = subprocess.run(
            train_cmd(overrides),
            env={**env, "RAY_ADDRESS": address},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        hidden_logs = "".join(
            p.read_text(errors="replace") for p in (tmp / "hidden").glob("session_*/logs/raylet.out")
        )
    run = shared / "runs" / "hidden"
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    found = REFUSED.search(done.stderr)
    assert found, done.stderr[-3000:]
    node_id, ip, problem = found.groups()
    assert node_id in hidden_logs  # the node in its own mount namespace, not the head
    assert re.fullmatch(r"[0-9.]+", ip), ip  # the node's address
    assert problem.startswith(f"cannot read the run folder's probe file {run}/.probe-"), problem
    assert "mount the shared filesystem" in done.stderr and "trainer.runs_dir" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (run / "workers.json").exists()  # refused before any worker started
    assert not list(run.glob(".probe-*"))  # the probe cleans up after itself
