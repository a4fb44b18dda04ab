"""Stopping the temporary Prefect server mid-flush is quiet: a program runs a flow of small tasks against the
server `flows.progress.start_local_prefect` starts, and exits while the server's task-run recorder is inside
a flush (made slow by a `sitecustomize` loaded only by the server process, standing in for a loaded
machine). Prefect then logs "Error flushing N events" with a `CancelledError` traceback (with Prefect's own
stop, on the console); none of it may reach the console (it goes to the shutdown log), and the program
exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # real CLI processes with a temporary Prefect server each

SLOW_FLUSH = textwrap.dedent(
    """
    import os
    if os.environ.get("PREFECT__SERVER_EPHEMERAL") == "1" and os.environ.get("FLUSH_MARKER"):
        import asyncio
        import prefect.server.services.task_run_recorder as recorder
        _record = recorder.record_bulk_task_run_events

        async def slow(events):
            with open(os.environ["FLUSH_MARKER"], "a") as f:
                f.write(f"flush {len(events)}\\n")
            await asyncio.sleep(4)
            return await _record(events)

        recorder.record_bulk_task_run_events = slow
    """
)

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from flows.progress import prefect_console_env, start_local_prefect

    prefect_console_env()  # as the CLI does: no usage-data heartbeat
    from prefect import flow, task

    start_local_prefect("test")

    @task
    def one(i):
        return i

    @flow
    def many():
        return [one(i) for i in range(12)]

    many()
    deadline = time.monotonic() + 300
    while not os.path.exists(os.environ["FLUSH_MARKER"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = os.path.exists(os.environ["FLUSH_MARKER"])
    print("exiting during a flush" if seen else "no flush seen", flush=True)
    """
)


def test_stopping_the_server_mid_flush_prints_no_traceback(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_FLUSH)
    marker = tmp_path / "flushing"
    drop = ("PREFECT_API_URL", "PREFECT_LOGGING_LEVEL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        {
            "PYTHONPATH": f"{ROOT}{os.pathsep}{site}",
            "PREFECT_HOME": str(tmp_path / "home"),
            "FLUSH_MARKER": str(marker),
            "TMPDIR": str(tmp_path),
        }
    )
    r = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "exiting during a flush" in out, out  # the stop really came mid-flush
    assert "Traceback" not in out and "Error flushing" not in out and "CancelledError" not in out, out
    # What the stopping server printed went to the shutdown log: the interrupted flush of a loaded machine.
    kept = "".join(p.read_text() for p in (tmp_path / "dapo-errors").glob("prefect-server-stop-*.log"))
    assert "Error flushing" in kept, kept
