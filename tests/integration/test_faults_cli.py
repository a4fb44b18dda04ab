"""SIGTERM to a real `dapo train` (what a scheduler sends on preemption): the run stops cleanly, leaves no
process behind (no Ray, no ephemeral Prefect server), says how to resume, and the resumed run finishes.

Also checks, during that run, that the local Ray listens on loopback only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import kill_and_resume, tiny_overrides, train_cmd

ROOT = Path(__file__).resolve().parents[2]


def _marked(marker: str) -> list[int]:
    """Pids of live processes whose environment carries `DAPO_TEST_MARKER=marker` (our run's descendants)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
            status = (d / "status").read_text()
        except OSError:
            continue
        if f"DAPO_TEST_MARKER={marker}".encode() in env and "\nState:\tZ" not in status:
            pids.append(int(d.name))
    return pids


def _listening(pids: list[int]) -> list[str]:
    """Local addresses that `pids` listen on (TCP), from `ss -ltnpH`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={p}," in line for p in pids):
            found.append(line.split()[3])
    return found


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resume_finishes(tiny_assets, prefect_home, tmp_path):
    run = "sigterm"
    ov = tiny_overrides(
        tiny_assets,
        **{
            "trainer.runs_dir": str(tmp_path / "runs"),
            "trainer.experiment_name": run,
            "trainer.total_training_steps": 1,  # stopped in its only step: the resume finishes that step
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": "false",
            "trainer.use_ray": "true",
            "algorithm.filter_groups.enable": "false",  # a barely warmed-up model may leave no varied group
        },
    )
    marker = uuid.uuid4().hex
    env = {**os.environ, "DAPO_TEST_MARKER": marker, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    log = tmp_path / "sigterm.log"

    def sigterm(proc: subprocess.Popen) -> None:
        """The first generation committed: Ray, its workers and the Prefect server are all up; stop mid-step
        (after checking that they listen on loopback only)."""
        ours = [p for p in _marked(marker) if p != proc.pid]
        addrs = _listening([proc.pid, *ours])
        ray_addrs = [a for a in addrs if not a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))]
        assert addrs and ray_addrs == [], addrs
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
        assert proc.returncode == 128 + signal.SIGTERM, log.read_text()

    def stopped_cleanly(_run: Path) -> None:
        out = log.read_text()
        assert "Resume with: dapo train --flow-only" in out and f"trainer.experiment_name={run}" in out, out
        assert "Traceback" not in out and "SIGABRT" not in out and "Aborted" not in out, out
        wait_for(
            lambda: not _marked(marker),
            "every process of the stopped run to exit (none left behind)",
            30,
            0.5,
        )

    # resume: the same command finishes the run from the last checkpoint (reporting to the test run's server)
    kill_and_resume(
        train_cmd(ov),
        tmp_path / "runs" / run,
        "step_000001/generate_g0.manifest.json",
        env=env,
        resume_env={**env, "PREFECT_API_URL": os.environ["PREFECT_API_URL"]},
        kill=sigterm,
        after_kill=stopped_cleanly,
        log=log,
    )
    assert (tmp_path / "runs" / run / "ckpt" / "step_1").is_dir()
    assert _marked(marker) == []
