"""The run lease: one writer per run store, also across hosts on a shared file system.

`runs/<run_id>/lease.json` names the holder (host, pid, the process's start time, flow-run id, a random
token) and its last heartbeat (wall-clock seconds). It is created with `os.link` of a finished temporary file,
which fails when the name exists: an atomic exclusive create on local disks and on NFS (where `flock` may be
unsupported or emulated per client, so locks alone are not trusted). The holder rewrites it every
`heartbeat_s` from a thread (temporary file + `os.replace`). A lease is stale when its holder's process is
gone (same host: pid missing or started at another time) or its heartbeat is older than `timeout_s`
(`trainer.lease_timeout_s`; hosts' clocks must agree to well within it). A stale lease is taken over (moved
aside under a unique name, re-checked, then created anew) and the takeover is logged; a live one is refused
with a `LeaseHeld` paragraph naming the holder, after waiting up to `wait_s` for it to go. A holder that finds
its lease taken (it was frozen past the timeout) stops its heartbeat and calls `on_lost`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dapo_core.errors import DapoUserError

__all__ = ["LEASE_FILE", "Holder", "Lease", "LeaseHeld", "LeaseLost", "acquire", "check_free", "read_holder"]

LEASE_FILE = "lease.json"
"""The lease's file name inside the run folder."""

log = logging.getLogger(__name__)


class LeaseHeld(DapoUserError):
    """Another live process holds the run's lease."""


class LeaseLost(RuntimeError):
    """This process's lease was taken over by another one (its heartbeat had gone stale)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as written in lease.json."""

    host: str
    pid: int
    started: float
    """The holder process's start time (seconds since boot, from /proc; 0 when unknown)."""
    flow_run_id: str
    token: str
    acquired: float
    heartbeat: float

    def describe(self, now: float) -> str:
        """One sentence fragment naming the holder and its heartbeat age."""
        flow = f", Prefect flow run {self.flow_run_id}" if self.flow_run_id else ""
        age = max(0.0, now - self.heartbeat)
        return f"host {self.host} pid {self.pid}{flow} (last heartbeat {age:.0f} s ago)"


