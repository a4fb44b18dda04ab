"""A real Prefect server: `dapo deploy` serves dapo-train/<name>; `prefect deployment run` trains with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import CONFIG, tiny_overrides
from tests.integration.prefect_server import PREFECT, prefect_server, stop

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_deployment_run_trains_one_step(tiny_assets, tmp_path):
    with prefect_server(tmp_path / "prefect", PREFECT_RUNNER_POLL_FREQUENCY="2") as (_, env):
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
        try:

            def deployed() -> bool:
                out = subprocess.run(
                    [str(PREFECT), "deployment", "ls"], env=env, capture_output=True, text=True, check=False
                )
                return "dapo-train/ci" in out.stdout

            wait_for(deployed, "deployment dapo-train/ci", 240, 0.5, alive=serve)
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
            stop(serve)
