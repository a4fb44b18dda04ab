"""The run lease (`dapo_core.store.lease`): one writer per run.

Holders are real processes (a `python -c` child that takes the lease and heartbeats); the second writer is
this test's process, through the lease API and through the real `flows.run_setup.open_run` (what a Prefect
Retry of the training flow runs), and through the `dapo` CLI's preflight. Nothing of the holder's run may
change.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dapo_core.config import load_config, typed
from dapo_core.store import lease as L
from tests.helpers import in_process_run_overrides

ROOT = Path(__file__).resolve().parents[2]

HOLDER = textwrap.dedent(
    """
    import sys, time
    from dapo_core.store.lease import acquire
    lease = acquire(sys.argv[1], timeout_s=float(sys.argv[2]), flow_run_id="flow-run-of-the-first")
    lease.start_heartbeat()
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Start a process holding the lease of tmp_path/runs/r1 (a run with one committed file); yield it."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n')  # the first run's data (a stand-in)
    procs = []

    def start(timeout_s: float = 120.0) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run), str(timeout_s)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        return p

    yield run, start
    for p in procs:
        p.kill()
        p.wait()


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run but the lease (whose heartbeat the holder rewrites)."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != L.LEASE_FILE
    }


def test_a_second_writer_is_refused_naming_the_holder(holder):
    run, start = holder
    p = start()
    before = snapshot(run)
    with pytest.raises(L.LeaseHeld) as err:
        L.acquire(run, timeout_s=120)
    msg = str(err.value)
    assert f"pid {p.pid}" in msg and socket.gethostname() in msg and "flow-run-of-the-first" in msg
    assert "trainer.lease_timeout_s" in msg and "experiment_name" in msg
    assert snapshot(run) == before
    assert L.read_holder(run).pid == p.pid  # the holder still holds it
    assert not [f for f in run.iterdir() if f.name.startswith(".lease")]  # no temporary file left behind


def test_a_dead_holder_on_this_host_is_taken_over_at_once_and_logged(holder, caplog):
    run, start = holder
    p = start()
    p.kill()
    p.wait()
    with caplog.at_level("WARNING"):
        lease = L.acquire(run, timeout_s=120)
    assert f"pid {p.pid}" in lease.took_over and "is gone" in lease.took_over
    assert "took over" in caplog.text
    assert L.read_holder(run).pid == os.getpid()
    lease.release()
    assert L.read_holder(run) is None


def test_a_remote_holder_is_live_until_its_heartbeat_is_older_than_the_timeout(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    now = time.time()
    fresh = L.Holder("gpu-node-7", 4242, 0.0, "", "abc", now - 30, now - 5)
    (run / L.LEASE_FILE).write_text(json.dumps(fresh.__dict__))
    with pytest.raises(L.LeaseHeld, match="gpu-node-7 pid 4242"):
        L.acquire(run, timeout_s=60)
    stale = L.Holder("gpu-node-7", 4242, 0.0, "", "abc", now - 300, now - 90)
    (run / L.LEASE_FILE).write_text(json.dumps(stale.__dict__))
    lease = L.acquire(run, timeout_s=60)
    assert "heartbeat is 90 s old" in lease.took_over
    lease.release()


def test_a_half_written_lease_file_is_stale(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / L.LEASE_FILE).write_text('{"host": "x", "pi')
    lease = L.acquire(run, timeout_s=60)
    assert "unreadable" in lease.took_over
    lease.release()


def test_the_heartbeat_advances_and_a_holder_whose_lease_was_taken_stops(tmp_path):
    run = tmp_path / "r"
    lost = []
    lease = L.acquire(run, timeout_s=1.6, on_lost=lambda: lost.append(1))  # beats every 0.2 s
    first = L.read_holder(run).heartbeat
    lease.start_heartbeat()
    deadline = time.monotonic() + 60
    while L.read_holder(run).heartbeat == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert L.read_holder(run).heartbeat > first
    # Another host took it over (this holder looked dead to it): the heartbeat thread notices and stops.
    now = time.time()
    other = L.Holder("other-host", 1, 0.0, "", "theirs", now, now)
    (run / L.LEASE_FILE).write_text(json.dumps(other.__dict__))
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and lease.lost
    lease.release()
    assert L.read_holder(run).token == "theirs"  # released without removing the new holder's lease


def test_the_same_process_cannot_open_a_run_twice(tmp_path):
    lease = L.acquire(tmp_path / "r", timeout_s=60)
    with pytest.raises(L.LeaseHeld):
        L.acquire(tmp_path / "r", timeout_s=60)
    lease.release()
    L.acquire(tmp_path / "r", timeout_s=60).release()


def test_a_retried_flow_run_while_the_holder_lives_is_refused_by_open_run(holder, tmp_path):
    """A Prefect Retry runs the training flow again with the same run id: `open_run` refuses it before it
    opens the store or starts a worker, and with `trainer.lease_wait_s` it waits for the holder."""
    from flows.run_setup import close_run, open_run

    run, start = holder
    p = start()
    before = snapshot(run)
    assets = tmp_path / "assets"
    assets.mkdir()
    overrides = [*in_process_run_overrides(assets), f"trainer.runs_dir={run.parent}"]
    cfg = typed(load_config("configs/tiny_cpu.yaml", overrides))
    with pytest.raises(L.LeaseHeld, match=f"pid {p.pid}"):
        open_run(cfg, "r1")
    assert snapshot(run) == before
    # Waiting: the holder ends while the retry waits, and the retry then opens the run.
    cfg.trainer.lease_wait_s = 600
    killer = subprocess.Popen([sys.executable, "-c", f"import os,time; time.sleep(2); os.kill({p.pid}, 9)"])
    rt = open_run(cfg, "r1")
    try:
        assert L.read_holder(run).pid == os.getpid()
    finally:
        close_run(rt)
        killer.wait()
    assert L.read_holder(run) is None  # close_run gives the lease back


def test_the_cli_refuses_a_second_train_before_prefect_starts(holder, tmp_path, capsys):
    from flows.cli import main

    run, start = holder
    p = start()
    before = snapshot(run)
    code = main(["train", "--flow-only", f"trainer.runs_dir={run.parent}", "trainer.experiment_name=r1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"pid {p.pid}" in err and "Traceback" not in err and "Prefect server" not in err
    assert snapshot(run) == before
