"""SIGTERM to a real `dapo train` (what a scheduler sends on preemption): the run stops cleanly, leaves no
process behind (no Ray, no ephemeral Prefect server), says how to resume, and the resumed run finishes.

Also checks, during that run, that the local Ray listens on loopback only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import CONFIG, tiny_overrides

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


def _exists_while_running(path: Path, proc: subprocess.Popen) -> bool:
    """Whether `path` exists; fail with the run's output once `proc` has ended without it."""
    if path.exists():
        return True
    if proc.poll() is not None:
        raise AssertionError(f"the run ended early ({proc.returncode}):\n{proc.communicate()[0][-4000:]}")
    return False


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resume_finishes(tiny_assets, prefect_home, tmp_path):
    run = "sigterm"
    ov = tiny_overrides(
        tiny_assets,
        **{
            "trainer.runs_dir": str(tmp_path / "runs"),
            "trainer.experiment_name": run,
            "trainer.total_training_steps": 2,
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
    cmd = [sys.executable, "-m", "flows.cli", "train", "--flow-only", "--config", str(CONFIG), *ov]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # the first generation committed: Ray, its workers and the Prefect server are all up; stop mid-step
        first = tmp_path / "runs" / run / "step_000001" / "generate_g0.manifest.json"
        wait_for(
            lambda: _exists_while_running(first, proc), f"the first generation to commit ({first})", 600, 0.2
        )
        ours = [p for p in _marked(marker) if p != proc.pid]
        addrs = _listening([proc.pid, *ours])
        ray_addrs = [a for a in addrs if not a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))]
        assert addrs and ray_addrs == [], addrs
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Resume with: dapo train --flow-only" in out and f"trainer.experiment_name={run}" in out, out
    assert "Traceback" not in out and "SIGABRT" not in out and "Aborted" not in out, out
    wait_for(
        lambda: not _marked(marker), "every process of the stopped run to exit (none left behind)", 30, 0.5
    )

    # resume: the same command finishes the run from the last checkpoint
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "runs" / run / "ckpt" / "step_2").is_dir()
    assert _marked(marker) == []
