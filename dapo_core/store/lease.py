"""The run lease: one writer per run store, also across hosts on a shared file system.

`runs/<run_id>/lease.json` names the holder (host, pid, process start time, flow-run id, a random token) and
its last heartbeat. It is only created with `os.link` of a finished temporary file (an exclusive create, also
on NFS) and never overwritten: a heartbeat, a takeover or a release first renames it aside
(`.lease.json.aside.<hex>`: one rename wins), reads what it moved, then puts back a lease that is not its own
or links its own in (exclusive again). While lease.json is missing, readers take the live holder of an aside
file for it. The holder beats every `heartbeat_s` from a thread. A lease is stale when its holder's process
is gone (same host) or its heartbeat is older than `timeout_s` (`trainer.lease_timeout_s`; hosts' clocks
must agree to well within it): a stale one is taken over and the takeover logged, a live one refused with a
`LeaseHeld` paragraph after waiting up to `wait_s`. A holder whose lease was taken (it was frozen past the
timeout) learns it in `Lease.beat` / `Lease.check` (`LeaseLost`); the heartbeat thread then stops and calls
`on_lost`, and `lost_lease()` tells the main thread (the CLI's signal handler raises it).
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

from dapo_core.errors import DapoUserError, one_paragraph

__all__ = [
    "LEASE_FILE",
    "Holder",
    "Lease",
    "LeaseHeld",
    "LeaseLost",
    "acquire",
    "check_free",
    "forget_lost",
    "lost_lease",
    "read_holder",
]

LEASE_FILE = "lease.json"
"""The lease's file name inside the run folder."""

_ASIDE = f".{LEASE_FILE}.aside."
"""Prefix of a lease renamed aside while a process decides what to do with it (see the module docstring)."""

log = logging.getLogger(__name__)


class LeaseHeld(DapoUserError):
    """Another live process holds the run's lease."""


class LeaseLost(KeyboardInterrupt):
    """This process's lease was taken over by another one (its heartbeat had gone stale): stop writing.

    A `KeyboardInterrupt` (as `dapo_core.errors.StopRequested`), so that no `except Exception` block and no
    task retry goes on writing the run after it; `str()` is one paragraph naming the new holder and the
    fix."""

    def __init__(self, run_dir: Path, now_holder: Holder | None, timeout_s: float) -> None:
        self.run_dir = Path(run_dir)
        self.now_holder = now_holder
        who = (
            f"now held by {now_holder.describe(time.time())}"
            if now_holder is not None and now_holder.token != "unreadable"
            else "no longer carries this process's token"
        )
        self.what = (
            f"run {self.run_dir.name}: this process lost its lease ({who}), so it stopped writing the "
            f"run; its heartbeat had not been renewed within trainer.lease_timeout_s={timeout_s:g} (the "
            "process was frozen or its file system stalled) and another process took the run over"
        )
        self.where = str(self.run_dir / LEASE_FILE)
        self.fix = (
            "let the new holder finish (or stop it) and resume with the same trainer.experiment_name; raise "
            "trainer.lease_timeout_s if this host stalls that long"
        )
        super().__init__(self.what)

    def __str__(self) -> str:
        return one_paragraph(self.what, self.where, self.fix)


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


_UNREADABLE = Holder("?", -1, 0.0, "", "unreadable", 0.0, 0.0)
"""What a half-written or garbled lease file reads as (a crashed holder's: stale)."""


