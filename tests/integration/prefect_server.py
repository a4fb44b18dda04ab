"""A real Prefect server for integration tests (`prefect server start` on a free loopback port): one a test
starts for itself (`prefect_server`), or the one server the whole test run shares (`shared_prefect_server`,
stopped at the end of the run by `stop_shared_prefect_server`); and the stopping helper the tests around
them share."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import wait_for

PREFECT = Path(sys.executable).parent / "prefect"

SHARED_SERVER_SERVICES_OFF: dict[str, str] = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in (
        "CANCELLATION_CLEANUP",  # unfinished tasks and subflows of cancelled runs
        "EVENT_LOGGER",  # events echoed to the server's log (off by Prefect's default too)
        "FOREMAN",  # work pools' and workers' health
        "LATE_RUNS",  # scheduled runs that did not start in time
        "SCHEDULER",  # deployments' schedules
        "PAUSE_EXPIRATIONS",  # paused runs whose pause timed out
        "REPOSSESSOR",  # expired concurrency-slot leases
        "CLEANUP_RECONCILER",  # expired leases of the workers' cleanup queue
        "TRIGGERS",  # automations (reactive, proactive) and their actions
    )
}
"""The server loop services the shared test server (`shared_prefect_server`) runs without. Its clients run
flows directly: no deployment, schedule, work pool, worker, automation, pause, cancellation or concurrency
limit, so none of these services has work there, while each wakes up every few seconds and costs CPU the
tests need. It keeps the
task-run recorder (task runs in the API, from their events) and the event persister (the events API). The
database vacuum is not listed: Prefect reads `false` for it as its default (vacuum old events, once an
hour). A test that needs one of these services starts its own server with `prefect_server`, which keeps
Prefect's defaults."""

SHARED_RECORD = "prefect-server.json"
"""The file, in the folder shared by the test run, that records the shared server: its API URL, PREFECT_HOME,
process id and that process's start time."""

