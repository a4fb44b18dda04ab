"""Trust records: a stage file hashed once, by its writer or by one reader, is not hashed again by the other
processes that read it while it is provably unchanged.

Beside each stage file ``<stage>.arrow`` the store keeps ``.<stage>.arrow.trust``: the file's identity
(device, inode, size, mtime_ns, ctime_ns from ``stat``) at a moment its content hashed to a given sha256. A
reader whose ``stat`` before and after mapping the file equals the record's identity, and whose manifest names
the record's sha256, takes the file on trust. Any write through the filesystem sets a new ctime, so a record
is trusted only where a change in the same timestamp tick cannot hide: the file was *settled*
(:data:`TRUST_AFTER_S`) when its identity was taken, or the filesystem has *fine ctimes* (:func:`fine_ctime`).
Changes that bypass the filesystem (media bit-rot) are not caught; :data:`VERIFY_ENV` hashes every read.
Records are renamed into place without fsync and checksum their own text: a torn or lost record only costs
one more hash, and deleting records is always safe. The full argument: ``docs/STORE.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import uuid
from pathlib import Path

from dapo_core.errors import DapoUserError
from dapo_core.store.files import atomic_write_bytes

__all__ = [
    "TRUST_AFTER_S",
    "VERIFY_ENV",
    "StatKey",
    "fine_ctime",
    "read_record",
    "record_path",
    "settled",
    "stat_key",
    "trusts",
    "trustworthy",
    "verify_always",
    "write_record",
]

VERIFY_ENV = "DAPO_STORE_VERIFY"
"""Environment variable: ``always`` makes every verified read hash the whole file (no trust records, no
per-process trust); unset or ``trust`` (the default) uses them. It reaches Ray workers and subprocesses."""
TRUST_AFTER_S = 2.0
"""A record taken this long (seconds) after the file's last change is trusted on any filesystem (module
docstring: longer than any filesystem's timestamp tick)."""
RECORD_SUFFIX = ".trust"
"""A stage file ``<stage>.arrow``'s record is ``.<stage>.arrow.trust`` in the same folder."""
_VERSION = 1

StatKey = tuple[int, int, int, int, int]
"""(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) of a file."""

_FINE: dict[int, bool] = {}
"""st_dev -> the :func:`fine_ctime` probe's result in this process."""
_FINE_LOCK = threading.Lock()


def verify_always() -> bool:
    """True when :data:`VERIFY_ENV` asks every verified read to hash; a value other than ``always`` or
    ``trust`` is refused with the fix."""
    value = os.environ.get(VERIFY_ENV, "").strip().lower()
    if value in ("", "trust"):
        return False
    if value == "always":
        return True
    raise DapoUserError(
        f"environment variable {VERIFY_ENV}={os.environ[VERIFY_ENV]!r} is not understood: the run store's "
        f"verified reads accept 'always' (hash every stage file at every read) or 'trust' (the default: a "
        f"file hashed once, by its writer or a reader, is trusted while its stat identity is unchanged)",
        fix=f"set {VERIFY_ENV}=always or {VERIFY_ENV}=trust, or unset it",
    )


def stat_key(st: os.stat_result) -> StatKey:
    """The identity of a file a trust record holds (module docstring)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(key: StatKey, taken_ns: int) -> bool:
    """Whether a file with identity ``key`` had been unchanged for :data:`TRUST_AFTER_S` at ``taken_ns``."""
    return taken_ns - max(key[3], key[4]) >= TRUST_AFTER_S * 1e9


def fine_ctime(folder: str | Path) -> bool:
    """Whether the filesystem of ``folder`` gives a file a new ctime at every change that follows a ``stat``
    of it (module docstring). Probed once per process and device: a hidden temp file is created in
    ``folder``, then three times stat / one-byte write / stat; every write must move the ctime. False when the
    probe cannot run (a read-only or full filesystem, a folder just deleted): then only settled files are
    trusted, and the probe is tried again next time."""
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        return False
    with _FINE_LOCK:
        if dev in _FINE:
            return _FINE[dev]
    probe = Path(folder) / f".ctime-probe.tmp-{uuid.uuid4().hex[:12]}"
    fine = False
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"0")
            fine = True
            for i in range(3):
                before = os.fstat(fd).st_ctime_ns
                os.pwrite(fd, bytes([49 + i]), 0)
                if os.fstat(fd).st_ctime_ns == before:
                    fine = False
                    break
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError:  # not cached: the folder may have gone (retention) or be read-only just here
        return False
    with _FINE_LOCK:
        _FINE[dev] = fine
    return fine


def record_path(data_path: Path) -> Path:
    """The trust record of the stage file ``data_path``."""
    return data_path.with_name(f".{data_path.name}{RECORD_SUFFIX}")


def _body_check(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def write_record(data_path: Path, key: StatKey, sha256: str, taken_ns: int, fine: bool, how: str) -> None:
    """Record that the file ``data_path`` with identity ``key`` (taken at ``taken_ns``) hashes to ``sha256``;
    ``fine``: the recorder's filesystem gives fine ctimes (:func:`fine_ctime`); ``how``: ``write`` (the bytes
    were hashed as written) or ``read`` (hashed by a reader after ``key`` was taken). Atomic (temp file +
    rename, no fsync); a failure to write it (a full disk) is ignored: the record is a cache."""
    body = {
        "v": _VERSION,
        "key": list(key),
        "sha256": sha256,
        "taken_ns": int(taken_ns),
        "fine_ctime": bool(fine),
        "how": how,
    }
    body["check"] = _body_check(body)
    with contextlib.suppress(OSError):
        atomic_write_bytes(record_path(data_path), json.dumps(body).encode(), durable=False)


def read_record(data_path: Path) -> dict | None:
    """The trust record of ``data_path``, or None when it is missing, torn or garbled (its own checksum)."""
    try:
        body = json.loads(record_path(data_path).read_bytes())
        if not isinstance(body, dict) or body.get("v") != _VERSION:
            return None
        check = body.pop("check", None)
        if check != _body_check(body):
            return None
        body["key"] = tuple(int(x) for x in body["key"])
        if len(body["key"]) != 5 or not isinstance(body.get("sha256"), str):
            return None
        return body
    except (OSError, ValueError, TypeError, KeyError):
        return None


def trusts(record: dict | None, key: StatKey, sha256: str, fine_here: bool) -> bool:
    """Whether ``record`` lets a reader whose ``stat`` gives ``key`` and whose manifest names ``sha256`` take
    the file on trust: same identity, same hash, and settled when recorded or fine ctimes at both ends."""
    if record is None or record["key"] != key or record["sha256"] != sha256:
        return False
    return settled(key, int(record.get("taken_ns", 0))) or (bool(record.get("fine_ctime")) and fine_here)


def trustworthy(key: StatKey, taken_ns: int, fine: bool) -> bool:
    """Whether an identity ``key`` taken at ``taken_ns`` before hashing may be recorded or kept in memory."""
    return fine or settled(key, taken_ns)
