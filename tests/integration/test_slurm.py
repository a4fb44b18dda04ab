"""infra/slurm/dapo.sbatch with real Ray: a one-node allocation whose head listens on loopback runs a tiny
one-step `dapo train` through RAY_ADDRESS, and everything the script started is gone when it exits.

Two ways in: with the Slurm variables set by hand (`scontrol` and `srun` replaced by shims on PATH that print
the node list and run the command here), which needs no Slurm; and through a real `sbatch` when a
Slurm controller answers on this machine (Debian's slurm-wlm, one node), skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import tiny_overrides
from tests.integration.prefect_server import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "slurm" / "dapo.sbatch"
pytestmark = pytest.mark.slow

SHIMS = {
    # `scontrol show hostnames a,b` -> one name a line (enough for a list written out by hand)
    "scontrol": '[[ "$1 $2" == "show hostnames" ]] && tr , "\\n" <<< "$3"\n',
    # `srun --opt=value ... cmd args` -> cmd args, here
    "srun": 'while [[ "${1:-}" == --* ]]; do shift; done\nexec "$@"\n',
}


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A short Ray temp dir (Ray's socket paths under it must fit AF_UNIX's 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="dapo-sb-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def script_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a submission: this checkout's .venv, no GPUs, a free port and per-node ports and
    the Ray temp dir `tmp` of its own (other Ray clusters may run on this machine), no Ray settings
    inherited."""
    ports = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "metrics-export-port"]
    ports += ["dashboard-agent-grpc-port", "runtime-env-agent-port", "ray-client-server-port"]
    ray_args = [f"--temp-dir={tmp}", "--num-cpus=4", "--object-store-memory=200000000"]
    ray_args += ["--min-worker-port=0", "--max-worker-port=0", *(f"--{p}={free_port()}" for p in ports)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    env.update(
        {
            "DAPO_VENV": str(ROOT / ".venv"),
            "DAPO_GPUS_PER_NODE": "0",
            "DAPO_RAY_PORT": str(free_port()),
            "DAPO_RAY_ARGS": " ".join(ray_args),
            "DAPO_JOIN_TIMEOUT_S": "120",
            "OMP_NUM_THREADS": "1",
            **extra,
        }
    )
    return env


def train_args(tiny_assets: Path, runs: Path) -> list[str]:
    """`dapo train` arguments of a one-step tiny run on Ray, into `runs`."""
    return [
        "--flow-only",
        "--config",
        "configs/tiny_cpu.yaml",
        *tiny_overrides(
            tiny_assets,
            **{
                "trainer.experiment_name": "slurm",
                "trainer.runs_dir": str(runs),
                "trainer.use_ray": "true",
                "trainer.total_training_steps": 1,
                "trainer.test_freq": -1,
                "trainer.val_before_train": "false",
                "algorithm.filter_groups.enable": "false",
            },
        ),
    ]


def left_behind(tmp: Path) -> list[str]:
    """Command lines of live processes that mention `tmp` (the Ray temp dir the script's nodes were given)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(tmp) in cmd and entry.name != str(os.getpid()):
                found.append(cmd)
    return found


def check_run(out: str, runs: Path, tmp: Path) -> None:
    assert "dapo.sbatch: 1 node(s), 0 GPU(s) joined" in out, out[-4000:]
    assert "dapo.sbatch: Ray stopped" in out, out[-2000:]
    metrics = runs / "slurm" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]
    workers = json.loads((runs / "slurm" / "workers.json").read_text())["workers"]
    assert workers and len({w["node_id"] for w in workers}) == 1  # every role on the script's one node
    assert left_behind(tmp) == []


@pytest.mark.timeout(300)
def test_sbatch_script_with_slurm_variables_set_by_hand(tiny_assets, tmp_path, ray_tmp):
    runs = tmp_path / "runs"
    done = by_hand(ray_tmp, tmp_path, train_args(tiny_assets, runs))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    check_run(out, runs, ray_tmp)


def slurm_answers() -> bool:
    """Whether a Slurm controller with an idle node answers here."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and "idle" in out.stdout.split()


def job_state(job: str) -> str:
    """The state of Slurm job `job` once it has ended (COMPLETED, FAILED, ...); "" while it waits or runs."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    state = next((f.split("=", 1)[1] for f in out.stdout.split() if f.startswith("JobState=")), "")
    return "" if state in ("", "PENDING", "CONFIGURING", "RUNNING", "COMPLETING") else state


@pytest.mark.timeout(300)
@pytest.mark.skipif(not slurm_answers(), reason="no Slurm controller with an idle node on this machine")
def test_sbatch_script_under_real_slurm(tiny_assets, tmp_path, ray_tmp):
    runs, log = tmp_path / "runs", tmp_path / "slurm.out"
    submit = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--time=5", f"--output={log}"]
    # --gpus-per-node=0: the script's header asks for 8 GPUs a node; this node has none
    sub = subprocess.run(
        [*submit, str(SCRIPT), *train_args(tiny_assets, runs)],
        env=script_env(ray_tmp),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = sub.stdout.strip().split(";")[0]
    try:
        state = wait_for(lambda: job_state(job), f"Slurm job {job} to end", 240, 0.5)
    finally:
        if not job_state(job):
            subprocess.run(["scancel", job], check=False, timeout=30)
    out = log.read_text(errors="replace") if log.exists() else ""
    assert state == "COMPLETED", f"{state}\n{out[-4000:]}"
    check_run(out, runs, ray_tmp)


def by_hand(ray_tmp: Path, shims: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess:
    """The script run with the Slurm variables set by hand and the shims first on PATH."""
    for name, body in SHIMS.items():
        (shims / name).write_text(f"#!/usr/bin/env bash\n{body}")
        (shims / name).chmod(stat.S_IRWXU)
    env = script_env(ray_tmp, SLURM_JOB_NODELIST="node1", DAPO_HEAD_IP="127.0.0.1", **extra)
    env["PATH"] = f"{shims}:{env['PATH']}"
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )


@pytest.mark.timeout(180)
def test_a_ray_node_that_cannot_start_ends_the_wait_at_once(tmp_path, ray_tmp):
    """A `ray start` that fails (here: an argument it does not know) stops the job before `dapo train`, with
    the step named, well before the join deadline."""
    done = by_hand(
        ray_tmp, tmp_path, ["--flow-only"], DAPO_RAY_ARGS="--no-such-flag", DAPO_JOIN_TIMEOUT_S="90"
    )
    err = done.stdout + done.stderr
    assert done.returncode == 1, err[-3000:]
    assert "ended before the cluster was complete" in err, err[-3000:]
    assert "dapo.sbatch: Ray stopped" in err and "joined" not in err
    assert left_behind(ray_tmp) == []


def test_a_missing_environment_is_one_paragraph(tmp_path, ray_tmp):
    done = by_hand(ray_tmp, tmp_path, [], DAPO_VENV=str(tmp_path / "no-venv"))
    assert done.returncode == 2
    assert done.stderr.startswith(f"dapo.sbatch: {tmp_path / 'no-venv'}/bin/ray is missing: set DAPO_VENV")
    assert done.stderr.count("\n") == 1 and done.stdout == ""
