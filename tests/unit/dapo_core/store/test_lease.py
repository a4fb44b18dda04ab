"""The run lease (`dapo_core.store.lease`): one writer per run.

Holders are real processes (a `python -c` child that takes the lease and heartbeats); the second writer is
this test's process, through the lease API and through the real `flows.run_setup.open_run` (what a Prefect
Retry of the training flow runs), and through the `dapo` CLI's preflight. Nothing of the holder's run may
change.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dapo_core.config import load_config, typed
from dapo_core.store import lease as L
from tests.helpers import in_process_run_overrides, wait_for

ROOT = Path(__file__).resolve().parents[4]

HOLDER = textwrap.dedent(
    """
    import sys, time
    from dapo_core.store.lease import acquire
    lease = acquire(sys.argv[1], timeout_s=float(sys.argv[2]), flow_run_id="flow-run-of-the-first")
    lease.start_heartbeat()
    print("held", flush=True)
    time.sleep(600)  # a live holder: it holds (and beats) until the test kills it
    """
)


def _readline(p: subprocess.Popen, timeout_s: float = 120.0) -> str:
    """The child's next stdout line, or fail after `timeout_s` (a child that hangs or dies says so)."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    assert ready, f"no line from pid {p.pid} within {timeout_s:g} s (exit code {p.poll()})"
    return p.stdout.readline()


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
        assert _readline(p).strip() == "held"
        return p

    yield run, start
    for p in procs:
        p.kill()
        p.wait(timeout=60)


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
    p.wait(timeout=60)
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
    wait_for(lambda: L.read_holder(run).heartbeat != first, "the heartbeat to rewrite the lease", 60)
    assert L.read_holder(run).heartbeat > first
    # Another host took it over (this holder looked dead to it): the heartbeat thread notices and stops.
    now = time.time()
    other = L.Holder("other-host", 1, 0.0, "", "theirs", now, now)
    (run / L.LEASE_FILE).write_text(json.dumps(other.__dict__))
    wait_for(lambda: lost, "the heartbeat thread to notice the takeover and call on_lost", 60)
    assert lost and lease.lost
    lease.release()
    assert L.read_holder(run).token == "theirs"  # released without removing the new holder's lease


def test_the_same_process_cannot_open_a_run_twice(tmp_path):
    lease = L.acquire(tmp_path / "r", timeout_s=60)
    with pytest.raises(L.LeaseHeld):
        L.acquire(tmp_path / "r", timeout_s=60)
    lease.release()
    L.acquire(tmp_path / "r", timeout_s=60).release()


def test_a_retried_flow_run_while_the_holder_lives_is_refused_by_open_run(holder, tmp_path, monkeypatch):
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
    # Waiting: the holder ends while the retry waits, and the retry then opens the run. The holder is killed
    # once `acquire` has found it live and sleeps between its looks (the lease module's only `time.sleep`).
    cfg.trainer.lease_wait_s = 120
    waiting = threading.Event()

    class _SpyTime:
        def __getattr__(self, name: str):
            return getattr(time, name)

        @staticmethod
        def sleep(s: float) -> None:
            waiting.set()
            time.sleep(s)

    def kill_the_holder_once_waited_for() -> None:
        if waiting.wait(timeout=120):
            p.kill()

    monkeypatch.setattr(L, "time", _SpyTime())
    killer = threading.Thread(target=kill_the_holder_once_waited_for, daemon=True)
    killer.start()
    rt = open_run(cfg, "r1")
    try:
        assert waiting.is_set(), "open_run took the lease without waiting for the live holder"
        assert L.read_holder(run).pid == os.getpid()
    finally:
        close_run(rt)
        killer.join(timeout=60)
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


# ------------------------------------------------------------------------------------ races of a beat
class _StrikeOs:
    """`os` for the lease module, running `strike()` once, just before its `n`-th rename / link / replace:
    another process acting at that instant of a beat or a release."""

    def __init__(self, n: int, strike) -> None:
        self.n, self.strike, self.calls = n, strike, 0

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if name not in ("rename", "link", "replace"):
            return real

        def op(*args, **kwargs):
            self.calls += 1
            if self.calls == self.n:
                self.strike()
            return real(*args, **kwargs)

        return op


def _taker(run: Path, monkeypatch) -> list:
    """A strike that takes the lease over as another process would (it judges the holder stale)."""
    got: list = []

    def strike() -> None:
        with monkeypatch.context() as m:
            m.setattr(L, "os", os)  # the taker's own calls are not struck
            m.setattr(L, "_HELD", set())  # another process: it holds nothing of this one's
            got.append(L.acquire(run, timeout_s=1e-6))

    return got, strike


