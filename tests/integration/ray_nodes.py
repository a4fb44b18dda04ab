"""Ray nodes on this machine for multi-node tests: `RayNode`, one `ray start --block` process in its own
session, temp dir and free ports; `node_env`, the environment of a fresh cluster node; `ray_nodes`, a temp
dir whose nodes are stopped on exit; `start_head`, a head node in one.

Nodes are stopped by killing exactly their sessions (every Ray process a node starts inherits its session,
Ray's worker processes and job drivers included): `ray stop` would kill every Ray of this user on the
machine, other tests' too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dapo_core.compute.host import QUIET_WORKER_ENV
from tests.helpers import wait_for

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def session_pids(sid: int) -> list[int]:
    """Processes whose session id is `sid` (field 6 of /proc/<pid>/stat)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def kill_sessions(sids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM every process of the sessions `sids`, then SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for sid in sids:
            for pid in session_pids(sid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.time() + wait_s
        while time.time() < deadline and any(session_pids(sid) for sid in sids):
            time.sleep(0.2)


def node_env(**extra: str) -> dict[str, str]:
    """This process's environment as a fresh cluster node's: token auth with a new token (Ray 2.60's default
    for clusters; nodes and drivers share it), no RAY_ADDRESS, no loopback-only flag (a local Ray started
    earlier in this process sets it, and it refuses a second node), none of the quiet-worker variables (the
    driver cannot quiet a node's workers by its env), one thread; then `extra`."""
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "OMP_NUM_THREADS": "1",
    }
    for key in (
        "RAY_ADDRESS",
        "RAY_API_SERVER_ADDRESS",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
        *QUIET_WORKER_ENV,
    ):
        env.pop(key, None)
    env.update(extra)
    return env


def last_error(log: str) -> str:
    """The last line of `log` that names an exception or error (what a `ray start` traceback ends with), or
    its last non-empty line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or "timed out" in line:
            return line
    return lines[-1] if lines else "(empty log)"


class RayNode:
    """One `ray start --block` node in its own session, temp dir and ports. `wrap`: a command prefix the
    node runs under (e.g. `unshare -m ...`)."""

    def __init__(self, tmp: Path, name: str, env: dict, args: list[str], wrap: list[str] | None = None):
        self.log = tmp / f"{name}.log"
        self._start = (tmp, name, env, args, wrap)
        self._launch()

    def _launch(self) -> None:
        tmp, name, env, args, wrap = self._start
        node_args = [
            f"--temp-dir={tmp / name}",
            "--object-store-memory=200000000",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*(wrap or []), RAY, "start", "--block", *args, *node_args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_started(self, timeout_s: float = 180.0, attempts: int = 3) -> None:
        """Wait until the node logs that it runs. A node whose `ray start` exits first is started again, up
        to `attempts` starts within `timeout_s`: on a loaded machine Ray's own fixed waits run out (the
        raylet's 30 s to register with the GCS, the worker node's version check against a GCS that answers
        late), and a port picked free can be taken before the node binds it. The failure names the last
        error line first, then the log's end."""
        starts = [1]

        def started() -> bool:
            text = self.log.read_text(errors="replace")
            if "Ray runtime started" in text:
                return True
            if self.proc.poll() is None:
                return False
            if starts[0] < attempts:
                starts[0] += 1
                kill_sessions([self.proc.pid], grace_s=1.0)
                note = f"\n--- ray start exited ({last_error(text)}); start {starts[0]} of {attempts}\n"
                with self.log.open("a") as out:
                    out.write(note)
                self._launch()
                return False
            name = self.log.stem
            raise AssertionError(f"ray node {name} exited {attempts} times, last: {last_error(text)}")

        try:
            wait_for(started, f"ray node {self.log.stem} to log 'Ray runtime started'", timeout_s, 0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log.read_text(errors='replace')[-3000:]}") from None

    @staticmethod
    def stop_all(nodes: list[RayNode]) -> None:
        kill_sessions([node.proc.pid for node in nodes])
        for node in nodes:
            node.proc.wait(timeout=10)


def start_head(tmp: Path, nodes: list[RayNode], env: dict, *args: str, num_cpus: int = 3) -> str:
    """Start a head node in `tmp` (its own GCS and client-server ports, no usage stats, no dashboard unless
    `args` ask for one, then `args`), add it to `nodes`, wait until it runs; its address
    `127.0.0.1:<port>`."""
    port = free_port()
    asked = any(a.startswith("--include-dashboard") for a in args)
    dashboard = [] if asked else ["--include-dashboard=false"]
    head = RayNode(
        tmp,
        "head",
        env,
        [
            "--head",
            f"--port={port}",
            f"--ray-client-server-port={free_port()}",
            "--disable-usage-stats",
            f"--num-cpus={num_cpus}",
            *dashboard,
            *args,
        ],
    )
    nodes.append(head)
    head.wait_started()
    return f"127.0.0.1:{port}"


@contextlib.contextmanager
def ray_nodes(prefix: str) -> Iterator[tuple[Path, list[RayNode]]]:
    """A temp dir under /tmp (short: Ray's socket paths have a length limit) and a list to add `RayNode`s
    to; on exit every node in the list is stopped and the dir removed."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    nodes: list[RayNode] = []
    try:
        yield tmp, nodes
    finally:
        RayNode.stop_all(nodes)
        shutil.rmtree(tmp, ignore_errors=True)
