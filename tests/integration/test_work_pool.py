"""The repo's prefect.yaml on a real server and a real process worker: `prefect deploy` registers
dapo-train/tiny on the `dapo` pool, `prefect deployment run` schedules a tiny one-step training, and
`prefect worker start --pool dapo` runs it to Completed; the UI's Retry (the same flow run set to
AwaitingRetry) is picked up again by a worker and continues the same run folder."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from flows.deploy import markup_safe
from tests.integration.conftest import tiny_overrides
from tests.integration.prefect_server import PREFECT, prefect_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def prefect(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    """Run the `prefect` CLI in the checkout; fail with its output unless it exits 0; returns its stdout."""
    done = subprocess.run(
        [str(PREFECT), *args], env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=timeout
    )
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def api(base: str, path: str, body: dict | None = None) -> dict:
    """GET (or, with `body`, POST) `path` of the Prefect REST API at `base`; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def work_once(env: dict[str, str]) -> str:
    """`prefect worker start --pool dapo` for one poll: it submits the scheduled runs, waits for them
    (`--limit` makes it wait) and exits; its output."""
    done = subprocess.run(
        [str(PREFECT), "worker", "start", "--pool", "dapo", "--run-once", "--limit", "1"],
        env=env,
        cwd="/",  # the flow run's folder comes from the deployment's pull step, not the worker's
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


@pytest.mark.timeout(900)
def test_worker_runs_a_deployment_and_its_retry(tiny_assets, tmp_path):
    ov = tiny_overrides(
        tiny_assets,
        **{
            "trainer.total_training_steps": 1,
            "trainer.use_ray": "false",
            "trainer.val_before_train": "false",
            "trainer.test_freq": -1,
            "algorithm.filter_groups.enable": "false",
            "trainer.runs_dir": str(tmp_path / "runs"),
        },
    )
    with prefect_server(tmp_path / "prefect") as (base, env):
        prefect(env, "work-pool", "create", "dapo", "--type", "process")
        prefect(env, "--no-prompt", "deploy", "--prefect-file", "prefect.yaml", "--name", "dapo-train/tiny")
        params = json.dumps({"overrides": [markup_safe(o) for o in ov]})
        out = prefect(env, "deployment", "run", "dapo-train/tiny", "--params", params)
        flow_run = re.search(r"UUID: ([0-9a-f-]{36})", out)
        assert flow_run, out
        run_id = flow_run.group(1)
        assert api(base, f"/flow_runs/{run_id}")["state"]["type"] == "SCHEDULED"

        work_once(env)
        first = api(base, f"/flow_runs/{run_id}")
        assert first["state"]["type"] == "COMPLETED", first["state"]
        runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
        assert len(runs) == 1 and runs[0].name.endswith(run_id[:8]), runs  # named after the flow run
        metrics = runs[0] / "metrics.jsonl"
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]
        trained = metrics.read_bytes()

        # the UI's Retry: the same flow run back to Scheduled/AwaitingRetry; a worker picks it up again
        retry = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True}
        assert api(base, f"/flow_runs/{run_id}/set_state", retry)["status"] == "ACCEPT"
        work_once(env)
        again = api(base, f"/flow_runs/{run_id}")
        assert again["state"]["type"] == "COMPLETED", again["state"]
        assert again["run_count"] == 2
        assert [p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()] == [runs[0].name]
        assert metrics.read_bytes() == trained  # the retry resumed the finished run: nothing trained twice
