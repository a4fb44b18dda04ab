"""`dapo submit` against a real Ray cluster on this machine: a head running the dashboard's job server and a
second raylet (`tests.integration.ray_nodes`). A tiny run is submitted with the checkout as the job's
working_dir, its rollout worker placed on the second raylet; it is stopped (`ray job stop`'s call) once step 2
has started, a second submission of the same run is refused while the first is active, and `dapo submit
--resume <run_id>` finishes it under the same run id from the last checkpoint. Bad input (no job server, an
unknown key, two run ids) is refused with one paragraph before anything is submitted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import tiny_overrides
from tests.integration.ray_nodes import RayNode, free_port, node_env, ray_nodes, start_head

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DAPO = [sys.executable, "-m", "flows.cli"]
SUBMITTED = re.compile(r"submitted run (\S+) as Ray job (\S+) to ")


@pytest.fixture
def job_cluster():
    """(job server URL, env) of a head with the dashboard on a free loopback port and a second raylet that
    alone offers `second_node`; `env` has the cluster's token and the venv's bin first on PATH (the
    cluster's `python`, as on a node where the environment is activated)."""
    env = node_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    with ray_nodes("dapojob-") as (tmp, nodes):
        dashboard = free_port()
        shown = ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}"]
        address = start_head(tmp, nodes, env, *shown)
        second = RayNode(
            tmp, "second", env, [f"--address={address}", "--num-cpus=2", '--resources={"second_node": 1}']
        )
        nodes.append(second)
        second.wait_started()
        yield f"http://127.0.0.1:{dashboard}", env


def _status(client, sid: str) -> str:
    return str(client.get_job_status(sid).value)


@pytest.mark.timeout(600)
def test_submitted_run_stops_resumes_with_the_same_run_id_and_finishes(tiny_assets, job_cluster):
    url, env = job_cluster
    from ray.job_submission import JobSubmissionClient

    # the token as a header: Ray caches the first token a process loads (a local Ray of an earlier test's)
    client = JobSubmissionClient(url, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    overrides = tiny_overrides(
        tiny_assets,
        **{
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "algorithm.filter_groups.enable": "false",
            "trainer.ray_resources.rollout": "{second_node: 1}",
        },
    )
    submit = [*DAPO, "submit", "--address", url, "--flow-only", "--env", "DAPO_JOB_MARK=on"]
    first = subprocess.run([*submit, *overrides], env=env, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    run_id, sid = SUBMITTED.search(first.stdout).groups()  # type: ignore[union-attr]
    assert sid == f"dapo-{run_id}"
    assert f"dapo submit --resume {run_id} --flow-only" in first.stdout
    info = client.get_job_info(sid)
    assert f"trainer.experiment_name={run_id}" in info.entrypoint
    assert info.runtime_env["env_vars"]["DAPO_JOB_MARK"] == "on"
    assert info.runtime_env["env_vars"]["PREFECT_API_URL"] == os.environ["PREFECT_API_URL"]
    run = tiny_assets / "runs" / run_id

    # the run is being written: a second job of it is refused, nothing submitted
    again = subprocess.run(
        [*DAPO, "submit", "--address", url, "--resume", run_id, "--flow-only", *overrides],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"run {run_id} already has an active Ray job ({sid}" in again.stderr
    assert "Traceback" not in again.stderr

    def started_step_2() -> bool:
        if _status(client, sid) in ("FAILED", "STOPPED", "SUCCEEDED"):
            raise AssertionError(f"job {sid} ended early:\n{client.get_job_logs(sid)[-4000:]}")
        return (run / "step_000002" / "generate_g0.manifest.json").exists()

    wait_for(started_step_2, "step 2 of the submitted run to start", 300, 0.2)
    assert client.stop_job(sid)  # what `ray job stop` does
    wait_for(lambda: _status(client, sid) == "STOPPED", f"job {sid} to be STOPPED", 60, 0.2)
    assert (run / "ckpt" / "latest").read_text().strip() == "1"
    ckpt_1 = (run / "ckpt" / "step_1").stat().st_mtime_ns

    resumed = subprocess.run(
        [*DAPO, "submit", "--address", url, "--resume", run_id, "--flow-only", *overrides],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert SUBMITTED.search(resumed.stdout).groups() == (run_id, f"dapo-{run_id}-1")  # type: ignore[union-attr]
    sid2 = f"dapo-{run_id}-1"
    wait_for(
        lambda: _status(client, sid2) in ("SUCCEEDED", "FAILED", "STOPPED"), f"job {sid2} to end", 300, 0.5
    )
    logs = client.get_job_logs(sid2)  # what `ray job logs` prints
    assert _status(client, sid2) == "SUCCEEDED", logs[-4000:]
    assert run_id in logs
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (run / "ckpt" / "latest").read_text().strip() == "2"
    assert (run / "ckpt" / "step_1").stat().st_mtime_ns == ckpt_1  # resumed from it, not retrained
    workers = {w["role"]: w["node_id"] for w in json.loads((run / "workers.json").read_text())["workers"]}
    assert workers["rollout"] != workers["actor"]  # on the second raylet, with the job's runtime env


def test_submit_refuses_bad_input_before_submitting(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)
    cases = [
        (["--address", f"http://127.0.0.1:{free_port()}"], "no Ray job server answers at http://127.0.0.1:"),
        ([], "needs the address of a Ray cluster's job server"),
        (["--address", "http://127.0.0.1:9", "trainer.bogus=1"], "trainer.bogus: unknown key"),
        (
            ["--address", "http://127.0.0.1:9", "--resume", "a", "trainer.experiment_name=b"],
            "--resume a and trainer.experiment_name=b name different runs",
        ),
    ]
    for args, expected in cases:
        done = subprocess.run([*DAPO, "submit", *args], env=env, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2, done.stdout + done.stderr
        assert expected in done.stderr
        assert "Traceback" not in done.stderr
        assert "submitted" not in done.stdout