def _proc_start(pid: int) -> float:
    """Start time of `pid` in seconds since boot (/proc/<pid>/stat field 22); 0.0 when unknown, -1.0 for a
    zombie (exited, not yet reaped by its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return -1.0
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _alive_here(h: Holder) -> bool:
    """Whether the holder's process (on this host) still runs: the pid exists and started when it did."""
    try:
        os.kill(h.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    now_start = _proc_start(h.pid)
    if now_start < 0:
        return False
    return not (h.started and now_start and abs(now_start - h.started) > 0.5)


def read_holder(run_dir: Path) -> Holder | None:
    """The lease's holder, or None when there is no lease (an unreadable file counts as a stale holder)."""
    return _read(run_dir / LEASE_FILE)


def _read(path: Path) -> Holder | None:
    try:
        d = json.loads(path.read_text())
        return Holder(**{k: d[k] for k in Holder.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return Holder("?", -1, 0.0, "", "unreadable", 0.0, 0.0)  # half-written by a crashed holder: stale


def stale_reason(h: Holder, timeout_s: float, now: float | None = None) -> str | None:
    """Why the lease of `h` may be taken over, or None when its holder counts as alive."""
    now = time.time() if now is None else now
    if h.token == "unreadable":
        return "the lease file is unreadable (a holder crashed while writing it)"
    if h.host == socket.gethostname() and not _alive_here(h):
        return f"its holder (pid {h.pid} on this host) is gone"
    if now - h.heartbeat > timeout_s:
        return f"its heartbeat is {now - h.heartbeat:.0f} s old (trainer.lease_timeout_s={timeout_s:g})"
    return None


def _held_error(run_dir: Path, h: Holder, timeout_s: float) -> LeaseHeld:
    now = time.time()
    return LeaseHeld(
        f"run {run_dir.name} is being written by another process: {h.describe(now)}; two writers would "
        "overwrite each other's stage files",
        where=str(run_dir / LEASE_FILE),
        fix=f"wait for that run to finish or stop it (`kill {h.pid}` on {h.host}, or cancel its flow run); a "
        f"holder that stopped heartbeating is taken over automatically {timeout_s:g} s after its last "
        "heartbeat (trainer.lease_timeout_s); to train beside it, choose another trainer.experiment_name",
    )


def check_free(run_dir: str | Path, timeout_s: float) -> None:
    """Raise `LeaseHeld` when a live process holds the lease of `run_dir` (read only; for the preflight)."""
    run_dir = Path(run_dir)
    h = read_holder(run_dir)
    if h is not None and stale_reason(h, timeout_s) is None:
        raise _held_error(run_dir, h, timeout_s)


class Lease:
    """A held lease: `start_heartbeat()` keeps it alive from a thread, `release()` gives it back."""

    def __init__(self, run_dir: Path, holder: Holder, heartbeat_s: float, on_lost: Callable[[], None] | None):
        self.run_dir = run_dir
        self.holder = holder
        self.heartbeat_s = heartbeat_s
        self.on_lost = on_lost
        self.lost = False
        self.took_over = ""
        """What was taken over ("taking over ... from ...: why"), empty when the lease was free."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        """The lease file."""
        return self.run_dir / LEASE_FILE

    def still_mine(self) -> bool:
        """Whether lease.json still carries this lease's token."""
        h = read_holder(self.run_dir)
        return h is not None and h.token == self.holder.token

    def beat(self) -> bool:
        """Rewrite the heartbeat (atomically); False, and `lost` set, when the lease is no longer ours."""
        if not self.still_mine():
            self.lost = True
            return False
        self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
        _write(self.path, self.holder, replace=True)
        return True

    def start_heartbeat(self) -> None:
        """Beat every `heartbeat_s` from a daemon thread until `release()`."""

        def loop() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    ok = self.beat()
                except OSError as e:  # a file-system hiccup: try again next beat
                    log.warning("run lease %s: heartbeat failed (%s)", self.path, e)
                    continue
                if not ok:
                    log.error(
                        "run lease %s was taken over by another process (%s); this process stops writing",
                        self.path,
                        read_holder(self.run_dir),
                    )
                    if self.on_lost is not None:
                        self.on_lost()
                    return

        self._thread = threading.Thread(target=loop, name=f"lease-{self.run_dir.name}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lease file if it is still ours."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        _HELD.discard(str(self.run_dir.resolve()))
        if self.still_mine():
            self.path.unlink(missing_ok=True)


_HELD: set[str] = set()
"""Run folders this process holds a lease on (a second open in the same process is refused too)."""


def _write(path: Path, holder: Holder, *, replace: bool) -> None:
    """Write `holder` to a temporary file beside `path`, fsync it, then link it in (exclusive) or replace."""
    tmp = path.with_name(f".{path.name}.{holder.token}.{secrets.token_hex(4)}")
    try:
        with tmp.open("x") as f:
            json.dump(asdict(holder), f)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # FileExistsError when another process holds it
    finally:
        tmp.unlink(missing_ok=True)


def acquire(
    run_dir: str | Path,
    *,
    timeout_s: float = 120.0,
    wait_s: float = 0.0,
    flow_run_id: str = "",
    on_lost: Callable[[], None] | None = None,
    poll_s: float = 1.0,
) -> Lease:
    """Take the lease of `run_dir` (created if missing): at once when free or stale, else wait up to `wait_s`
    for the holder to release it or go stale, then raise `LeaseHeld`. The heartbeat is not started here."""
    if timeout_s <= 0:
        raise DapoUserError(
            f"trainer.lease_timeout_s={timeout_s} must be > 0", fix="set it to e.g. 120 (seconds)"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = str(run_dir.resolve())
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        held = read_holder(run_dir)
        if key in _HELD and held is not None:
            raise _held_error(run_dir, held, timeout_s)
        now = time.time()
        me = Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=_proc_start(os.getpid()),
            flow_run_id=flow_run_id,
            token=secrets.token_hex(8),
            acquired=now,
            heartbeat=now,
        )
        took_over = ""
        if held is not None:
            why = stale_reason(held, timeout_s, now)
            if why is not None and _move_aside(run_dir, held):
                took_over = f"took over the run lease {run_dir / LEASE_FILE} from {held.describe(now)}: {why}"
                log.warning("%s", took_over)
        try:
            _write(run_dir / LEASE_FILE, me, replace=False)
        except FileExistsError:
            if time.monotonic() >= deadline:
                current = read_holder(run_dir) or held
                if current is None:
                    continue
                raise _held_error(run_dir, current, timeout_s) from None
            time.sleep(poll_s)
            continue
        _HELD.add(key)
        lease = Lease(run_dir, me, heartbeat_s=max(0.2, timeout_s / 8), on_lost=on_lost)
        lease.took_over = took_over
        return lease


def _move_aside(run_dir: Path, stale: Holder) -> bool:
    """Rename the stale lease to a unique name; True when what was moved is the lease judged stale (else put
    it back: another process took over in between)."""
    aside = run_dir / f".{LEASE_FILE}.stale.{secrets.token_hex(4)}"
    try:
        os.rename(run_dir / LEASE_FILE, aside)
    except FileNotFoundError:
        return False  # another process moved it first
    moved = _read(aside)
    if moved is not None and moved.token != stale.token:
        with contextlib.suppress(FileExistsError):
            os.link(aside, run_dir / LEASE_FILE)  # a fresh lease: give it back
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True