@pytest.mark.parametrize("n", [1, 2])
def test_a_takeover_in_the_middle_of_a_beat_is_never_overwritten(tmp_path, monkeypatch, n):
    """Whenever the taker strikes (before the beat's first or second file operation), afterwards exactly one
    process holds the lease: the taker's token is in lease.json, and the beat raised `LeaseLost`."""
    run = tmp_path / "r"
    lease = L.acquire(run, timeout_s=60)
    got, strike = _taker(run, monkeypatch)
    monkeypatch.setattr(L, "os", _StrikeOs(n, strike))
    with pytest.raises(L.LeaseLost) as lost:
        lease.beat()
    monkeypatch.setattr(L, "os", os)
    assert got, "the taker did not strike"
    assert L.read_holder(run).token == got[0].holder.token
    assert lease.lost and "lost its lease" in str(lost.value) and "trainer.lease_timeout_s" in str(lost.value)
    lease.release()  # must not remove the taker's lease
    assert L.read_holder(run).token == got[0].holder.token
    assert [f.name for f in run.iterdir()] == [L.LEASE_FILE]  # nothing left aside


def test_a_release_racing_a_takeover_keeps_the_takers_lease(tmp_path, monkeypatch):
    run = tmp_path / "r"
    lease = L.acquire(run, timeout_s=60)
    got, strike = _taker(run, monkeypatch)
    monkeypatch.setattr(L, "os", _StrikeOs(1, strike))
    lease.release()
    monkeypatch.setattr(L, "os", os)
    assert got and L.read_holder(run).token == got[0].holder.token


def test_while_a_beat_has_the_lease_aside_it_is_still_held(tmp_path, monkeypatch):
    """Between moving lease.json aside and linking the renewed one in, a second writer is refused (it reads
    the aside file) and the preflight's read-only check says the same."""
    run = tmp_path / "r"
    lease = L.acquire(run, timeout_s=60)
    seen: list = []

    def strike() -> None:
        assert not (run / L.LEASE_FILE).exists()
        seen.append(L.read_holder(run))
        with pytest.raises(L.LeaseHeld):
            L.check_free(run, 60)
        with monkeypatch.context() as m:
            m.setattr(L, "os", os)
            m.setattr(L, "_HELD", set())
            with pytest.raises(L.LeaseHeld, match=f"pid {os.getpid()}"):
                L.acquire(run, timeout_s=60)

    monkeypatch.setattr(L, "os", _StrikeOs(2, strike))  # rename aside (1), then before the link (2)
    lease.beat()
    monkeypatch.setattr(L, "os", os)
    assert seen and seen[0].token == lease.holder.token
    assert L.read_holder(run) == lease.holder  # renewed
    lease.release()


def test_a_holder_that_died_in_the_middle_of_a_beat_is_taken_over(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    dead = L.Holder(socket.gethostname(), 2**22 + 7, 1.0, "", "dead", time.time(), time.time())
    (run / f".{L.LEASE_FILE}.aside.0a1b").write_text(json.dumps(dead.__dict__))
    assert L.read_holder(run).token == "dead"
    lease = L.acquire(run, timeout_s=60)
    assert "is gone" in lease.took_over and not (run / f".{L.LEASE_FILE}.aside.0a1b").exists()
    lease.release()


def test_check_raises_lease_lost_and_the_cli_ends_with_its_paragraph(tmp_path, capsys):
    """`Lease.check` and the heartbeat raise `LeaseLost`; the training flow's interrupt of its main thread
    becomes that `LeaseLost` under the CLI's signal handler, and the CLI prints its paragraph (exit 2)."""
    import _thread

    from flows.run_guard import report_stop, stop_on_signals

    run = tmp_path / "r1"
    lease = L.acquire(run, timeout_s=0.8, on_lost=_thread.interrupt_main)  # beats every 0.2 s
    lease.check()
    now = time.time()
    theirs = L.Holder("gpu-node-9", 77, 0.0, "flow-2", "theirs", now, now)
    (run / L.LEASE_FILE).write_text(json.dumps(theirs.__dict__))
    with pytest.raises(L.LeaseLost, match="gpu-node-9 pid 77"):
        lease.check()

    def run_until_interrupted() -> None:
        with stop_on_signals():
            lease.start_heartbeat()
            wait_for(lambda: False, "the heartbeat to find the lease taken and interrupt this thread", 60)

    with pytest.raises(L.LeaseLost) as stopped:
        run_until_interrupted()
    assert stopped.value.now_holder == theirs
    assert report_stop(stopped.value, "train", resume="dapo train ...") == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "dapo train: run r1: this process lost its lease (now held by host gpu-node-9 pid 77"
    )
    assert "Fix:" in err and "Resume with" not in err and len(err.strip().splitlines()) == 1
    lease.release()
    assert L.read_holder(run) == theirs
