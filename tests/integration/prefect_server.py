"""A real Prefect server for integration tests (`prefect server start` on a free loopback port), and the
stopping helper the tests around it share."""

from __future__ import annotations

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


@contextmanager
def prefect_server(home: Path, **env: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Start `prefect server start` with PREFECT_HOME=`home` on a free loopback port; yields the API URL and
    the environment (with PREFECT_API_URL and `env`) that clients of this server should use."""
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
    proc = subprocess.Popen(
        [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: healthy(api), f"the Prefect server at {api} to answer /health", 180, 0.5, alive=proc)
        yield api, full
    finally:
        stop(proc)
