"""The console of the `dapo` CLI as CI and `dvc repro` see it (stdout/stderr are not a terminal): every wait
says what it does (the server's start-up, the SFT warm-up, evaluation, each generation batch of a training
step) in rate-limited lines, with no Prefect usage-data notice or telemetry traceback and no transformers
progress bars; a start-up timeout is one paragraph. The start-up tests start a real temporary Prefect server;
the others report to the test run's server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import CONFIG, tiny_overrides

DAPO = Path(sys.executable).parent / "dapo"
ROOT = Path(__file__).resolve().parents[2]


def _dapo(args: list[str], home: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    drop = (
        "PREFECT_API_URL",
        "PREFECT_SERVER_ANALYTICS_ENABLED",
        "DO_NOT_TRACK",
        "PREFECT_LOGGING_LEVEL",
        "CI",
    )
    base = {k: v for k, v in os.environ.items() if k not in drop}
    base.update({"PREFECT_HOME": str(home), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", **env})
    return subprocess.run(
        [str(DAPO), *args], cwd=ROOT, env=base, capture_output=True, text=True, timeout=timeout, check=False
    )


def _clean(out: str) -> None:
    assert "anonymous usage data" not in out and "send_telemetry_heartbeat" not in out
    assert "Traceback" not in out
    assert "Writing model shards" not in out and "Loading weights" not in out  # transformers' tqdm bars
    assert "Task run '" not in out  # Prefect's line per task run (DAPO_TASK_LOGS=1 brings them back)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("console")


def test_prepare_says_what_it_waits_for(root, tmp_path):
    # `DAPO_PROGRESS_INTERVAL_S=1`: the server's start-up (several seconds here) prints "still waiting" lines
    r = _dapo(
        ["prepare", "--config", str(CONFIG), *tiny_overrides(root)],
        tmp_path / "h",
        DAPO_PROGRESS_INTERVAL_S="1",
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    _clean(out)
    # 120 s unless PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS says otherwise (the Makefile sets it)
    assert re.search(r"starting a temporary local Prefect server \(waits up to \d+ s", out), out
    ready = re.search(r"Prefect server ready at http://127\.0\.0\.1:\d+/api after (\d+) s", out)
    assert ready, out
    if int(ready.group(1)) >= 2:  # a line a second while it waits (a fast machine may be ready in < 1 s)
        assert "still waiting for the temporary Prefect server to answer" in out
    assert "train: 400 rows" in out


def test_base_eval_and_train_print_rate_limited_progress(root, tmp_path, prefect_home):
    home = tmp_path / "h"
    ov = tiny_overrides(root, **{"actor_rollout_ref.model.sft.steps": 3, "trainer.use_ray": "false"})
    api = os.environ["PREFECT_API_URL"]  # the test run's server (conftest), for the three commands
    r = _dapo(
        ["base", "--config", str(CONFIG), *ov], home, PREFECT_API_URL=api, DAPO_PROGRESS_INTERVAL_S="3600"
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    _clean(out)
    sft = re.findall(r"SFT warm-up: (\d+)/3 steps \(\d+%, \d+s\) loss", out)
    assert sft == ["1", "3"], out  # an hour between lines: only the first and the last, not step 2

    ckpt = str(root / "models" / "tiny_base")
    r = _dapo(
        [
            "eval",
            "--config",
            str(CONFIG),
            *ov,
            "--checkpoint",
            ckpt,
            "--output",
            str(tmp_path / "eval.json"),
        ],
        home,
        PREFECT_API_URL=api,
        DAPO_PROGRESS_INTERVAL_S="0",
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    _clean(out)
    done = [int(x) for x in re.findall(r"evaluate: generate: (\d+)/32 responses", out)]
    assert done and done[-1] == 32 and done == sorted(done), out  # 16 prompts x eval.n 2

    train = [
        "trainer.total_training_steps=1",
        "trainer.experiment_name=console",
        "trainer.save_freq=0",
        "algorithm.filter_groups.max_num_gen_batches=2",
        "algorithm.filter_groups.refill=fixed",  # every batch 8 prompts (the CPU default sizes refills)
    ]
    args = ["train", "--flow-only", "--config", str(CONFIG), *ov, *train]
    r = _dapo(args, home, PREFECT_API_URL=api, DAPO_PROGRESS_INTERVAL_S="0")
    out = r.stdout + r.stderr
    _clean(out)
    # one line per generation batch: its prompts and the kept groups against the 4 the step needs; this
    # barely warmed-up model may keep too few in 2 batches, which ends the run with one paragraph
    lines = re.findall(r"step 1/1 gen batch (\d+): 8 prompts, kept (\d+)/4 groups", out)
    assert [int(b) for b, _ in lines] == list(range(1, len(lines) + 1)) and lines, out
    if r.returncode == 0:
        assert int(lines[-1][1]) >= 4, out
    else:
        assert r.returncode == 2 and len(lines) == 2 and "max_num_gen_batches=2" in r.stderr, out


def test_prefect_start_up_timeout_is_one_paragraph(root, tmp_path):
    r = _dapo(
        ["prepare", "--config", str(CONFIG), *tiny_overrides(root)],
        tmp_path / "h",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1",
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        "did not answer within 1 s" in r.stderr
        and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in r.stderr
    )
    assert "Traceback" not in r.stderr