_SERVE_WHILE_OWNER_RUNS = """\
import os, select, signal, sys, threading, time

def watch(owner):
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:
        pass  # the owner is gone already
    except OSError:
        return  # no pidfd on this system: the server runs until it is stopped
    else:
        select.select([fd], [], [])  # readable once the owner has exited
    # SIGTERM: uvicorn's graceful stop once it serves; before, the default action ends the process at once
    # (a SIGINT can be lost in the server's startup)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the graceful stop's deadline: a process still here then ends without one
    os._exit(1)

threading.Thread(target=watch, args=(int(sys.argv.pop(1)),), daemon=True).start()
sys.argv[0] = sys.argv.pop(1)
from prefect.cli import app
sys.exit(app())
"""
"""`python -c` program: `<owner pid> <argv[0]> server start ...` runs the `prefect` CLI, and stops it
(SIGTERM, then exit 30 s later if it still runs) once the process `owner pid` has exited."""


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(api: str) -> bool:
    """True when the Prefect API at `api` answers its health check."""
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """Stop a process started in its own session (and its children): `sig`, then SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(home: Path, env: dict[str, str], owner: int | None = None) -> tuple[subprocess.Popen, str, dict]:
    """Start `prefect server start` with PREFECT_HOME=`home` on a free loopback port, in its own session, and
    wait until it answers; with `owner`, it stops by itself once the process `owner` has exited. Returns the
    process, the API URL and the environment (with PREFECT_API_URL and `env`) that clients should use."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    full = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,  # the UI served here talks to this server, whatever else is set
        "PREFECT_SERVER_UI_V2_ENABLED": "false",  # its address opens the classic UI (infra/prefect_server.sh)
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    args = ["server", "start", "--host", "127.0.0.1", "--port", str(port)]
    if owner is None:
        cmd = [str(PREFECT), *args]
    else:
        cmd = [sys.executable, "-c", _SERVE_WHILE_OWNER_RUNS, str(owner), str(PREFECT), *args]
    proc = subprocess.Popen(
        cmd, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_for(lambda: healthy(api), f"the Prefect server at {api} to answer /health", 180, 0.5, alive=proc)
    except BaseException:
        stop(proc)
        raise
    return proc, api, full


@contextmanager
def prefect_server(home: Path, **env: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Start `prefect server start` with PREFECT_HOME=`home` on a free loopback port (Prefect's default
    services); yields the API URL and the environment (with PREFECT_API_URL and `env`) that clients of this
    server should use, and stops the server on exit."""
    proc, api, full = _start(home, env)
    try:
        yield api, full
    finally:
        stop(proc)


def shared_prefect_server(folder: Path, owner: int, **env: str) -> tuple[str, Path]:
    """The API URL and PREFECT_HOME of the one Prefect server of the test run, whose files live in `folder`
    (the folder every pytest-xdist worker shares): the first process to ask starts it, with
    PREFECT_HOME=`folder`/prefect_home and `env` in its environment, while the others wait on a file lock;
    all use the server it records in `SHARED_RECORD`. The server runs in its own session, so it outlives the
    process that started it; `stop_shared_prefect_server` stops it at the end of the run, and it stops by
    itself once the process `owner` (the one that runs the test session) has exited without stopping it (a
    killed run). A start that failed is not retried by the next process: it fails with the first one's
    error."""
    from filelock import FileLock

    record = folder / SHARED_RECORD
    failed = record.with_suffix(".failed")
    with FileLock(str(record) + ".lock"):
        if failed.exists():
            raise AssertionError(
                f"starting the shared Prefect server failed in another worker:\n{failed.read_text()}"
            )
        if not record.exists():
            home = folder / "prefect_home"
            home.mkdir(exist_ok=True)
            try:
                proc, api, _ = _start(home, env, owner)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-4000:])
                raise
            known = {"api": api, "home": str(home), "pid": proc.pid, "start": _stat(proc.pid)[19]}
            record.with_suffix(".tmp").write_text(json.dumps(known))
            record.with_suffix(".tmp").replace(record)  # whole or absent, for the reader at the end
    known = json.loads(record.read_text())
    api = known["api"]
    wait_for(
        lambda: healthy(api) or not _runs(known), f"the shared Prefect server at {api} to answer", 180, 0.5
    )
    assert _runs(known), f"the shared Prefect server at {api} (pid {known['pid']}) has exited"
    return api, Path(known["home"])


def stop_shared_prefect_server(folder: Path) -> None:
    """Stop the server `shared_prefect_server` recorded in `folder`, if there is one and its process still
    runs (the same process: its start time is checked): SIGINT to its process group, SIGKILL when the group
    has not exited 30 s later."""
    record = folder / SHARED_RECORD
    if not record.exists():
        return
    known = json.loads(record.read_text())
    if _runs(known):
        group = known["pid"]  # the server leads its own session and process group
        with contextlib.suppress(ProcessLookupError):  # it may have exited since
            os.killpg(group, signal.SIGINT)
            try:
                wait_for(
                    lambda: not _group_runs(group),
                    f"the shared Prefect server (pid {group}) to exit",
                    30,
                    0.1,
                )
            except AssertionError:
                os.killpg(group, signal.SIGKILL)
    record.unlink()


def _stat(pid: int) -> list[str]:
    """The fields of /proc/`pid`/stat after the command name (state, ppid, pgrp, ..., [19] the start time), or
    [] when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _live(fields: list[str]) -> bool:
    """Whether `_stat` fields are those of a running process (a zombie has exited)."""
    return bool(fields) and fields[0] not in ("Z", "X")


def _runs(known: dict) -> bool:
    """Whether the process a `SHARED_RECORD` names (its pid and start time) still runs."""
    fields = _stat(known["pid"])
    return _live(fields) and fields[19] == known["start"]


def _group_runs(group: int) -> bool:
    """Whether a process of process group `group` still runs."""
    return any(
        _live(fields) and fields[2] == str(group)
        for fields in (_stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit())
    )
