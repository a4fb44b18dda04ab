"""Stopping the temporary Prefect server during a flush is quiet: a program runs a flow of small tasks against
the server `flows.progress.start_local_prefect` starts, and exits once the server's task-run recorder has
begun a flush (made slow by a `sitecustomize` loaded only by the server process, standing in for a loaded
machine). Either the stop interrupts the flush (Prefect logs "Error flushing N events" with a
`CancelledError` traceback: it must go to the shutdown log, never to the console) or the flush drains in
time; either way the console has no traceback, the server process is gone and the program exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import wait_for

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
            await asyncio.sleep(4)  # the slow flush itself (a loaded machine), the behaviour under test
            return await _record(events)

        recorder.record_bulk_task_run_events = slow
    """
)

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from flows.progress import prefect_console_env, start_local_prefect

    prefect_console_env()  # as the CLI does: no usage-data heartbeat
    from prefect import flow, task

    url = start_local_prefect("test")
    me = str(os.getpid())
    servers = [p.parent.name for p in Path("/proc").glob("[0-9]*/stat")
               if p.read_text().rsplit(")", 1)[-1].split()[1] == me
               and b"uvicorn" in (p.parent / "cmdline").read_bytes()]
    print(f"server {url} pids {','.join(servers)}", flush=True)

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
    print("exiting after a flush began" if seen else "no flush seen", flush=True)
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
    assert "exiting after a flush began" in out, out  # the stop came while the recorder had work
    assert "Traceback" not in out and "Error flushing" not in out and "CancelledError" not in out, out
    # The server stopped with the program: its process is gone and its port no longer answers.
    found = re.search(r"server (\S+) pids (\S+)", out)
    assert found, out
    url, pids = found.group(1), [int(p) for p in found.group(2).split(",")]
    wait_for(lambda: not any(_running(p) for p in pids), f"the server processes {pids} to exit", 30, 0.2)
    assert not _answers(url), f"{url} still answers"
    # An interrupted flush (a loaded machine) went to the shutdown log; a drained one left nothing to say.
    kept = "".join(p.read_text() for p in (tmp_path / "dapo-errors").glob("prefect-server-stop-*.log"))
    interrupted = "Error flushing" in kept
    print(f"recorder flush at stop: {'interrupted (in the shutdown log)' if interrupted else 'drained'}")


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _answers(url: str) -> bool:
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=3)
    except httpx.HTTPError:
        return False
    return True
