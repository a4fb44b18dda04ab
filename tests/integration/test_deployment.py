"""A real Prefect server: `dapo deploy` serves dapo-train/<name>; `prefect deployment run` trains with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import CONFIG, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
PREFECT = Path(sys.executable).parent / "prefect"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, proc=None):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.timeout(900)
def test_deployment_run_trains_one_step(tiny_assets, tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    try:
        server = subprocess.Popen(
            [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(server)
        _wait(lambda: _healthy(api), 180, "prefect server health", server)
        ov = tiny_overrides(
            tiny_assets,
            **{
                "trainer.total_training_steps": 1,
                "trainer.use_ray": "false",
                "trainer.val_before_train": "false",
                "trainer.test_freq": -1,
                "algorithm.filter_groups.enable": "false",
                "trainer.experiment_name": "deployed",
            },
        )
        serve = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "deploy", "--config", str(CONFIG), "--name", "ci", *ov],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(serve)

        def deployed() -> bool:
            out = subprocess.run(
                [str(PREFECT), "deployment", "ls"], env=env, capture_output=True, text=True, check=False
            )
            return "dapo-train/ci" in out.stdout

        _wait(deployed, 240, "deployment dapo-train/ci", serve)
        run = subprocess.run(
            [str(PREFECT), "deployment", "run", "dapo-train/ci", "--watch", "--watch-timeout", "600"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=700,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Completed" in run.stdout
        metrics = tiny_assets / "runs" / "deployed" / "metrics.jsonl"
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