def _read(path: Path) -> Holder | None:
    try:
        d = json.loads(path.read_text())
        return Holder(**{k: d[k] for k in Holder.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return _UNREADABLE


def _current(run_dir: Path) -> tuple[Holder | None, Path | None]:
    """The lease and its file: lease.json, or while that is missing the aside file with the most recent
    heartbeat (a holder in the middle of a beat, a takeover or a release); (None, None) when there is none."""
    lease = run_dir / LEASE_FILE
    h = _read(lease)
    if h is not None:
        return h, lease
    best: tuple[Holder | None, Path | None] = (None, None)
    with contextlib.suppress(OSError):
        for p in run_dir.glob(f"{_ASIDE}*"):
            a = _read(p)
            if (
                a is not None
                and a is not _UNREADABLE
                and (best[0] is None or a.heartbeat > best[0].heartbeat)
            ):
                best = (a, p)
    return best


def read_holder(run_dir: Path) -> Holder | None:
    """The lease's holder, or None when there is no lease (an unreadable file counts as a stale holder)."""
    return _current(Path(run_dir))[0]


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


_LOST: list[LeaseLost] = []
"""Leases this process lost (recorded by the heartbeat thread, for the main thread: `lost_lease`)."""


def lost_lease() -> LeaseLost | None:
    """The first lease of this process that another process took over (since `forget_lost`), or None."""
    return _LOST[0] if _LOST else None


def forget_lost() -> None:
    """Forget the leases lost so far (a new command of a long-lived process starts afresh)."""
    _LOST.clear()


class Lease:
    """A held lease: `start_heartbeat()` keeps it alive from a thread, `check()` says whether it is still
    held, `release()` gives it back."""

    def __init__(
        self,
        run_dir: Path,
        holder: Holder,
        heartbeat_s: float,
        on_lost: Callable[[], None] | None,
        timeout_s: float = 120.0,
    ) -> None:
        self.run_dir = run_dir
        self.holder = holder
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.lost = False
        self.took_over = ""
        """What was taken over ("taking over ... from ...: why"), empty when the lease was free."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        """Serialises `beat`, `check` and `release` within this process (they move the file aside)."""

    @property
    def path(self) -> Path:
        """The lease file."""
        return self.run_dir / LEASE_FILE

    def _lost_error(self, now_holder: Holder | None) -> LeaseLost:
        self.lost = True
        err = LeaseLost(self.run_dir, now_holder, self.timeout_s)
        if not any(e.run_dir == err.run_dir for e in _LOST):
            _LOST.append(err)
        return err

    def still_mine(self) -> bool:
        """Whether the lease still carries this lease's token (read only)."""
        with self._lock:
            h = read_holder(self.run_dir)
            return not self.lost and h is not None and h.token == self.holder.token

    def check(self) -> None:
        """Raise `LeaseLost` when the lease no longer carries this lease's token (call before committing)."""
        with self._lock:
            if self.lost:
                raise self._lost_error(read_holder(self.run_dir))
            h = read_holder(self.run_dir)
            if h is None or h.token != self.holder.token:
                raise self._lost_error(h)

    def beat(self) -> None:
        """Renew the heartbeat; raise `LeaseLost` (and set `lost`) when the lease is no longer ours.

        Never overwrites: the current file is renamed aside, and only when what was moved carries our token
        is the renewed lease linked in (exclusive). A taker that linked its lease in meanwhile keeps it (a
        lease not ours is put back), and so does one that created lease.json while it was aside."""
        with self._lock:
            if self.lost:
                raise self._lost_error(read_holder(self.run_dir))
            new = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
            tmp = _temp_file(self.path, new)
            aside: Path | None = self.run_dir / f"{_ASIDE}{secrets.token_hex(4)}"
            try:
                try:
                    os.rename(self.path, aside)  # type: ignore[arg-type]
                except FileNotFoundError:
                    aside = None  # deleted, or being taken over: re-create it unless someone else does first
                if aside is not None:
                    moved = _read(aside)
                    if moved is None or moved.token != self.holder.token:
                        _put_back(aside, self.path)
                        raise self._lost_error(moved)
                try:
                    os.link(tmp, self.path)  # exclusive: fails when another process created it meanwhile
                except FileExistsError:
                    now = _read(self.path)
                    if now is None or now.token != self.holder.token:
                        raise self._lost_error(now) from None
                self.holder = new
            finally:
                if aside is not None:
                    aside.unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)

    def start_heartbeat(self) -> None:
        """Beat every `heartbeat_s` from a daemon thread until `release()`; when the lease was lost, log it,
        stop and call `on_lost`."""

        def loop() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    self.beat()
                except OSError as e:  # a file-system hiccup: try again next beat
                    log.warning("run lease %s: heartbeat failed (%s)", self.path, e)
                    continue
                except LeaseLost as lost:
                    log.error("%s", lost)
                    if self.on_lost is not None:
                        self.on_lost()
                    return

        self._thread = threading.Thread(target=loop, name=f"lease-{self.run_dir.name}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lease file if it is still ours (moved aside first, so a taker's
        lease is never removed)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        _HELD.discard(str(self.run_dir.resolve()))
        with self._lock:
            aside = self.run_dir / f"{_ASIDE}{secrets.token_hex(4)}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return
            moved = _read(aside)
            if moved is None or moved.token != self.holder.token:
                _put_back(aside, self.path)
            aside.unlink(missing_ok=True)


_HELD: set[str] = set()
"""Run folders this process holds a lease on (a second open in the same process is refused too)."""


def _temp_file(path: Path, holder: Holder) -> Path:
    """`holder` written and fsynced to a new temporary file beside `path` (the caller links it in)."""
    tmp = path.with_name(f".{path.name}.tmp.{holder.token}.{secrets.token_hex(4)}")
    try:
        with tmp.open("x") as f:
            json.dump(asdict(holder), f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _put_back(aside: Path, path: Path) -> None:
    """Give a lease moved aside back its name (unless a newer one took it, or a taker removed the aside)."""
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.link(aside, path)


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
    took_over = ""
    while True:
        held, where = _current(run_dir)
        if key in _HELD and held is not None:
            raise _held_error(run_dir, held, timeout_s)
        now = time.time()
        if held is not None:
            why = stale_reason(held, timeout_s, now)
            if why is None:  # live (also while it is aside: its holder is renewing or releasing it)
                took_over = ""
                if time.monotonic() >= deadline:
                    raise _held_error(run_dir, held, timeout_s)
                time.sleep(poll_s)
                continue
            aside = where is not None and where.name != LEASE_FILE
            if where is not None and aside:  # left by a holder that died mid-beat
                where.unlink(missing_ok=True)
            elif not _move_aside(run_dir, held):
                continue  # it changed meanwhile: look again
            took_over = f"took over the run lease {run_dir / LEASE_FILE} from {held.describe(now)}: {why}"
            if aside:
                continue  # more asides, or lease.json came back: look again
        me = Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=_proc_start(os.getpid()),
            flow_run_id=flow_run_id,
            token=secrets.token_hex(8),
            acquired=now,
            heartbeat=now,
        )
        tmp = _temp_file(run_dir / LEASE_FILE, me)
        try:
            os.link(tmp, run_dir / LEASE_FILE)  # exclusive: FileExistsError when another process got it first
        except FileExistsError:
            continue
        finally:
            tmp.unlink(missing_ok=True)
        if took_over:
            log.warning("%s", took_over)
        _HELD.add(key)
        lease = Lease(run_dir, me, heartbeat_s=max(0.2, timeout_s / 8), on_lost=on_lost, timeout_s=timeout_s)
        lease.took_over = took_over
        return lease


def _move_aside(run_dir: Path, stale: Holder) -> bool:
    """Rename the stale lease to a unique name; True when what was moved is the lease judged stale, unchanged
    (else put it back: its holder renewed it, or another process took over in between)."""
    aside = run_dir / f"{_ASIDE}{secrets.token_hex(4)}"
    try:
        os.rename(run_dir / LEASE_FILE, aside)
    except FileNotFoundError:
        return False  # another process moved it first
    moved = _read(aside)
    if moved != stale:
        _put_back(aside, run_dir / LEASE_FILE)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True
