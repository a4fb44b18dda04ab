"""The repo's prefect.yaml on a real server and a real process worker: `prefect deploy` registers
dapo-train/tiny on the `dapo` pool, `prefect deployment run` schedules a tiny one-step training, and a
running `prefect worker start --pool dapo` runs it to Completed; the UI's Retry (the same flow run set to
AwaitingRetry) is picked up again by the worker and continues the same run folder."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from flows.deploy import markup_safe
from tests.helpers import wait_for
from tests.integration.conftest import tiny_overrides
from tests.integration.prefect_server import PREFECT, prefect_server, stop

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
DEPLOYMENT = "dapo-train/tiny"


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


TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def ended(base: str, flow_run: str, attempts: int) -> dict | None:
    """The flow run once its `attempts`-th attempt has ended (Completed, Failed, ...), else None."""
    run = api(base, f"/flow_runs/{flow_run}")
    return run if run["state"]["type"] in TERMINAL and run["run_count"] >= attempts else None


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
    log = tmp_path / "worker.log"
    with prefect_server(tmp_path / "prefect", PREFECT_WORKER_QUERY_SECONDS="1") as (base, env):
        prefect(env, "work-pool", "create", "dapo", "--type", "process")
        with log.open("w") as out:  # the worker, left running as a user would; its runs start in the checkout
            worker = subprocess.Popen(
                [str(PREFECT), "worker", "start", "--pool", "dapo", "--limit", "1"],
                env=env,
                cwd="/",  # the flow run's folder comes from the deployment's pull step, not the worker's
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            prefect(env, "--no-prompt", "deploy", "--prefect-file", "prefect.yaml", "--name", DEPLOYMENT)
            params = json.dumps({"overrides": [markup_safe(o) for o in ov]})
            out = prefect(env, "deployment", "run", DEPLOYMENT, "--params", params)
            found = re.search(r"UUID: ([0-9a-f-]{36})", out)
            assert found, out
            flow_run = found.group(1)

            first = wait_for(lambda: ended(base, flow_run, 1), "the flow run to end", 600, 0.5, alive=worker)
            assert first["state"]["type"] == "COMPLETED", (first["state"], log.read_text()[-4000:])
            runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
            assert len(runs) == 1 and runs[0].name.endswith(flow_run[:8]), runs  # named after the flow run
            metrics = runs[0] / "metrics.jsonl"
            assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]
            trained = metrics.read_bytes()

            # the UI's Retry: the same flow run back to Scheduled/AwaitingRetry; the worker runs it again
            retry = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True}
            assert api(base, f"/flow_runs/{flow_run}/set_state", retry)["status"] == "ACCEPT"
            again = wait_for(lambda: ended(base, flow_run, 2), "the retry to end", 600, 0.5, alive=worker)
            assert again["state"]["type"] == "COMPLETED", (again["state"], log.read_text()[-4000:])
            assert [p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()] == [runs[0].name]
            assert metrics.read_bytes() == trained  # the retry resumed the finished run: no step twice
        finally:
            stop(worker)  # SIGINT: `prefect worker start` ignores the first SIGTERM
